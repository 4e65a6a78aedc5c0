"""What the pipeline hands verification: a staged graph, the cases it is checked on and the model they came from;
and the manifest such a graph is served with (`served_manifest`), which the pipeline completes with its records."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from d2export.kernels import custom_ops
from d2export.manifest import Manifest, graph_specs
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

    def served_manifest(self, graph: Path | None = None, precision: str = "") -> Manifest:
        """The manifest the runtime serves this graph (or `graph`, a copy at another precision) with."""
        return served_manifest(self.built, graph or self.path, self.exporter, precision)


def served_manifest(built, graph: Path, exporter: str, precision: str = "") -> Manifest:
    """What the runtime needs to serve a staged graph: its inputs and outputs (documented by the family), opset,
    custom operators, precision (the config's unless given) and the family's pre- and post-processing. The pipeline
    adds its records (versions, patches, verification, weights, hash); the checks that serve a graph as users receive
    it (int8's accuracy) serve it with this alone."""
    import onnx

    e = built.cfg.export
    model = onnx.load(str(graph), load_external_data=False)
    precision = precision or ("int8" if e.int8 else "float16" if e.fp16 else "bfloat16" if e.bf16 else "float32")
    preprocess = built.family.preprocess(built.d2cfg)
    if getattr(built, "size_divisibility", 0):  # the model runs only at its multiples: padded as when served
        preprocess["size_divisibility"] = built.size_divisibility
    return Manifest(
        model_file=graph.name, family=built.family.name,
        inputs=_documented(graph_specs(model.graph.input), built.family.input_docs),
        outputs=_documented(graph_specs(model.graph.output), built.family.output_docs),
        opset=next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), exporter=exporter,
        sampler=e.sampler, custom_ops=custom_ops.graph_ops(model), precision=precision,
        runtime=serving_runtime(e, precision), preprocess=preprocess,
        postprocess=built.family.postprocess(built.d2cfg) | built.charset
        | ({"in_graph": True} if e.postprocess == "graph" else {}))


def serving_runtime(e, precision: str) -> str:
    """What serves a graph of `precision` that export config `e` writes: OpenVINO for bfloat16, and for int8 where
    export.runtime says so; onnxruntime for the rest, the float32 graph a reduced one is judged against included."""
    if precision == "bfloat16" or (precision == "int8" and e.runtime == "openvino"):
        return "openvino"
    return "onnxruntime"


def _documented(specs: list, docs: dict[str, str]) -> list:
    return [dataclasses.replace(s, doc=s.doc or docs.get(s.name, "")) for s in specs]
