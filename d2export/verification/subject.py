"""What the pipeline hands verification: a staged graph, the cases it is checked on and the model they came from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from d2export.verification import comparison


@dataclass
class Subject:
    """A staged graph and what it is checked against: the cases (inputs, eager outputs) and the model they came from
    (the pipeline's `Built`: its config and family say the tolerances, its adapter reruns failed cases eagerly with
    the graph's selections pinned, and the parity ladder re-exports it)."""

    built: object
    path: Path
    cases: Sequence[comparison.Case]
    route: str = ""  # the exporter that wrote the graph (export.exporter=auto chooses it); "": the config's first

    @property
    def exporter(self) -> str:
        from d2export.exporting.onnx_export import routes

        return self.route or routes(self.built.cfg.export.exporter)[0]

    @property
    def output_names(self) -> list[str]:
        return self.built.adapter.output_names
