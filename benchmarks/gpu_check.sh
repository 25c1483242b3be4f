#!/usr/bin/env bash
# The GPU check (docs/gpu.md), for the machine a GPU check runs on: one NVIDIA H200, Python 3.12 with torch 2.11,
# transformers 5.17, peft, safetensors, rich, typer, httpx and pyarrow installed, NO network, at most 64 MiB carried
# with the work tree. Under 8 minutes it:
#   1. installs nothing from an index: rollwise runs from this tree (PYTHONPATH), and the pure-Python packages the
#      machine lacks travel as wheels in .whl/ (make them here with `bash benchmarks/gpu_check.sh --wheels`);
#   2. runs the CUDA tests (tests/test_cuda.py, and the device-discipline and engine tests on the GPU);
#   3. runs benchmarks/gpu_check.py: 5 GRPO steps of the default recipe's shape on CUDA in fp32 and bf16 (random
#      models of SmolLM2-135M's and Qwen2.5-0.5B's shapes), with the engine-vs-trainer log-prob gap per step,
#      rollout and train tok/s, MFU against the GPU's measured bf16 / fp32 peak, peak GPU memory and a checkpoint
#      that must load in transformers; then FSDP2 on one rank over NCCL against the local trainer.
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
  "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device_discipline.py tests/test_engine.py
  echo "gpu_check: tests done at $(( $(date +%s) - start )) s"
  "$PY" benchmarks/gpu_check.py --out "$OUT"
else
  "$PY" benchmarks/gpu_check.py --out "$OUT" --dry
fi
echo "gpu_check: done in $(( $(date +%s) - start )) s"
