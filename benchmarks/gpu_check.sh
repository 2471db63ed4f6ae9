#!/usr/bin/env bash
# The prepared GPU check: one script, run once on a machine with an NVIDIA GPU.
#
#   1. mtcore doctor for the cuda backend (plugins, capabilities, kernel table);
#   2. the conformance kit on cuda: device, NCCL-free collective checks, every kernel
#      candidate (the Triton pack compiled for real) against the reference, FP8;
#   3. benchmarks/bench_gemm_shapes.py: the bf16 products of Megatron-Core's H100 rows,
#      the per-shape efficiency `mtcore plan` lacks for them (issue 21; an H200 has
#      H100's compute), into $OUT/gemm_shapes.json, and as a hardware file's GEMM-shape
#      table into $OUT/gemm_efficiency.toml (paste it into h100-sxm.toml, docs/plan.md);
#   4. benchmarks/bench_kernels.py: each Triton kernel against torch eager (bf16, fp32);
#   5. benchmarks/bench_fp8.py: a GPT step in bf16 against each FP8 recipe.
#
# Each step has its own time limit and its own log under $OUT; a failing step does
# not stop the next. The exit status is the number of failed steps.
#
# The machine needs python3 with torch (CUDA build) and triton. It may lack pydantic:
# fetch its wheels beforehand on a machine with network access, into .whl/ (ignored):
#   python3 -m pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl pydantic
# Usage:  OUT=gpu-results bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/mtcore-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

failed=0
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee "$OUT/$name.txt"
    if timeout "$limit" "$@" >>"$OUT/$name.txt" 2>&1; then
        echo "== $name: ok" | tee -a "$OUT/$name.txt"
    else
        echo "== $name: FAILED (exit $?)" | tee -a "$OUT/$name.txt"
        failed=$((failed + 1))
    fi
    tail -n 25 "$OUT/$name.txt" | grep -v '^== '
}

if [ -d .whl ]; then
    step wheels 60 $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
fi
# Installed (not editable) into a side folder: its dist-info carries the entry points
# through which mtcore finds the plugin and pytest finds the conformance kit.
step install 120 $PY -m pip install -q --no-deps --no-build-isolation --no-compile \
    --target "$SITE" . ./plugins/mtcore_cuda ./plugins/mtcore_triton
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/gpu.txt" 2>&1
step doctor 45 $PY -m mtcore.cli.main doctor --backend cuda
step gemm_shapes 45 $PY benchmarks/bench_gemm_shapes.py --json "$OUT/gemm_shapes.json" \
    --toml "$OUT/gemm_efficiency.toml"
step conformance 150 $PY -m pytest -q -p no:cacheprovider --pyargs mtcore.testing.conformance \
    --mtcore-backend cuda
step kernels 90 $PY benchmarks/bench_kernels.py --dtype bfloat16
step kernels_fp32 45 $PY benchmarks/bench_kernels.py --dtype float32
step fp8 90 $PY benchmarks/bench_fp8.py --steps 20
echo "gpu_check: $failed step(s) failed; logs in $OUT"
exit "$failed"
