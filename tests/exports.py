"""How the tests run an export: a config by name, written into `out`, with Hydra overrides."""
from d2export import pipeline
from d2export.config import load


def export(config: str, out, *overrides: str):
    return pipeline.export(load(config, [f"export.output_dir={out}", *overrides]))
