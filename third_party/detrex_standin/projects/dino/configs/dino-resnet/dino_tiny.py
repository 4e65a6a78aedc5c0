# DINO shrunk for tests: ResNet-18, one encoder and one decoder layer, 30 queries, top-20 detections,
# pictures resized to a 160-pixel short edge.
from detectron2.layers import ShapeSpec

from .dino_r50_4scale_12ep import dataloader, model, train

model.backbone.stages.depth = 18
model.backbone.stages.pop("stride_in_1x1")
model.neck.input_shapes = {"res3": ShapeSpec(channels=128), "res4": ShapeSpec(channels=256),
                           "res5": ShapeSpec(channels=512)}
model.transformer.encoder.num_layers = 1
model.transformer.decoder.num_layers = 1
model.transformer.encoder.feedforward_dim = 128
model.transformer.decoder.feedforward_dim = 128
model.num_queries = 30
model.select_box_nums_for_evaluation = 20

dataloader.test.mapper.augmentation[0].short_edge_length = 160
dataloader.test.mapper.augmentation[0].max_size = 256
