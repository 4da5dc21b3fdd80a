#!/usr/bin/env bash
# Reproduces the Sort-of-CLEVR figures in the README: the demo (minutes) and the quality run (hours).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-demo}" in
  demo)    /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml env.save_dir=save/bench_demo ;;
  quality) /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/quality.yaml env.save_dir=save/bench_quality ;;
  *) echo "usage: $0 [demo|quality]" >&2; exit 2 ;;
esac
# held-out numbers: the last "val" event in <save_dir>/metrics.jsonl
