"""The config keys DPText-DETR adds to detectron2's (those of its ``adet/config/defaults.py`` its YAMLs use), with
upstream's defaults. Upstream adds them to detectron2's global defaults at import; ``add_dptext_config`` adds them
to the config it is given."""
from detectron2.config import CfgNode as CN
from detectron2.config import get_cfg as _get_d2_cfg


def add_dptext_config(cfg):
    """Adds DPText-DETR's keys in place and makes ``TransformerPureDetector`` build DPText-DETR's detector."""
    from dptext.modeling.transformer_detector import use_this_detector

    use_this_detector()
    cfg.MODEL.MOBILENET = False
    cfg.MODEL.BACKBONE.ANTI_ALIAS = False
    cfg.MODEL.RESNETS.DEFORM_INTERVAL = 1
    cfg.INPUT.HFLIP_TRAIN = False
    cfg.INPUT.CROP.CROP_INSTANCE = True

    cfg.MODEL.BATEXT = CN()
    cfg.MODEL.BATEXT.VOC_SIZE = 96
    cfg.MODEL.BATEXT.NUM_CHARS = 25
    cfg.MODEL.BATEXT.CUSTOM_DICT = ""

    t = cfg.MODEL.TRANSFORMER = CN()
    t.USE_POLYGON = False
    t.ENABLED = True
    t.INFERENCE_TH_TEST = 0.3
    t.VOC_SIZE = 96
    t.NUM_CHARS = 25
    t.AUX_LOSS = True
    t.ENC_LAYERS = 6
    t.DEC_LAYERS = 6
    t.DIM_FEEDFORWARD = 1024
    t.HIDDEN_DIM = 256
    t.DROPOUT = 0.1
    t.NHEADS = 8
    t.NUM_QUERIES = 100
    t.ENC_N_POINTS = 4
    t.DEC_N_POINTS = 4
    t.POSITION_EMBEDDING_SCALE = 6.283185307179586  # 2 pi
    t.NUM_FEATURE_LEVELS = 4
    t.NUM_CTRL_POINTS = 16
    t.EPQM = False  # explicit point query modelling
    t.EFSA = False  # enhanced factorised self-attention

    loss = t.LOSS = CN()  # training only, kept so upstream's YAMLs merge
    loss.AUX_LOSS = True
    loss.POINT_CLASS_WEIGHT = 2.0
    loss.POINT_COORD_WEIGHT = 5.0
    loss.BOX_CLASS_WEIGHT = 2.0
    loss.BOX_COORD_WEIGHT = 5.0
    loss.BOX_GIOU_WEIGHT = 2.0
    loss.FOCAL_ALPHA = 0.25
    loss.FOCAL_GAMMA = 2.0

    cfg.SOLVER.OPTIMIZER = "ADAMW"
    cfg.SOLVER.LR_BACKBONE = 1e-5
    cfg.SOLVER.LR_BACKBONE_NAMES = []
    cfg.SOLVER.LR_LINEAR_PROJ_NAMES = []
    cfg.SOLVER.LR_LINEAR_PROJ_MULT = 0.1

    cfg.TEST.DET_ONLY = True
    cfg.TEST.USE_LEXICON = False
    cfg.TEST.LEXICON_TYPE = 1
    cfg.TEST.WEIGHTED_EDIT_DIST = False
    return cfg


def get_cfg():
    """A fresh detectron2 config with DPText-DETR's keys added."""
    return add_dptext_config(_get_d2_cfg())
