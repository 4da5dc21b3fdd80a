#!/usr/bin/env bash
# The GPU check of issue 9 in one command, under 8 minutes on one GPU (an H200 in mind):
#
#   benchmarks/gpu_check.sh            # from anywhere; PYTHON=/path/to/python to choose the interpreter
#
#  1. pytest -m cuda: every CUDA-only test (Engine fp16/bf16 and scaler skips, prefetcher, CUDA
#     checkpoint round trip, fsdp at world size 1, compile, the no-sync step, ...)
#  2. the Sort-of-CLEVR demo on CUDA in bf16 and in fp16 (DEMO_UPDATES updates each, default the
#     demo's 2000; the dataset is generated once, on the CPU, ~20 s)
#  3. benchmarks/step_speed.py --preset base (BERT-base visual_bert, batch 128, bf16), eager and
#     with --compile (fewer rounds: compiling takes a while the first time)
#
# Every step runs even when an earlier one failed; the exit status is 1 if any failed. Each step
# prints its wall time. Outputs (runs, logs) go to GPU_CHECK_DIR (default: a new temp folder).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${GPU_CHECK_DIR:-$(mktemp -d -t mmvl_gpu_check.XXXXXX)}
DEMO_UPDATES=${DEMO_UPDATES:-2000}
EAGER_ROUNDS=${EAGER_ROUNDS:-3}
COMPILE_ROUNDS=${COMPILE_ROUNDS:-1}
failed=()
start_all=$SECONDS

step() {  # step NAME COMMAND...: run it, time it, remember a failure
  local name=$1; shift
  local t0=$SECONDS
  echo "==== ${name} ($(date +%T))"
  if "$@"; then
    echo "==== ${name}: ok in $((SECONDS - t0)) s"
  else
    echo "==== ${name}: FAILED (exit $?) after $((SECONDS - t0)) s"
    failed+=("${name}")
  fi
}

demo() {  # demo PRECISION
  "$PY" -c 'import sys; from mmvl_cli.run import main; sys.exit(main(sys.argv[1:]))' \
    config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml \
    training.device=cuda "training.precision=$1" "training.max_updates=${DEMO_UPDATES}" \
    training.evaluation_interval=0 training.checkpoint_interval=0 training.progress_bar=false \
    checkpoint.resume=false "env.save_dir=${OUT}/demo_$1" "env.data_dir=${OUT}/data" \
    "scheduler.params.num_warmup_steps=$((DEMO_UPDATES < 1500 ? DEMO_UPDATES / 10 : 150))"
}

"$PY" - <<'EOF' || { echo "no CUDA device visible: this check needs a GPU"; exit 2; }
import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
EOF
echo "outputs: ${OUT}"

step "pytest -m cuda" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step "demo bf16" demo bf16
step "demo fp16" demo fp16
step "step_speed base bf16" "$PY" benchmarks/step_speed.py --preset base --repeats "${EAGER_ROUNDS}"
step "step_speed base bf16 --compile" "$PY" benchmarks/step_speed.py --preset base --compile \
  --repeats "${COMPILE_ROUNDS}"

echo "==== gpu_check: $((SECONDS - start_all)) s in all"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
