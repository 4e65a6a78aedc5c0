"""DPText-DETR's detectron2 meta-architecture: image batching, padding masks, inference and rescaling.

Inference only: upstream's losses, matchers and target preparation are left out. The backbone wrapper, the
joiner and detector_postprocess are AdelaiDet's (TESTR's) unchanged, taken from the testr stand-in.
"""
import torch
from torch import nn

from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY
from detectron2.structures import ImageList, Instances

from dptext.layers.pos_encoding import PositionalEncoding2D
from dptext.modeling.dptext_detr.models import DPText_DETR
from testr.modeling.transformer_detector import Joiner, MaskedBackbone, detector_postprocess


class TransformerPureDetector(nn.Module):
    """DPText-DETR on a detectron2 backbone: list[dict] in, list[{"instances": Instances}] out."""

    def __init__(self, cfg):
        super().__init__()
        self.device = torch.device(cfg.MODEL.DEVICE)
        d2_backbone = MaskedBackbone(cfg)
        N_steps = cfg.MODEL.TRANSFORMER.HIDDEN_DIM // 2
        self.test_score_threshold = cfg.MODEL.TRANSFORMER.INFERENCE_TH_TEST
        self.use_polygon = cfg.MODEL.TRANSFORMER.USE_POLYGON
        self.num_ctrl_points = cfg.MODEL.TRANSFORMER.NUM_CTRL_POINTS
        assert self.use_polygon and self.num_ctrl_points == 16  # upstream released only the polygon version
        backbone = Joiner(d2_backbone, PositionalEncoding2D(N_steps, normalize=True))
        backbone.num_channels = d2_backbone.num_channels
        self.dptext_detr = DPText_DETR(cfg, backbone)

        # plain tensors in a closure, not buffers: not in the state dict, and not moved by .to()
        pixel_mean = torch.Tensor(cfg.MODEL.PIXEL_MEAN).to(self.device).view(3, 1, 1)
        pixel_std = torch.Tensor(cfg.MODEL.PIXEL_STD).to(self.device).view(3, 1, 1)
        self.normalizer = lambda x: (x - pixel_mean) / pixel_std
        self.to(self.device)

    def preprocess_image(self, batched_inputs):
        """Normalise, pad and batch the input images."""
        images = [self.normalizer(x["image"].to(self.device)) for x in batched_inputs]
        return ImageList.from_tensors(images)

    def forward(self, batched_inputs):
        """batched_inputs: list of dicts with "image" (C, H, W) and optional "height", "width" (the output size).
        Returns one {"instances": Instances} per image with scores, pred_classes and polygons (n, 2 * n_pts)."""
        if self.training:
            raise NotImplementedError("this DPText-DETR stand-in implements inference only")
        images = self.preprocess_image(batched_inputs)
        output = self.dptext_detr(images)
        results = self.inference(output["pred_logits"], output["pred_ctrl_points"], images.image_sizes)
        processed_results = []
        for results_per_image, input_per_image, image_size in zip(results, batched_inputs, images.image_sizes):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            processed_results.append({"instances": detector_postprocess(results_per_image, height, width)})
        return processed_results

    def inference(self, ctrl_point_cls, ctrl_point_coord, image_sizes):
        """Keeps the queries whose mean point score passes the threshold; points to input pixels, in place."""
        assert len(ctrl_point_cls) == len(image_sizes)
        results = []
        prob = ctrl_point_cls.mean(-2).sigmoid()
        scores, labels = prob.max(-1)
        for scores_per_image, labels_per_image, ctrl_point_per_image, image_size in zip(
                scores, labels, ctrl_point_coord, image_sizes):
            selector = scores_per_image >= self.test_score_threshold
            ctrl_point_per_image = ctrl_point_per_image[selector]
            result = Instances(image_size)
            result.scores = scores_per_image[selector]
            result.pred_classes = labels_per_image[selector]
            ctrl_point_per_image[..., 0] *= image_size[1]
            ctrl_point_per_image[..., 1] *= image_size[0]
            if self.use_polygon:
                result.polygons = ctrl_point_per_image.flatten(1)
            else:
                result.beziers = ctrl_point_per_image.flatten(1)
            results.append(result)
        return results


def use_this_detector():
    """Binds the meta-architecture name to this package's detector. Upstream registers it with
    ``@META_ARCH_REGISTRY.register()``; DeepSolo's detector has the same name, and this repository's tests build both
    stand-ins in one process, so the name follows the config in use (``add_dptext_config`` calls this)."""
    META_ARCH_REGISTRY._obj_map[TransformerPureDetector.__name__] = TransformerPureDetector


use_this_detector()
