"""DeepSolo's detectron2 meta-architecture: image batching, padding masks, inference and rescaling.

Inference only: upstream's losses, matchers and target preparation are left out. The backbone wrapper and the
joiner are AdelaiDet's (TESTR's) unchanged, taken from the testr stand-in.
"""
import torch
from torch import nn

from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY
from detectron2.structures import ImageList, Instances

from deepsolo.layers.pos_encoding import PositionalEncoding2D
from deepsolo.modeling.model.detection_transformer import DETECTION_TRANSFORMER
from testr.modeling.transformer_detector import Joiner, MaskedBackbone


def detector_postprocess(results, output_height, output_width, min_size=None, max_size=None):
    """Scales the points to (output_height, output_width), in place. With min_size and max_size (ViTAE backbones)
    the scale comes from the resized size those imply rather than the padded input size, as upstream."""
    if min_size and max_size:
        size = min_size * 1.0
        scale_img_size = min_size / min(output_width, output_height)
        if output_height < output_width:
            newh, neww = size, scale_img_size * output_width
        else:
            newh, neww = scale_img_size * output_height, size
        if max(newh, neww) > max_size:
            scale = max_size * 1.0 / max(newh, neww)
            newh, neww = newh * scale, neww * scale
        scale_x, scale_y = (output_width / int(neww + 0.5), output_height / int(newh + 0.5))
    else:
        scale_x, scale_y = (output_width / results.image_size[1], output_height / results.image_size[0])
    if results.has("ctrl_points"):
        ctrl_points = results.ctrl_points
        ctrl_points[:, 0::2] *= scale_x
        ctrl_points[:, 1::2] *= scale_y
    if results.has("bd") and not isinstance(results.bd, list):
        bd = results.bd
        bd[..., 0::2] *= scale_x
        bd[..., 1::2] *= scale_y
    return results


class TransformerPureDetector(nn.Module):
    """DeepSolo on a detectron2 backbone: list[dict] in, list[{"instances": Instances}] out."""

    def __init__(self, cfg):
        super().__init__()
        self.device = torch.device(cfg.MODEL.DEVICE)
        N_steps = cfg.MODEL.TRANSFORMER.HIDDEN_DIM // 2
        self.test_score_threshold = cfg.MODEL.TRANSFORMER.INFERENCE_TH_TEST
        self.min_size_test = None
        self.max_size_test = None
        if cfg.MODEL.BACKBONE.NAME == "build_vitaev2_backbone":
            self.min_size_test = cfg.INPUT.MIN_SIZE_TEST
            self.max_size_test = cfg.INPUT.MAX_SIZE_TEST
        d2_backbone = MaskedBackbone(cfg)
        backbone = Joiner(d2_backbone,
                          PositionalEncoding2D(N_steps, cfg.MODEL.TRANSFORMER.TEMPERATURE, normalize=True))
        backbone.num_channels = d2_backbone.num_channels
        self.detection_transformer = DETECTION_TRANSFORMER(cfg, backbone)

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
        Returns one {"instances": Instances} per image with scores, pred_classes, rec_scores (n, P, voc + 1),
        recs (n, P), ctrl_points (n, 2 * P) and bd (n, P, 4), or a list of None without the boundary head."""
        if self.training:
            raise NotImplementedError("this DeepSolo stand-in implements inference only")
        images = self.preprocess_image(batched_inputs)
        output = self.detection_transformer(images)
        results = self.inference(output["pred_logits"], output["pred_ctrl_points"], output["pred_text_logits"],
                                 output["pred_bd_points"], images.image_sizes)
        processed_results = []
        for results_per_image, input_per_image, image_size in zip(results, batched_inputs, images.image_sizes):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            r = detector_postprocess(results_per_image, height, width, self.min_size_test, self.max_size_test)
            processed_results.append({"instances": r})
        return processed_results

    def inference(self, ctrl_point_cls, ctrl_point_coord, ctrl_point_text, bd_points, image_sizes):
        """Keeps the queries whose mean point score passes the threshold; points to input pixels, in place."""
        assert len(ctrl_point_cls) == len(image_sizes)
        results = []
        ctrl_point_text = torch.softmax(ctrl_point_text, dim=-1)
        prob = ctrl_point_cls.mean(-2).sigmoid()
        scores, labels = prob.max(-1)
        bds = bd_points if bd_points is not None else [None] * len(scores)
        for scores_per_image, labels_per_image, ctrl_point_per_image, text_per_image, bd, image_size in zip(
                scores, labels, ctrl_point_coord, ctrl_point_text, bds, image_sizes):
            selector = scores_per_image >= self.test_score_threshold
            ctrl_point_per_image = ctrl_point_per_image[selector]
            text_per_image = text_per_image[selector]
            result = Instances(image_size)
            result.scores = scores_per_image[selector]
            result.pred_classes = labels_per_image[selector]
            result.rec_scores = text_per_image
            ctrl_point_per_image[..., 0] *= image_size[1]
            ctrl_point_per_image[..., 1] *= image_size[0]
            result.ctrl_points = ctrl_point_per_image.flatten(1)
            _, text_pred = text_per_image.topk(1)
            result.recs = text_pred.squeeze(-1)
            if bd is not None:
                bd = bd[selector]
                bd[..., 0::2] *= image_size[1]
                bd[..., 1::2] *= image_size[0]
                result.bd = bd
            else:
                result.bd = [None] * len(result.scores)
            results.append(result)
        return results


def use_this_detector():
    """Binds the meta-architecture name to this package's detector. Upstream registers it with
    ``@META_ARCH_REGISTRY.register()``; DPText-DETR's detector has the same name, and this repository's tests build
    both stand-ins in one process, so the name follows the config in use (``add_deepsolo_config`` calls this)."""
    META_ARCH_REGISTRY._obj_map[TransformerPureDetector.__name__] = TransformerPureDetector


use_this_detector()
