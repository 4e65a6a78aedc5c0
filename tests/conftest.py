import os
import sys

# third_party/ holds model code standing in for users' projects (testr, dptext, deepsolo, and `detrex` + `projects`
# in detrex_standin/, importable as from a detrex checkout); d2export never imports it
_THIRD_PARTY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party")
for _path in (_THIRD_PARTY, os.path.join(_THIRD_PARTY, "detrex_standin")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pytest  # noqa: E402

import torch  # noqa: E402

# at most 2 threads, and the cores shared out among pytest-xdist's workers (`make test` runs one per core): torch's
# threads beyond the cores a worker has would only wait on one another
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads(), (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """The tiny TESTR-architecture spotter exported once per session with the default pipeline (verified).
    Returns (config, manifest, model path); `d2export.pipeline.prepare(config)` rebuilds the same seeded model."""
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("tiny_export")
    cfg = load("textdet_tiny", [f"export.output_dir={out}"])
    manifest = pipeline.export(cfg)
    return cfg, manifest, out / manifest.model_file


@pytest.fixture(scope="session")
def fixed_fused_export(tmp_path_factory):
    """The tiny spotter exported (verified) as a GPU serves it: fixed size (160x224, batch 1), fused MSDA operator.
    Returns (manifest, model path)."""
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("fixed_fused")
    manifest = pipeline.export(load("textdet_tiny", [f"export.output_dir={out}", "export.sampler=fused",
                                                     "export.dynamic=false"]))
    return manifest, out / manifest.model_file


@pytest.fixture(scope="session")
def text_pictures(tmp_path_factory):
    """16 synthetic text pictures (320x320) of a seed of their own (not the fixture's training 0, held-out 1,
    validation 2, demo 3, suite 7): int8 calibration and verification on the reader's domain (verify.pictures)."""
    from d2export.datasets import generate

    return generate("text", tmp_path_factory.mktemp("text_pictures") / "text", count=16, seed=13, size=(320, 320),
                    workers=1)
