"""DeepSolo++'s detection transformer and detector, on the DeepSolo stand-in: a language head and a text head per
script; inference routes each instance's characters through its language's head, as upstream's `inference()`."""
import torch
from torch import nn

from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY
from detectron2.structures import Instances

from deepsolo.modeling.model.detection_transformer import DETECTION_TRANSFORMER
from deepsolo.modeling.text_spotter import TransformerPureDetector, detector_postprocess
from deepsolo.utils.misc import inverse_sigmoid_offset, sigmoid_offset


class MultilingualTransformer(DETECTION_TRANSFORMER):
    def __init__(self, cfg, backbone):
        super().__init__(cfg, backbone)
        lang = cfg.MODEL.TRANSFORMER.LANGUAGE
        layers = len(self.ctrl_point_class)
        language = nn.Linear(self.d_model, len(lang.CLASSES))  # the script of each instance
        heads = nn.ModuleList([nn.Linear(self.d_model, int(v) + 1) for _, v in lang.VOC_SIZES])  # 0 the blank
        self.inst_language = nn.ModuleList([language for _ in range(layers)])
        self.ctrl_point_text = nn.ModuleList([heads for _ in range(layers)])

    def forward(self, samples):
        features, pos = self.backbone(samples)
        srcs, masks = [], []
        for lvl, feat in enumerate(features):
            src, mask = feat.decompose()
            srcs.append(self.input_proj[lvl](src))
            masks.append(mask)
        for lvl in range(len(srcs), self.num_feature_levels):
            src = self.input_proj[lvl](features[-1].tensors if lvl == len(features) else srcs[-1])
            mask = nn.functional.interpolate(masks[0][None].float(), size=src.shape[-2:]).to(torch.bool)[0]
            pos.append(self.backbone[1](type(features[0])(src, mask)).to(src.dtype))
            srcs.append(src)
            masks.append(mask)
        point_embed = self.point_embed.weight.reshape((self.num_proposals, self.num_points, self.d_model))
        hs, init_reference, inter_references, _, _ = self.transformer(srcs, masks, pos, point_embed)
        lvl = hs.shape[0] - 1  # inference reads the last layer
        reference = inverse_sigmoid_offset(init_reference if lvl == 0 else inter_references[lvl - 1],
                                           offset=self.sigmoid_offset)
        points = sigmoid_offset(self.ctrl_point_coord[lvl](hs[lvl]) + reference, offset=self.sigmoid_offset)
        bd = sigmoid_offset(self.boundary_offset[lvl](hs[lvl]) + reference.repeat(1, 1, 1, 2),
                            offset=self.sigmoid_offset)
        return {"pred_logits": self.ctrl_point_class[lvl](hs[lvl]), "pred_ctrl_points": points,
                "pred_bd_points": bd, "pred_lan_logits": self.inst_language[lvl](hs[lvl].mean(-2)),
                "pred_text_logits": [head(hs[lvl]) for head in self.ctrl_point_text[lvl]]}


class MultilingualSpotter(TransformerPureDetector):
    def __init__(self, cfg):
        super().__init__(cfg)
        head = self.detection_transformer
        self.detection_transformer = MultilingualTransformer(cfg, head.backbone)
        self.to(self.device)

    def forward(self, batched_inputs):
        images = self.preprocess_image(batched_inputs)
        out = self.detection_transformer(images)
        results = self.inference(out["pred_logits"], out["pred_ctrl_points"], out["pred_text_logits"],
                                 out["pred_bd_points"], out["pred_lan_logits"], images.image_sizes)
        return [{"instances": detector_postprocess(r, i.get("height", s[0]), i.get("width", s[1]))}
                for r, i, s in zip(results, batched_inputs, images.image_sizes)]

    def inference(self, ctrl_point_cls, ctrl_point_coord, text, bd_points, languages, image_sizes):
        """Upstream's: scores as DeepSolo's, each kept query's script the argmax of its language softmax, its
        characters the argmax of that script's head."""
        scores, labels = ctrl_point_cls.mean(-2).sigmoid().max(-1)
        languages = languages.softmax(-1).argmax(-1)
        results = []
        for idx, (score, points, bd, lan, size) in enumerate(zip(scores, ctrl_point_coord, bd_points, languages,
                                                                image_sizes)):
            keep = score >= self.test_score_threshold
            picked = torch.nonzero(keep)
            result = Instances(size)
            result.scores = score[keep]
            points = points[keep]
            points[..., 0] *= size[1]
            points[..., 1] *= size[0]
            result.ctrl_points = points.flatten(1)
            bd = bd[keep]
            bd[..., 0::2] *= size[1]
            bd[..., 1::2] *= size[0]
            result.bd = bd
            result.languages = lan[keep]
            recs = [text[l][idx][q].softmax(-1).argmax(-1) for l, q in zip(result.languages.tolist(), picked[:, 0])]
            result.recs = torch.stack(recs) if recs else torch.zeros(0, points.shape[1], dtype=torch.long)
            results.append(result)
        return results


META_ARCH_REGISTRY._obj_map.setdefault(MultilingualSpotter.__name__, MultilingualSpotter)
