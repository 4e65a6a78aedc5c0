"""How the tests run an export (a config by name, written into `out`, with Hydra overrides) and feed a calibrator."""
from d2export import pipeline
from d2export.config import load


def export(config: str, out, *overrides: str):
    return pipeline.export(load(config, [f"export.output_dir={out}", *overrides]))


class Feeds:
    """What onnxruntime's calibrator asks of a reader (int8.Pictures' interface): a few feeds, a range at a time."""

    def __init__(self, items: list[dict]):
        self.items, self.at, self.end = items, 0, len(items)

    def __len__(self):
        return len(self.items)

    def set_range(self, start_index, end_index):
        self.at, self.end = start_index, min(end_index, len(self.items))

    def get_next(self):
        self.at += 1
        return self.items[self.at - 1] if self.at <= self.end else None
