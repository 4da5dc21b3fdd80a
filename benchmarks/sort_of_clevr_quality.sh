#!/usr/bin/env bash
# Reproduces the Sort-of-CLEVR figures in the README: the demo (minutes), the quality run (longer) and
# the demo with the MiniLM-initialised text encoder (one override).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-demo}" in
  demo)    /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml env.save_dir=save/bench_demo ;;
  quality) /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/quality.yaml env.save_dir=save/bench_quality ;;
  minilm)  /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml \
             model_config.visual_bert.text_encoder.pretrained_path=minilm env.save_dir=save/bench_minilm ;;
  *) echo "usage: $0 [demo|quality|minilm]" >&2; exit 2 ;;
esac
# held-out numbers: the last "val" event in <save_dir>/metrics.jsonl
