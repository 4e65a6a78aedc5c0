"""torch.export's program of the model, captured as torch.onnx would capture it, with the declared dynamic axes as
torch.export Dims. Apart so the program is read (size_assumptions.py) before torch.onnx drops its runtime asserts."""
from __future__ import annotations

import torch


def capture(module, args, shapes) -> torch.export.ExportedProgram:
    """torch.export's program of `module(*args)` as torch.onnx would capture it (non-strict, then strict; a size
    guard the declared axes break retried with torch's suggested fix, as it does), captured here so that the program
    is read before torch.onnx drops its runtime asserts: the lint reads what it assumed of the sizes from it."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    def attempt(strict: bool, shapes) -> torch.export.ExportedProgram:
        # as torch.onnx: size-oblivious 0/1 sizes, runtime asserts instead of guards where torch can defer them
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(module, args, dynamic_shapes=shapes, strict=strict,
                                       prefer_deferred_runtime_asserts_over_guards=True)

    failures = []
    for strict in (False, True):
        try:
            try:
                return attempt(strict, shapes)
            except torch._dynamo.exc.UserError as e:
                try:
                    refined = refine_dynamic_shapes_from_suggested_fixes(e.msg, shapes)
                except Exception:
                    raise e from None  # no fix torch suggests: its own error says what broke
                return attempt(strict, refined)
        except Exception as e:  # noqa: BLE001  (the next way, as torch.onnx tries it)
            failures.append(e)
    raise failures[0]


def dynamic_shapes(args, input_names, dynamic_axes):
    if not dynamic_axes:
        return None
    dims: dict[str, torch.export.Dim] = {}

    def dim(name: str):
        return dims.setdefault(name, torch.export.Dim(name, min=1))

    return tuple({i: dim(n) for i, n in dynamic_axes.get(name, {}).items()} or None for name in input_names)
