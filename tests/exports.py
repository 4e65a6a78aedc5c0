"""How the tests run an export: a config by name, written into `out`, with Hydra overrides."""
from d2export import pipeline
from d2export.config import load

# The micro spotter before its text branch was trained alone (the recipe's step 2, tests/data/spotter_step2.json):
# reduced precision is verified on it. The fixture that reads (step 3) is refused in float16 and int8: a few
# character slots' probabilities move by 0.08-0.28 in confident words (docs/precision.md)
STEP2 = "model.weights=tests/data/spotter_step2.pth"


def export(config: str, out, *overrides: str):
    return pipeline.export(load(config, [f"export.output_dir={out}", *overrides]))
