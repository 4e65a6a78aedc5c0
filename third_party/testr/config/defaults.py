"""The config keys TESTR adds to detectron2's (those of AdelaiDet's defaults that TESTR and its YAMLs use).

Upstream adds them to detectron2's global default config at import; here ``add_testr_config`` adds them to
the config it is given, so detectron2's defaults stay untouched.
"""
from detectron2.config import CfgNode as CN


def add_testr_config(cfg):
    """Adds TESTR's keys (MODEL.TRANSFORMER.*, TEST.USE_LEXICON, ...) with upstream's defaults, in place."""
    cfg.MODEL.MOBILENET = False
    cfg.MODEL.BACKBONE.ANTI_ALIAS = False
    cfg.MODEL.RESNETS.DEFORM_INTERVAL = 1
    cfg.INPUT.HFLIP_TRAIN = True
    cfg.INPUT.CROP.CROP_INSTANCE = True

    t = cfg.MODEL.TRANSFORMER = CN()
    t.USE_POLYGON = False
    t.ENABLED = False
    t.INFERENCE_TH_TEST = 0.45
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
    t.NUM_CTRL_POINTS = 8
    # not upstream's (False is upstream): each character slot's text queries sample around their own share of the
    # proposal's box (slot s of S centred at x0 + w (s + 0.5) / S, width 2w / S) instead of all around the whole box
    t.TEXT_SLOT_REFERENCES = False
    # not upstream's (False is upstream): the character slots read as DeepSolo's points do: trained with CTC (the
    # "no character" class is the blank) and read by collapsing runs, so slot s need not hold the word's s-th
    # character; with TEXT_SLOT_REFERENCES each slot reads what lies under its share of the box
    t.TEXT_CTC = False

    # training-only, kept so upstream's YAMLs merge
    loss = t.LOSS = CN()
    loss.AUX_LOSS = True
    loss.POINT_CLASS_WEIGHT = 2.0
    loss.POINT_COORD_WEIGHT = 5.0
    loss.POINT_TEXT_WEIGHT = 2.0
    # not upstream's (0 is upstream's matching): the cost, per unit of L1 distance, of matching a query to a word
    # away from its reference box's centre. The text queries sample only around that box, so a query matched to
    # another word is taught to read what it cannot see.
    loss.POINT_REF_WEIGHT = 0.0
    # not upstream's (0 is upstream): a linear classifier reads each character from the finest feature map at its
    # centre (estimated along the word's midline) while training, so that the backbone learns what characters look
    # like where the text queries sample. Measured: a linear probe of the micro spotter's stride-8 features at the
    # characters' centres read 5.9% of characters (as always guessing the commonest), 9.3% after 2,600 more steps
    loss.CHAR_CENTRE_WEIGHT = 0.0
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
    # not upstream's (1.0 is upstream): the text branch (character slots' queries, their attention and classifier;
    # parameters named "text") at BASE_LR times this, so recognition can learn fast from weights whose detection a
    # higher base rate would throw away
    cfg.SOLVER.LR_TEXT_MULT = 1.0

    cfg.TEST.USE_LEXICON = False
    # 1 generic, 2 weak, 3 strong (ICDAR 2015); 1 full lexicon (Total-Text, CTW1500)
    cfg.TEST.LEXICON_TYPE = 1
    cfg.TEST.WEIGHTED_EDIT_DIST = False
    return cfg
