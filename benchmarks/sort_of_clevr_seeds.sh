#!/usr/bin/env bash
# The robustness rows of docs/sort_of_clevr.md's tables: one project config over seeds and
# thread counts, each run timed on its own, then one table row per thread count (mean and range
# over the seeds) and one over every run.
#   benchmarks/sort_of_clevr_seeds.sh CONFIG OUT_DIR [SEEDS] [THREADS] [mmvl_run overrides ...]
#   e.g. benchmarks/sort_of_clevr_seeds.sh projects/relation_network/configs/sort_of_clevr/defaults.yaml save/seeds "1 2 3" "1 2"
# Each run alone: OMP_NUM_THREADS=T mmvl_run config=CONFIG training.seed=S env.save_dir=OUT_DIR/sS_tT
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=$1 out=$2 seeds=${3:-1 2 3} threads=${4:-1 2}
shift $(( $# < 4 ? $# : 4 ))
data=${MMVL_DATA_DIR:-$out/data}
py=${PYTHON:-python}
mkdir -p "$out"
echo "# $(nproc) cores; load at start: $(cut -d' ' -f1-3 /proc/loadavg); config $cfg; overrides: $*"
for t in $threads; do
  for s in $seeds; do
    dir="$out/s${s}_t${t}"
    t0=$(date +%s.%N)
    OMP_NUM_THREADS=$t mmvl_run config="$cfg" training.seed="$s" env.save_dir="$dir" env.data_dir="$data" \
      checkpoint.resume=false training.progress_bar=false "$@" > "$out/s${s}_t${t}.log" 2>&1
    echo "$(date +%s.%N) - $t0" | bc > "$dir/wall_s.txt"
    echo "# seed $s, OMP_NUM_THREADS=$t: $(cut -d. -f1 "$dir/wall_s.txt") s; load now: $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
$py benchmarks/sort_of_clevr_table.py --header
all=()
for t in $threads; do
  dirs=()
  for s in $seeds; do dirs+=("$out/s${s}_t${t}"); done
  all+=("${dirs[@]}")
  $py benchmarks/sort_of_clevr_table.py --label "$cfg, seeds ${seeds// /,}, OMP_NUM_THREADS=$t" "${dirs[@]}"
done
$py benchmarks/sort_of_clevr_table.py --label "$cfg, every run" "${all[@]}"
