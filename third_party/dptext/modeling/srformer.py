"""An SRFormer-style head and detector (retsuh-bqw/SRFormer-Text-Det: DPText-DETR's lineage with a segmentation
branch), written for d2export's tests: what SRFormer changes that an exporter sees, on DPText-DETR's stand-in.

- The head is the detector's child `srformer`. Points are regressed by offsets (`offset_embed`, no
  `ctrl_point_coord`), and the class logits are per query ([N, K, C]: the query's points aggregated first), which its
  inference scores `sigmoid().max(-1)`.
- A mask branch (an `nn.TransformerEncoderLayer` refining the queries, `mask_embed` over the finest level split
  off the memory by the levels' sizes) makes `pred_seg_mask`, and inference uses it as
  SRFormer's does: the mask, softmaxed over its pixels, weighs a coordinate grid made by `torch.linspace` over its
  height and width into an anchor point that moves the regressed points ("mask as anchor prior").
Inference only, as the DPText-DETR stand-in.
"""
import torch
from torch import nn

from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY
from detectron2.structures import Instances

from dptext.modeling.dptext_detr.models import DPText_DETR
from dptext.modeling.dptext_detr.utils import MLP
from dptext.modeling.transformer_detector import TransformerPureDetector
from dptext.utils.misc import inverse_sigmoid_offset, sigmoid_offset


class SRFormerHead(DPText_DETR):
    def __init__(self, cfg, backbone):
        super().__init__(cfg, backbone)
        self.offset_embed = self.ctrl_point_coord  # SRFormer's name for the point regressor
        del self.ctrl_point_coord
        self.mask_embed = MLP(self.d_model, self.d_model, self.d_model, 2)
        # SRFormer refines the mask queries with a torch transformer layer (eval: torch's fused fast path)
        self.mask_refine = nn.TransformerEncoderLayer(self.d_model, 2, self.dim_feedforward, dropout=0.0,
                                                      batch_first=True)

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
        queries = self.ctrl_point_embed.weight[None, ...].repeat(self.num_proposals, 1, 1)
        hs, init_reference, inter_references, _, _ = self.transformer(srcs, masks, pos, queries)
        classes, coords = [], []
        for lvl in range(hs.shape[0]):
            reference = inverse_sigmoid_offset(init_reference if lvl == 0 else inter_references[lvl - 1],
                                               offset=self.sigmoid_offset)
            classes.append(self.ctrl_point_class[lvl](hs[lvl].mean(-2)))  # per query: its points aggregated
            offset = self.offset_embed[lvl](hs[lvl]) + (reference if self.epqm else reference[:, :, None, :2])
            coords.append(sigmoid_offset(offset, offset=self.sigmoid_offset))
        mask = self.segmentation(hs[-1], srcs)
        return {"pred_logits": classes[-1], "pred_ctrl_points": (coords[-1] + self.anchor(mask)[:, :, None]) / 2,
                "pred_seg_mask": mask}

    def anchor(self, mask):
        """Each query's mask as an anchor prior: its softmax over the pixels weighs their (x, y) centres in [0, 1]."""
        n, q, h, w = mask.shape
        y, x = torch.meshgrid(torch.linspace(1 / (h + 1), h / (h + 1), h), torch.linspace(1 / (w + 1), w / (w + 1), w),
                              indexing="ij")
        grid = torch.stack((x, y), -1).to(mask)
        weights = mask.flatten(2).softmax(-1).view(n, q, h, w, 1)
        return (grid * weights).sum((2, 3))

    def segmentation(self, hs, srcs):
        """A mask per query on the finest level: the memory split into its levels (each level's size, H * W), the
        refined queries' embeddings against the finest one's features."""
        memory = torch.cat([s.flatten(2) for s in srcs], 2)
        finest = torch.split(memory, [s.shape[-2] * s.shape[-1] for s in srcs], dim=2)[0]
        queries = self.mask_refine(hs.mean(-2))
        return torch.einsum("nqc,nchw->nqhw", self.mask_embed(queries), finest.reshape(srcs[0].shape))


class SRFormerDetector(TransformerPureDetector):
    """SRFormer's meta-architecture: DPText-DETR's, its head the child `srformer`, scored per query."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.srformer = SRFormerHead(cfg, self.dptext_detr.backbone)
        del self.dptext_detr
        self.to(self.device)

    def forward(self, batched_inputs):
        images = self.preprocess_image(batched_inputs)
        output = self.srformer(images)
        results = self.inference(output["pred_logits"], output["pred_ctrl_points"], images.image_sizes)
        from testr.modeling.transformer_detector import detector_postprocess

        return [{"instances": detector_postprocess(r, i.get("height", s[0]), i.get("width", s[1]))}
                for r, i, s in zip(results, batched_inputs, images.image_sizes)]

    def inference(self, ctrl_point_cls, ctrl_point_coord, image_sizes):
        scores, labels = ctrl_point_cls.sigmoid().max(-1)  # per query, as SRFormer's inference
        results = []
        for score, label, points, size in zip(scores, labels, ctrl_point_coord, image_sizes):
            keep = score >= self.test_score_threshold
            points = points[keep]
            result = Instances(size)
            result.scores, result.pred_classes = score[keep], label[keep]
            points[..., 0] *= size[1]
            points[..., 1] *= size[0]
            result.polygons = points.flatten(1)
            results.append(result)
        return results


META_ARCH_REGISTRY._obj_map.setdefault(SRFormerDetector.__name__, SRFormerDetector)
