"""How the tests run an export: a config by name, written into `out`, with Hydra overrides."""
from d2export import pipeline
from d2export.config import load

# The micro spotter before its text branch was trained alone (the recipe's step 2, tests/data/spotter_step2.json):
# int8 and the planted-ties float16 test run on it. The fixture that reads (step 3) verifies in float16 on pictures
# of its domain (verify.pictures); its int8 graphs are refused there too: a character slot's probability in a
# confident word moves by 0.07-0.11 (docs/precision.md)
STEP2 = "model.weights=tests/data/spotter_step2.pth"


def export(config: str, out, *overrides: str):
    return pipeline.export(load(config, [f"export.output_dir={out}", *overrides]))
