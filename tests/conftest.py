import os
import shutil
import sys
from pathlib import Path

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
_SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
torch.set_num_threads(max(1, min(2, torch.get_num_threads(), _SHARE)))

if _WORKERS > 1:
    # the processes tests start (training scripts, CLI exports) get the worker's share too: torch's default threads
    # follow OMP_NUM_THREADS; a thread per core in each would wait on the other workers' cores
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    import onnxruntime as _ort

    _Options = _ort.SessionOptions

    class _SharedCoresOptions(_Options):
        """onnxruntime's "all cores" (intra_op_num_threads 0, the default and the Predictor's) as this worker's share of
        them: a pool thread per core in every worker would spin-wait on cores the other workers compute on. A count
        asked for explicitly is kept."""

        def __init__(self):
            super().__init__()
            self.intra_op_num_threads = 0

        @property
        def intra_op_num_threads(self):
            return _Options.intra_op_num_threads.__get__(self)

        @intra_op_num_threads.setter
        def intra_op_num_threads(self, count):
            _Options.intra_op_num_threads.__set__(self, int(count) or _SHARE)

    _ort.SessionOptions = _SharedCoresOptions


def _made_once(tmp_path_factory, name: str, make) -> Path:
    """`make(folder)` run once for the whole run, not once per pytest-xdist worker: the first worker to ask makes it
    under a lock in the run's shared temporary folder, the others wait and take what it wrote (the session fixtures'
    exports and pictures were a minute of the suite's time, made again in each worker). Returns the folder."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # a worker's basetemp is <the run's>/gw<N>
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed making it left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def _exported_once(tmp_path_factory, name: str, config: str, *overrides: str):
    """The config exported (verified) once for the run; (config, manifest as written, model path)."""
    from d2export import pipeline
    from d2export.config import load
    from d2export.manifest import Manifest

    def make(out):
        pipeline.export(load(config, [f"export.output_dir={out}", *overrides]))

    out = _made_once(tmp_path_factory, name, make)
    cfg = load(config, [f"export.output_dir={out}", *overrides])
    [written] = out.glob("*.manifest.json")
    manifest = Manifest.read(written)
    return cfg, manifest, out / manifest.model_file


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """The tiny TESTR-architecture spotter exported once per run with the default pipeline (verified).
    Returns (config, manifest, model path); `d2export.pipeline.prepare(config)` rebuilds the same seeded model."""
    return _exported_once(tmp_path_factory, "tiny_export", "textdet_tiny")


@pytest.fixture(scope="session")
def fixed_fused_export(tmp_path_factory):
    """The tiny spotter exported (verified) as a GPU serves it: fixed size (160x224, batch 1), fused MSDA operator.
    Returns (manifest, model path)."""
    _, manifest, path = _exported_once(tmp_path_factory, "fixed_fused", "textdet_tiny", "export.sampler=fused",
                                       "export.dynamic=false")
    return manifest, path


@pytest.fixture(scope="session")
def text_pictures(tmp_path_factory):
    """16 synthetic text pictures (320x320) of a seed of their own (not the fixture's training 0, held-out 1,
    validation 2, demo 3, suite 7): int8 calibration and verification on the reader's domain (verify.pictures)."""
    from d2export.datasets import generate

    def make(out):
        generate("text", out / "text", count=16, seed=13, size=(320, 320), workers=1)

    return _made_once(tmp_path_factory, "text_pictures", make) / "text"


@pytest.fixture(scope="session")
def labelled_text(tmp_path_factory):
    """12 labelled text pictures of a seed of their own (not the fixture's training 0, held-out 1, validation 2,
    demo 3, suite 7, calibration 13): what verify.int8_accuracy and verify.bf16_accuracy judge in the suite."""
    from d2export.datasets import generate

    def make(out):
        generate("text", out / "held", count=12, seed=19, size=(320, 320), workers=1)

    return _made_once(tmp_path_factory, "labelled_text", make) / "held"


# The files whose tests take longest (a full run's durations on 2 cores, 2026-12-03), collected first: pytest-xdist
# hands each worker a file at a time in collection order, so the long ones start at once and the short ones fill in
# at the end, instead of one long file running alone while the other workers wait.
LONGEST_FIRST = ("test_pinning.py", "test_export_pipeline.py", "test_dynamo_detectron2.py", "test_swin_backbone.py",
                 "test_mask2former.py", "test_dynamo_mask2former.py", "test_dynamo_exporter.py", "test_rewrites.py",
                 "test_int8.py", "test_testr_training.py", "test_detectron2_exports.py", "test_box_fixture.py",
                 "test_spotter_fixture.py", "test_ladder.py", "test_spotter_recipe.py", "test_evaluate.py",
                 "test_fused_msda.py", "test_dynamo_families.py", "test_runtime_install.py", "test_detr_boxes.py",
                 "test_export_faults.py", "test_zoo_families.py", "test_spotters.py")


# The per-family torch.export matrix (every family and detectron2 meta-architecture through export.exporter=dynamo,
# verified): a quarter of the suite's time, run as its own step (`make test-matrix`; `make test-all` and CI run both).
MATRIX_FILES = "test_dynamo_*.py"
# The tests that run OpenVINO in their own process: `make test` runs them after the rest, in one pytest process
# without xdist workers. Three times (two sessions and a CI run, AVX-512 and AMX) an xdist worker that had served
# OpenVINO graphs ended later in the run without a traceback, and the controller then waited for it forever.
OPENVINO_FILES = ("test_bf16.py", "test_int8_openvino.py")  # test_msda_openvino.py runs OpenVINO in child processes


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_export_matrix: the per-family torch.export matrix (make test-matrix)")
    config.addinivalue_line("markers", "openvino: runs OpenVINO in the test's process (make test runs them apart)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.match(MATRIX_FILES):
            item.add_marker(pytest.mark.torch_export_matrix)
        if item.path.name in OPENVINO_FILES:
            item.add_marker(pytest.mark.openvino)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
