#!/usr/bin/env bash
# The GPU check (docs/gpu.md), for the machine a GPU check runs on: one NVIDIA H100 or H200, Python 3.12 with torch
# 2.11, transformers 5.17, triton, peft, accelerate, safetensors, rich, typer, httpx and pyarrow installed, NO
# network, no vLLM, at most 64 MiB carried with the work tree. In about 6 minutes (8 at most) it:
#   1. installs nothing from an index: rollwise runs from this tree (PYTHONPATH), and the pure-Python packages the
#      machine lacks (pydantic; trl and datasets with their dependencies, for TRL's GRPOTrainer) travel as wheels in
#      .whl/ (make them here with `bash benchmarks/gpu_check.sh --wheels`, about 17 MiB);
#   2. runs the CUDA tests (tests/test_cuda.py, and the device-discipline and engine tests on the GPU), 90 s at most;
#   3. runs benchmarks/gpu_check.py, each part in its own process with a time budget (skipped with a line past it):
#      the GPU recipe's shape (Qwen2.5-0.5B-shaped, 32 prompts x 8 samples, 512 new tokens, bf16, 3 steps) with
#      rollout and train tok/s, MFU against the datasheet and measured peaks, peak memory against the estimate and
#      HF generate as the rollout's reference; TRL's GRPOTrainer at the same shape; the default recipe at
#      SmolLM2-135M's shape in fp32 and bf16 (engine-vs-trainer gap, a checkpoint that loads in transformers); one
#      step at Qwen2.5-1.5B's shape for memory; FSDP2 on one rank over NCCL against the local trainer.
# Results: $OUT/check.log and $OUT/summary.json.
#   bash benchmarks/gpu_check.sh            on the GPU machine (device tool: carry .whl)
#   bash benchmarks/gpu_check.sh --dry      the same steps on this machine's CPU, tiny shapes (CI runs this)
#   bash benchmarks/gpu_check.sh --wheels   download the wheels the GPU machine lacks into .whl/ (needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
case "${1:-}" in --dry) MODE=dry ;; --wheels) MODE=wheels ;; "") ;; *) echo "usage: $0 [--dry|--wheels]"; exit 2 ;; esac
# what rollwise imports that the GPU image lacks (pure Python, or one manylinux wheel each)
WHEELS="pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2"
# TRL's GRPOTrainer (the `trl` part): trl and what it imports that the image lacks; pandas is the big one (12 MiB)
WHEELS="$WHEELS trl==1.16.0 datasets==5.2.0 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 dill==0.4.1
  multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 jmespath==1.1.0"
if [ "$MODE" = wheels ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  du -sh .whl
  exit 0
fi
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
PY=${PYTHON:-python3}
if [ "$MODE" = dry ] && [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ "$MODE" = gpu ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ROLLWISE_CACHE="$OUT/cache"
start=$(date +%s)
"$PY" -c "import torch, transformers, rollwise; print('gpu_check: torch', torch.__version__, '| transformers',
transformers.__version__, '| cuda', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
if [ "$MODE" = gpu ]; then
  nvidia-smi -L || true
  timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device_discipline.py \
    tests/test_engine.py || echo "gpu_check: the CUDA tests failed or ran past 90 s (above); the benchmarks run anyway"
  echo "gpu_check: tests done at $(( $(date +%s) - start )) s"
  "$PY" benchmarks/gpu_check.py --out "$OUT"
else
  "$PY" benchmarks/gpu_check.py --out "$OUT" --dry
fi
echo "gpu_check: done in $(( $(date +%s) - start )) s"
