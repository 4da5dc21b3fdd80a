#!/usr/bin/env bash
# The GPU check in one command, within 8 minutes on one GPU (an H200 in mind) by construction:
#
#   benchmarks/gpu_check.sh            # from anywhere; PYTHON=/path/to/python chooses the interpreter
#   benchmarks/gpu_check.sh --dry      # (or GPU_CHECK_DRY=1) the same steps on the CPU, tiny: what CI runs
#
# No install step: the source tree goes on PYTHONPATH, so any Python with torch runs it once
# omegaconf is importable (offline machines: docs/speed.md's wheelhouse step). lmdb, fairscale,
# accelerate and lightning are optional: their tests skip, their step_speed variants are noted.
#
# Steps, the most important first, each under its own budget in seconds (enforced with `timeout`;
# a step that runs out is killed and marked TIMED OUT, the next one starts). The budgets add up to
# 480 s, GPU_CHECK_BUDGET's default (8 minutes); a step is skipped when less than 10 s of the
# overall budget is left.
#  1. preflight (20): torch, CUDA (not in dry mode), omegaconf, the optional packages, and that
#     `benchmarks` is this tree's (fairscale's wheel installs a top-level `benchmarks` too)
#  2. step_speed base --compile, plain + trainer (150): the issue's measured aim, the Trainer with
#     torch.compile on BERT-base (batch 128, bf16); prints the recompiles while timed and MFU
#  3. pytest -m cuda (80): every CUDA-only test
#  4. vlm_speed (40): the VLM's training step against a plain transformers loop, full and LoRA
#     (LoRA left out, with a note, where peft is missing)
#  5. hf_vlm_speed (30): a released VLM's (hf_vlm, a random LLaVA) training step against a plain
#     transformers (+ peft) loop, full and LoRA
#  6. contrastive_speed (40): clip's training step against open_clip's (mmvl alone, with a note,
#     where open_clip is missing)
#  7. step_speed base eager, every variant (50)
#  8. the Sort-of-CLEVR demo on CUDA in bf16 (35) and fp16 (35), DEMO_UPDATES updates (default 300)
#     on 2,000 generated images, then its evaluation on 100
# Dry mode: CPU, step_speed --preset tiny, vlm_speed, hf_vlm_speed and contrastive_speed at smoke sizes, the demo for 3 updates (DEMO_UPDATES) on 64 images;
# pytest -m cuda collects every module and skips the tests.
#
# Every step runs even when an earlier one failed; the exit status is 1 if any failed or timed
# out. Outputs go to GPU_CHECK_DIR (default: a new temp folder): summary.txt (a few lines per
# step: status, time, budget and its last result lines), logs/<step>.log (full output) and work/ (the
# demos' data and runs; GPU_CHECK_WORK moves it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
PY=${PYTHON:-python}
DRY=${GPU_CHECK_DRY:-0}
for arg in "$@"; do
  case $arg in
    --dry) DRY=1 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '${arg}'; the only option is --dry (or GPU_CHECK_DRY=1)" >&2; exit 2 ;;
  esac
done
BUDGET=${GPU_CHECK_BUDGET:-480}
if ! [[ $BUDGET =~ ^[0-9]+$ ]]; then
  echo "gpu_check: GPU_CHECK_BUDGET='${BUDGET}' must be whole seconds, e.g. GPU_CHECK_BUDGET=480" >&2; exit 2
fi
DEMO_UPDATES=${DEMO_UPDATES:-$( ((DRY)) && echo 3 || echo 300)}
if ! [[ $DEMO_UPDATES =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_check: DEMO_UPDATES='${DEMO_UPDATES}' must be a positive whole number, e.g. DEMO_UPDATES=300" >&2; exit 2
fi
DIR=${GPU_CHECK_DIR:-$(mktemp -d -t mmvl_gpu_check.XXXXXX)}
WORK=${GPU_CHECK_WORK:-${DIR}/work}
mkdir -p "${DIR}/logs" "${WORK}" || { echo "gpu_check: cannot create GPU_CHECK_DIR=${DIR}" >&2; exit 2; }
SUMMARY=${DIR}/summary.txt
: > "${SUMMARY}"
failed=()
start_all=$SECONDS

note() {  # note LINE: to the summary and the terminal
  echo "$1" | tee -a "${SUMMARY}"
}

step() {  # step NAME BUDGET_S PATTERN COMMAND...: run under min(budget, what is left); summary + result lines
  local name=$1 budget=$2 pattern=$3; shift 3
  local left=$((BUDGET - (SECONDS - start_all))) log="${DIR}/logs/${name// /_}.log" t0=$SECONDS rc
  ((budget > left)) && budget=$left
  if ((budget < 10)); then
    note "STEP ${name}: SKIPPED (${left} s of the ${BUDGET} s budget left)"; failed+=("${name}"); return
  fi
  echo "==== ${name} ($(date +%T), budget ${budget} s)"
  timeout -k 5 $((budget - 5)) "$@" 2>&1 | tee "${log}"
  rc=${PIPESTATUS[0]}
  local status="ok"
  if ((rc == 124 || rc == 137)); then status="TIMED OUT"; elif ((rc != 0)); then status="FAILED (exit ${rc})"; fi
  note "STEP ${name}: ${status} in $((SECONDS - t0)) s (budget ${budget} s)"
  [[ $status == ok ]] || failed+=("${name}")
  grep -E -- "${pattern}" "${log}" | tail -n 8 | cut -c1-240 | sed 's/^/  /' >> "${SUMMARY}"
}

demo_args() {  # demo_args PRECISION: the mmvl_run arguments of one demo run
  local precision=$1
  echo "config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml" \
    "training.precision=${precision} training.max_updates=${DEMO_UPDATES}" \
    "training.evaluation_interval=0 training.checkpoint_interval=0 training.progress_bar=false" \
    "checkpoint.resume=false env.save_dir=${WORK}/demo_${precision} env.data_dir=${WORK}/data" \
    "scheduler.params.num_warmup_steps=$((DEMO_UPDATES < 1500 ? DEMO_UPDATES / 10 : 150))"
  if ((DRY)); then
    echo "training.device=cpu training.log_interval=1 dataset_config.sort_of_clevr.num_images=64" \
      "dataset_config.sort_of_clevr.num_val_images=16 dataset_config.sort_of_clevr.num_test_images=16"
  else  # a fifth of the images: generating them is CPU time the precision check does not need
    echo "training.device=cuda dataset_config.sort_of_clevr.num_images=2000" \
      "dataset_config.sort_of_clevr.num_val_images=100 dataset_config.sort_of_clevr.num_test_images=100"
  fi
}

RUN='import sys; from mmvl_cli.run import main; sys.exit(main(sys.argv[1:]))'
SPEED_LINES='^(preset |MFU = |recompiles while timed|note: |(plain|engine|trainer|accelerate|lightning): )'
DEMO_LINES='update [0-9]+/[0-9]+ \||@ update'
if ((DRY)); then
  MODE="dry (CPU, tiny sizes)"; PRESET=(--preset tiny --threads 1)
  VLM=(--steps 1 --rounds 1 --batch 2 --width 32 --layers 1 --heads 2 --threads 1)
  HF_VLM=(--steps 1 --rounds 1 --batch 2 --width 32 --layers 1 --heads 2 --threads 1)
  CLIP=(--steps 1 --rounds 1 --batch 4 --image 32 --layers 1 --width 32 --heads 2 --threads 1)
else
  MODE="real (CUDA)"; PRESET=(--preset base)
  VLM=(--batch 32 --width 512 --layers 8 --heads 8)
  HF_VLM=(--batch 16 --width 512 --layers 8 --heads 8 --vision-width 256)
  CLIP=(--batch 256 --image 128)
fi
VLM_LINES='^((full|lora) (mmvl|plain): |ratio |note: )'
CLIP_LINES='^((mmvl|open_clip): |time ratio |note: )'
note "gpu_check ${MODE}: budget ${BUDGET} s, outputs in ${DIR}"

step "preflight" 20 '^(torch|optional|benchmarks)' env GPU_CHECK_DRY="${DRY}" "$PY" - <<'EOF'
import importlib.util, os, sys
try:
    import torch
except ImportError:
    print("gpu_check: torch is not importable by this Python; run with PYTHON=/path/to/python"); sys.exit(2)
dry = os.environ["GPU_CHECK_DRY"] == "1"
if not dry and not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible; this check needs a GPU "
          "(benchmarks/gpu_check.sh --dry runs it on the CPU)")
    sys.exit(2)
if importlib.util.find_spec("omegaconf") is None:
    print("gpu_check: omegaconf is not installed (mmvl needs it); offline, install it from a wheelhouse: "
          "pip install --no-index --find-links WHEELHOUSE omegaconf antlr4-python3-runtime (see docs/speed.md)")
    sys.exit(2)
device = "cpu (dry mode)" if dry else torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} on {device}, Python {sys.version.split()[0]}")
missing = [m for m in ("lmdb", "fairscale", "accelerate", "lightning", "peft", "open_clip", "timm")
           if importlib.util.find_spec(m) is None]
print(f"optional packages missing: {', '.join(missing) or 'none'} (their tests skip, their variants are noted)")
import benchmarks
where = os.path.dirname(os.path.abspath(benchmarks.__file__))
if where != os.path.join(os.getcwd(), "benchmarks"):
    print(f"benchmarks resolves to {where}, not this tree's; put the tree first on PYTHONPATH"); sys.exit(1)
print("benchmarks: this tree's")
EOF
if grep -q "^gpu_check: " "${DIR}/logs/preflight.log"; then  # a missing requirement: nothing else can run
  grep "^gpu_check: " "${DIR}/logs/preflight.log" | tee -a "${SUMMARY}" >&2
  exit 2
fi

step "step_speed compiled" 150 "${SPEED_LINES}" "$PY" benchmarks/step_speed.py "${PRESET[@]}" --compile \
  --variants plain,trainer --repeats "${COMPILE_ROUNDS:-1}"
step "pytest -m cuda" 80 '(passed|failed|skipped|error|no tests ran)' \
  "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step "vlm_speed" 40 "${VLM_LINES}" "$PY" benchmarks/vlm_speed.py "${VLM[@]}"
step "hf_vlm_speed" 30 "${VLM_LINES}" "$PY" benchmarks/hf_vlm_speed.py "${HF_VLM[@]}"
step "contrastive_speed" 40 "${CLIP_LINES}" "$PY" benchmarks/contrastive_speed.py "${CLIP[@]}" --loss-batch 0
step "step_speed eager" 50 "${SPEED_LINES}" "$PY" benchmarks/step_speed.py "${PRESET[@]}" \
  --repeats "${EAGER_ROUNDS:-1}"
# shellcheck disable=SC2046  # demo_args prints space-free key=value words
step "demo bf16" 35 "${DEMO_LINES}" "$PY" -c "${RUN}" $(demo_args bf16)
# shellcheck disable=SC2046
step "demo fp16" 35 "${DEMO_LINES}" "$PY" -c "${RUN}" $(demo_args fp16)

if ((${#failed[@]})); then
  note "gpu_check: $((SECONDS - start_all)) s in all (budget ${BUDGET} s); FAILED: ${failed[*]}"
  exit 1
fi
note "gpu_check: $((SECONDS - start_all)) s in all (budget ${BUDGET} s); all steps passed"
