#!/usr/bin/env bash
# What a lent GPU machine ran for issue 45's figures (docs/gpu.md): a bare image with python3.12, torch and CUDA, no
# registry. onnxruntime-gpu (a 256 MB wheel, the CUDA provider 284 MB) arrives in xz pieces over several calls
# (each call carries at most 64 MiB with the repository's ~18), the pure-Python dependencies as copied package
# folders, three compiled ones as cp312 wheels; Deformable-DETR's MSDA sources (the user's compiled kernel) beside them.
#   pack DIR: HERE, not there: build .gpu/ and .gpu1 … .gpu5 (git-ignored through .git/info/exclude) from the
#           registry, this venv and DIR, a Deformable-DETR checkout's models/ops
#   prep:   (carry .gpu .gpu1) stash piece 1, install the small dependencies, start in the background: the upstream
#           kernel's build, the R-50 spotter's dynamic fused export on CUDA (the GPU route; verified on the CPU
#           provider), the benchmark's fixed-size fused graphs (batch 1 and 8, float32 and float16), the trained micro
#           spotter's float32 and float16 exports, the held-out sets
#   stash N: (carry .gpuN, N = 2 … 4, each call within 30 s of the last: the machine stays warm that long)
#   run:    (carry .gpu5 and d2export/kernels/_msda_cuda*.so, the fused operator's library built here with nvcc for
#           sm_80/sm_90) issue 69's figures in one call of under 8 minutes (RUN_BUDGET seconds; each step is given
#           what is left, the log says each one's start): assemble onnxruntime-gpu, then the benchmark (eager fp32 and
#           autocast fp16 on the compiled kernel; the dynamic fused graph in fp32 and fp16 as verified and with
#           d2export's defaults; per batch the fixed-size fused graphs verified, with each CUDA setting alone at batch
#           8, with the defaults, with and without CUDA graphs, each row's parity with the CPU provider; the goals as
#           ratios; the rows in that order, so that a cut run loses the --model graph's first), then
#           benchmarks/msda_kernel_gpu.py (the fused kernel against upstream's; its failure stops nothing).
#           Everything is in $OUT/run.log
#   checks: (carry .gpu5 and the library, after run on the same machine) the trained micro spotter (exported by
#           prep) evaluated through the CUDA provider with d2export's defaults, float32 and float16; then what issue
#           53's run measured: the micro spotter exported with verify.providers=[cuda], the box fixture evaluated
#           through the CUDA provider, the CUDA-only test
#   segmentation: (carry .gpu5 and the library, after run on the same machine) issue 77's rows: Mask2Former R-50
#           and Swin-T panoptic, eager on the GPU against the CUDA provider with post-processing served and in the
#           graph, 640² and 1024², batches 1 and 8 (a seventh call, under 9 minutes)
# Six calls, about 11 minutes of device time in all (the first start about 1).
#   train MINUTES [KEY VALUE ...]: (carry .gpu; one call) train the micro spotter on the GPU from the fixture, e.g.
#           `train 6 --batch 16 SOLVER.BASE_LR 3e-4 SOLVER.LR_BACKBONE 3e-4`; score what comes back here with
#           `d2export evaluate` on the held-out set before it may become the fixture
#           (training/train_spotter.py --fixture)
#   recipe PRETRAIN_MINUTES TRAIN_MINUTES [KEY VALUE ...]: (carry .gpu; one call) issue 52's two steps on the GPU:
#           training/pretrain_glyphs.py teaches the fixture's stem-res3 characters (batch 32), then train_spotter.py
#           goes on from those weights with the text slots on their shares of the box and the glyph classifier kept
#           on the encoder's memory (--glyph-weight 5: no wear of its features on a CPU probe); back under
#           $OUT: both curves, the pretraining's record, the feature probe of its weights, the last float16 spotter
set -uo pipefail
W=/tmp/work
mkdir -p $W /tmp/stash /tmp/site
export PYTHONUNBUFFERED=1 OUT=${OUT:-$W/out}
mkdir -p "$OUT"
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
export LD_LIBRARY_PATH=$(find "$SP/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
refresh_repo() { rm -rf $W/repo && mkdir -p $W/repo && tar --exclude='./.gpu*' -cf - . | tar -xf - -C $W/repo; }
in_repo() { (cd $W/repo && PYTHONPATH=$W/repo:/tmp/ortsite:/tmp/site "$@"); }
train_on_gpu() {  # INIT MINUTES [ARGS ...]: the micro spotter trained on the GPU from INIT; its curve and last
  # float16 weights (7.5 MB) come back under $OUT. The pictures are drawn on the fly by 12 of the 16 cores (an endless
  # stream); torch keeps 4 for the step's host work
  in_repo python3 training/train_spotter.py --device cuda --threads 4 --workers 12 --out $W/spotter \
    --config third_party/testr/configs/micro_spotter.yaml --init "$1" \
    --eval-count 100 --eval-seed 2 --iters 1000000 --minutes "$2" --eval-every 1000 "${@:3}" 2>&1 \
    | grep -v "it/s\]$" | tail -n 30
  cp $W/spotter/metrics.jsonl "$OUT/" && cp "$(ls $W/spotter/model_*_fp16.pth | tail -n 1)" "$OUT/"
}
install_site() {  # the carried dependencies (.gpu/whl, .gpu/site) into /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl \
    && cp -r .gpu/site/. /tmp/site/
}
assemble_ort() {  # onnxruntime-gpu from the five stashed pieces into /tmp/ortsite (once per machine)
  [ -f .gpu5/ort.part5 ] && cp .gpu5/ort.part5 /tmp/stash/
  [ -d /tmp/ortsite/onnxruntime ] && return 0
  mkdir -p /tmp/ortsite
  cat /tmp/stash/ort.part1 /tmp/stash/ort.part2 /tmp/stash/ort.part3 /tmp/stash/ort.part4 /tmp/stash/ort.part5 \
    | python3 -c "import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    | tar -xf - -C /tmp/ortsite
}
wait_for() {  # JOB ...: the background jobs prep started, until each ends or SECONDS passes $DEADLINE
  for job in "$@"; do
    while kill -0 "$(cat $W/$job.pid 2>/dev/null)" 2>/dev/null && [ "$SECONDS" -lt "$DEADLINE" ]; do sleep 2; done
  done
}
step() { echo "## $* (at ${SECONDS} s of ${RUN_BUDGET:-?})"; }

case "${1:-}" in
pack)
  set -e
  [ -d "${2:-}/src" ] || { echo "pack DIR: DIR is Deformable-DETR's models/ops (with src/)" >&2; exit 2; }
  grep -qx '/.gpu\*/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n/.gpu*/\n' >> .git/info/exclude
  rm -rf .gpu .gpu[1-5] /tmp/d2x_ort && mkdir -p .gpu/site .gpu/whl /tmp/d2x_ort
  spec="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  python3 -m pip download $spec -d /tmp/d2x_ort onnxruntime-gpu==1.31.1
  python3 -m pip download $spec -d .gpu/whl pydantic_core==2.50.5 shapely==2.2.0 pycocotools==2.0.11
  (cd /tmp/d2x_ort && unzip -q onnxruntime_gpu-*.whl && rm onnxruntime/capi/libonnxruntime.so.* \
    onnxruntime/capi/libonnxruntime_providers_tensorrt.so && tar cf - onnxruntime onnxruntime_gpu-*.dist-info \
    | xz -T0 -7 > ort.tar.xz)  # the Python module needs neither the C API library nor TensorRT's provider
  for n in 1 2 3 4 5; do mkdir -p .gpu$n; done  # 34 MiB beside .gpu's 11 in the first call, 46 MiB, rest in the last
  dd if=/tmp/d2x_ort/ort.tar.xz of=.gpu1/ort.part1 bs=1M count=34 iflag=fullblock status=none
  for n in 2 3 4; do dd if=/tmp/d2x_ort/ort.tar.xz of=.gpu$n/ort.part$n bs=1M skip=$((34 + 46 * (n - 2))) count=46 \
    iflag=fullblock status=none; done
  dd if=/tmp/d2x_ort/ort.tar.xz of=.gpu5/ort.part5 bs=1M skip=172 iflag=fullblock status=none
  SP=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
  for p in detectron2 hydra omegaconf antlr4 fvcore iopath yacs termcolor typing_inspection annotated_types pydantic \
      onnxslim typing_extensions.py detectron2-0.7.2+purepy.dist-info hydra_core-1.3.8.dist-info \
      omegaconf-2.3.1.dist-info; do
    cp -r "$SP/$p" .gpu/site/; done
  find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
  mkdir -p .gpu/msda_upstream && cp -r "$2/src" .gpu/msda_upstream/
  du -sh .gpu .gpu[1-5]
  ;;
prep)
  cp .gpu1/ort.part1 /tmp/stash/
  install_site && cp -r .gpu/msda_upstream $W/ && refresh_repo || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  in_repo python3 -c "import torch, onnxruntime, detectron2, d2export.pipeline; print('torch', torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0), 'onnxruntime', onnxruntime.__version__)" || exit 1
  cd $W/repo
  bg() { setsid nohup bash -c "cd $W/repo && PYTHONPATH=$W/repo:/tmp/site $2" > $W/$1.log 2>&1 < /dev/null &
         echo $! > $W/$1.pid; }
  # the build where the benchmark's --out $W/bench looks for it: the run only loads it
  bg msda_build "python3 -c \"from pathlib import Path; from benchmarks.gpu import build_upstream; \
build_upstream(Path('$W/msda_upstream'), Path('$W/bench/msda_build'))\""
  bg export_r50 "python3 tools/export.py --config textdet export.device=cuda export.sampler=fused \
export.output_dir=$W/textdet"
  bg fused "python3 tools/benchmark.py gpu --out $W/bench --export-only"
  bg micro "python3 tools/export.py --config textdet_micro export.device=cuda export.output_dir=$W/micro/fp32 \
&& python3 tools/export.py --config textdet_micro export.device=cuda export.fp16=true export.output_dir=$W/micro/fp16"
  bg synth "python3 -m d2export.cli synth text --out $W/held_text --seed 1 --count 200 --size 320x320 --workers 6 \
&& python3 -m d2export.cli synth boxes --out $W/held_boxes --seed 1 --count 300 --size 320x320 --workers 6"
  sleep 20; tail -n 3 $W/*.log
  ;;
stash)
  cp ".gpu$2/ort.part$2" /tmp/stash/ && ls -la /tmp/stash && tail -n 2 $W/*.log
  ;;
run)
  RUN_BUDGET=${RUN_BUDGET:-450}  # seconds: the call stays under 8 minutes
  exec > >(tee -a "$OUT/run.log") 2>&1
  step "onnxruntime-gpu"
  assemble_ort || exit 1
  refresh_repo
  in_repo python3 -c "import torch, onnxruntime as o; print(o.__version__, o.get_available_providers())"
  step "prep's background jobs"
  DEADLINE=$((SECONDS + 60)) wait_for msda_build export_r50 fused micro synth
  tail -n 4 $W/*.log; cp $W/*.log "$OUT/" 2>/dev/null
  R50=$(find $W/textdet -name '*.onnx' | grep -v fp16 | head -1)
  echo "R-50 dynamic fused graph: $R50"
  in_repo python3 -c "from d2export.kernels.custom_ops import cuda_library; print('fused CUDA library:', cuda_library())"
  step "benchmark"  # what is left, less 70 s for the kernel's step
  in_repo timeout -k 10 $((RUN_BUDGET - SECONDS - 70)) python3 tools/benchmark.py gpu --model "$R50" \
    --upstream-msda $W/msda_upstream --out $W/bench --json "$OUT/gpu.json" --rounds 20 --no-plugin --no-placement \
    --batches 8 1 --settings-batches 8 2>&1 | grep -v cudnn_fe | tee "$OUT/bench.log"
  step "fused kernel against upstream's"
  if [ -f benchmarks/msda_kernel_gpu.py ]; then
    # upstream's kernel only where the script loads prep's build (compiling it again takes longer than this step)
    KERNEL_ARGS=(); in_repo python3 benchmarks/msda_kernel_gpu.py --help 2>/dev/null | grep -q -- --build-dir \
      && KERNEL_ARGS=(--upstream-msda $W/msda_upstream --build-dir $W/bench/msda_build) \
      || echo "msda_kernel_gpu.py takes no --build-dir: timed without upstream's kernel"
    in_repo timeout -k 5 60 python3 benchmarks/msda_kernel_gpu.py "${KERNEL_ARGS[@]}" --json "$OUT/msda_kernel.json" \
      2>&1 | tee "$OUT/msda_kernel.log" || echo "msda_kernel_gpu.py failed or ran out of time (above)"
  else
    echo "benchmarks/msda_kernel_gpu.py: not in this tree"
  fi
  step "done"
  ;;
checks)  # (carry .gpu5 and the library, after run on the same machine)
  exec > >(tee -a "$OUT/checks.log") 2>&1
  assemble_ort || exit 1
  refresh_repo
  DEADLINE=$((SECONDS + 60)) wait_for micro synth
  MICRO=$(find $W/micro -maxdepth 2 -name '*.onnx' -not -name '.*' | sort)  # fp16/…, fp32/…
  in_repo python3 -m d2export.cli evaluate --config textdet_micro --dataset $W/held_text $MICRO --providers cuda \
    --json "$OUT/eval_text.json" 2>&1 | tail -n 25 | tee "$OUT/eval_text.log"
  in_repo python3 tools/export.py --config textdet_micro export.device=cuda "verify.providers=[cuda]" \
    export.output_dir=$W/micro_cuda 2>&1 | tail -n 15 | tee "$OUT/export_micro.log"
  in_repo python3 -m d2export.cli evaluate --config boxdet --dataset $W/held_boxes --precision fp32,fp16 \
    --providers cuda --json "$OUT/eval_boxes.json" 2>&1 | tail -n 25 | tee "$OUT/eval_boxes.log"
  in_repo python3 -m pytest -q -x tests/test_device.py 2>&1 | tail -n 5
  ;;
segmentation)  # (carry .gpu5 and the library, after run on the same machine) issue 77's GPU rows: Mask2Former
  # R-50 and Swin-T COCO panoptic (the stand-in's full-size configs, seeded weights), exported and verified on the
  # CPU provider, then eager PyTorch on the GPU against the CUDA provider's graph + served post-processing and the
  # graph with post-processing inside, 640² and 1024², batches 1 and 8; $OUT/segmentation.log and .json
  RUN_BUDGET=${RUN_BUDGET:-540}
  exec > >(tee -a "$OUT/segmentation.log") 2>&1
  assemble_ort || exit 1
  refresh_repo
  in_repo timeout -k 10 $((RUN_BUDGET - SECONDS)) python3 tools/benchmark.py segmentation --device cuda \
    --tasks panoptic panoptic-swin --samplers fused --postprocess-graph --size 640 1024 --batches 1 8 --rounds 10 \
    --threads 8 --out $W/segmentation
  cp $W/segmentation/report.json "$OUT/segmentation.json" 2>/dev/null || echo "no report: the run was cut (above)"
  ;;
train)  # (carry .gpu) MINUTES [KEY VALUE ...]: issue 42's unblock — the micro spotter warm-started from the fixture,
        # trained on the GPU; its last float16 weights and its curve come back under $OUT (7.5 MB)
  install_site && refresh_repo || exit 1
  train_on_gpu tests/data/spotter_fixture.pth "${2:-6}" "${@:3}"
  ;;
recipe)  # (carry .gpu) PRETRAIN_MINUTES TRAIN_MINUTES [KEY VALUE ...]
  install_site && refresh_repo || exit 1
  in_repo python3 training/pretrain_glyphs.py --device cuda --threads 4 --workers 12 --batch 32 \
    --init tests/data/spotter_fixture.pth --out $W/glyphs --minutes "${2:-4}" --eval-every 500 2>&1 | tail -n 20
  cp $W/glyphs/metrics.jsonl "$OUT/glyphs_metrics.jsonl"; cp $W/glyphs/model.json "$OUT/glyphs_model.json"
  in_repo python3 training/probe_features.py --weights $W/glyphs/model.pth --where memory --threads 8 2>&1 | tail -n 3 \
    | tee "$OUT/glyphs_probe.log"
  train_on_gpu $W/glyphs/model.pth "${3:-5}" --batch 16 --glyph-weight 5 SOLVER.BASE_LR 3e-4 SOLVER.LR_BACKBONE 3e-4 \
    MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES True "${@:4}"
  ;;
*) echo "usage: $0 pack DIR | prep | stash N | run | checks | segmentation | train MINUTES [KEY VALUE ...]" \
     "| recipe MIN MIN [KEY VALUE ...]" >&2
   exit 2 ;;
esac
