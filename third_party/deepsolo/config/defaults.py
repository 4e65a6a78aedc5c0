"""The config keys DeepSolo adds to detectron2's (those of its ``adet/config/defaults.py`` its YAMLs and model use),
with upstream's defaults. Upstream adds them to detectron2's global defaults at import; ``add_deepsolo_config`` adds
them to the config it is given."""
from detectron2.config import CfgNode as CN
from detectron2.config import get_cfg as _get_d2_cfg


def add_deepsolo_config(cfg):
    """Adds DeepSolo's keys in place and makes ``TransformerPureDetector`` build DeepSolo's detector."""
    from deepsolo.modeling.text_spotter import use_this_detector

    use_this_detector()
    cfg.MODEL.MOBILENET = False
    cfg.MODEL.BACKBONE.ANTI_ALIAS = False
    cfg.MODEL.RESNETS.DEFORM_INTERVAL = 1
    cfg.INPUT.HFLIP_TRAIN = False
    cfg.INPUT.CROP.CROP_INSTANCE = True
    cfg.INPUT.ROTATE = True

    b = cfg.MODEL.BATEXT = CN()
    b.VOC_SIZE = 96
    b.NUM_CHARS = 25
    b.CUSTOM_DICT = ""  # a pickled list of code points (non-Latin models)

    cfg.MODEL.SWIN = CN()
    cfg.MODEL.SWIN.TYPE = "tiny"
    cfg.MODEL.SWIN.DROP_PATH_RATE = 0.2
    cfg.MODEL.ViTAEv2 = CN()
    cfg.MODEL.ViTAEv2.TYPE = "vitaev2_s"
    cfg.MODEL.ViTAEv2.DROP_PATH_RATE = 0.2

    t = cfg.MODEL.TRANSFORMER = CN()
    t.ENABLED = False
    t.INFERENCE_TH_TEST = 0.4
    t.AUX_LOSS = True
    t.ENC_LAYERS = 6
    t.DEC_LAYERS = 6
    t.DIM_FEEDFORWARD = 1024
    t.HIDDEN_DIM = 256
    t.DROPOUT = 0.0
    t.NHEADS = 8
    t.NUM_QUERIES = 100
    t.ENC_N_POINTS = 4
    t.DEC_N_POINTS = 4
    t.POSITION_EMBEDDING_SCALE = 6.283185307179586  # 2 pi
    t.NUM_FEATURE_LEVELS = 4
    t.VOC_SIZE = 37  # a-z, 0-9 and "unknown"
    t.CUSTOM_DICT = ""  # where DeepSolo's visualizer and evaluator read a custom dictionary (ReCTS: chn_cls_list)
    t.NUM_POINTS = 25  # point queries per instance
    t.TEMPERATURE = 10000
    t.BOUNDARY_HEAD = True  # boundary points around the centre line

    loss = t.LOSS = CN()  # training only, kept so upstream's YAMLs merge
    loss.AUX_LOSS = True
    loss.FOCAL_ALPHA = 0.25
    loss.FOCAL_GAMMA = 2.0
    loss.BEZIER_CLASS_WEIGHT = 1.0
    loss.BEZIER_COORD_WEIGHT = 1.0
    loss.BEZIER_SAMPLE_POINTS = 25
    loss.POINT_CLASS_WEIGHT = 1.0
    loss.POINT_COORD_WEIGHT = 1.0
    loss.POINT_TEXT_WEIGHT = 0.5
    loss.BOUNDARY_WEIGHT = 0.5

    cfg.SOLVER.OPTIMIZER = "ADAMW"
    cfg.SOLVER.LR_BACKBONE = 1e-5
    cfg.SOLVER.LR_BACKBONE_NAMES = []
    cfg.SOLVER.LR_LINEAR_PROJ_NAMES = []
    cfg.SOLVER.LR_LINEAR_PROJ_MULT = 0.1
    cfg.TEST.LEXICON_TYPE = 1
    return cfg


def get_cfg():
    """A fresh detectron2 config with DeepSolo's keys added."""
    return add_deepsolo_config(_get_d2_cfg())
