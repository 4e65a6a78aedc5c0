"""onnxruntime sessions for checking a staged graph, shared by float32 and reduced-precision verification."""
from __future__ import annotations

from pathlib import Path

from d2export.kernels import custom_ops


def session_options(path: Path):
    """Session options with the custom operators the graph at `path` uses registered, on as many threads as the eager
    references beside them (torch's: every core, or what OMP_NUM_THREADS or torch.set_num_threads asked)."""
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    return custom_ops.register(options, custom_ops.file_ops(path))


def session(path: Path, providers, precision: str = "float32"):
    """An onnxruntime session for checking the staged graph, with the custom operators it uses registered and what a
    served model of `precision` gets by default on each provider (runtime/providers.py: on CUDA, TF32 off for float32
    graphs, MatMul+Add left unfused)."""
    import onnxruntime as ort

    from d2export.runtime.providers import resolve_providers, serving_settings

    providers, options = resolve_providers(providers), session_options(path)
    per_provider = serving_settings(options, providers, precision)
    return ort.InferenceSession(str(path), options, providers=providers, provider_options=per_provider)


def openvino_sessions(path: Path, precision: str):
    """The graph of `precision` (the manifest's: "int8", "bfloat16") as OpenVINO serves it, on as many threads as the
    eager references, and its selecting copy on the same: (session, copy)."""
    import torch

    from d2export.runtime import openvino_session
    from d2export.verification import near_ties

    threads = torch.get_num_threads()
    session = openvino_session.OpenVINOSession(path, precision, threads)
    return session, near_ties.SelectingCopy(path, open_model=lambda m: openvino_session.open_model(m, precision,
                                                                                                      threads))


def ran_on(session, path: Path) -> dict:
    """The providers a verification really ran on, with their options and the graph transformers left out, and for a
    fused graph the kernel that computed its operator ("native", "numba" or "cuda"): what a server must use to serve
    the same."""
    from d2export.runtime.providers import disabled_optimizers, exact_int8

    ran = {"providers": session.get_providers(), "provider_options": session.get_provider_options(),
           "disabled_optimizers": disabled_optimizers(session), "exact_int8": exact_int8(session)}
    kernel = custom_ops.serving_kernel(custom_ops.file_ops(path), session.get_providers())
    return ran | ({"msda_kernel": kernel} if kernel else {})


def selecting_copy(path: Path):
    """The graph's copy that exposes its selections (near_ties.SelectingCopy), on the sessions' options (made when it
    opens: they read the file for its custom operators): one per verification, shared by its pinning and its near-tie
    lines."""
    from d2export.verification import near_ties

    return near_ties.SelectingCopy(path, lambda: session_options(path))


def near_ties_lines(copy, cases, results, precision: str) -> str:
    """For a failed verification: the selections of the graph `copy` opens that are near-tied on the failing cases
    ('' if none)."""
    from d2export.verification import near_ties

    failed = {r.case for r in results if not r.ok}
    found = near_ties.describe(copy, [c for c in cases if c.name in failed], precision)
    return f"\n{found}" if found else ""
