"""Which module of the exported model an ONNX node came from, and which nodes are the MSDA sampling core.

Both exporters record module paths: the TorchScript-based one in node names ("/testr/transformer/encoder/layers.0/
self_attn/Gather_12"), the torch.export-based one in the node's metadata ("pkg.torch.onnx.name_scopes"). An MSDA
module is recognised as in `patching.msda_swap`, by what it has: a child scope named `sampling_offsets`. Its
sampling core is every node directly in its scope (locations, softmax, bilinear windows, Gather, MatMul); its
projections sit in child scopes and are not part of it.
"""
from __future__ import annotations

import ast

import onnx

_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def node_scope(node: onnx.NodeProto) -> str:
    """The dotted module path a node was recorded in ("" at the top level)."""
    for prop in node.metadata_props:
        if prop.key == _SCOPES_KEY:  # enclosing modules outermost first, then the node's own name; each entry a
            try:                     # full path or, for calls made through a patched forward, a child's name
                names = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            path = ""
            for name in names[:-1]:
                if name:
                    path = name if not path or name.startswith(path + ".") else f"{path}.{name}"
            return path
    if node.name.startswith("/"):
        return node.name.strip("/").rpartition("/")[0].replace("/", ".")
    return ""


def msda_scopes(graph: onnx.GraphProto) -> set[str]:
    """Module paths of the MSDA modules in the graph (parents of a `sampling_offsets` scope)."""
    found = set()
    for node in graph.node:
        parts = node_scope(node).split(".")
        if "sampling_offsets" in parts:
            found.add(".".join(parts[:parts.index("sampling_offsets")]))
    return found


def is_msda_core(node: onnx.NodeProto, scopes: set[str]) -> bool:
    return node_scope(node) in scopes
