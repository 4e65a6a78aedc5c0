"""A DNTextSpotter-style detector (yyyyyxie/DNTextSpotter: DeepSolo with denoising queries used only in training),
written for d2export's tests: what it changes that an exporter sees, on DeepSolo's stand-in. Its detection
transformer takes `dn_args` and returns `(outputs, mask_dict)`, the denoising record None at inference; the detector
unpacks the pair. Inference only.
"""
from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY

from deepsolo.modeling.model.detection_transformer import DETECTION_TRANSFORMER
from deepsolo.modeling.text_spotter import TransformerPureDetector, detector_postprocess


class DNDetectionTransformer(DETECTION_TRANSFORMER):
    def forward(self, samples, dn_args=None):
        if dn_args is not None:
            raise NotImplementedError("denoising queries are training's: this stand-in implements inference only")
        return super().forward(samples), None


class DNTextSpotter(TransformerPureDetector):
    def __init__(self, cfg):
        super().__init__(cfg)
        head = self.detection_transformer
        self.detection_transformer = DNDetectionTransformer.__new__(DNDetectionTransformer)
        self.detection_transformer.__dict__ = head.__dict__  # the same modules and weights, DN's calling convention

    def forward(self, batched_inputs):
        images = self.preprocess_image(batched_inputs)
        output, mask_dict = self.detection_transformer(images)
        results = self.inference(output["pred_logits"], output["pred_ctrl_points"], output["pred_text_logits"],
                                 output["pred_bd_points"], images.image_sizes)
        return [{"instances": detector_postprocess(r, i.get("height", s[0]), i.get("width", s[1]), self.min_size_test,
                                                   self.max_size_test)}
                for r, i, s in zip(results, batched_inputs, images.image_sizes)]


META_ARCH_REGISTRY._obj_map.setdefault(DNTextSpotter.__name__, DNTextSpotter)
