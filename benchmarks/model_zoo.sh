#!/usr/bin/env bash
# The Sort-of-CLEVR model zoo (docs/sort_of_clevr.md): trains every model's project config on this machine, one
# after the other, and prints the table rows (held-out = the 500 validation images x 20 questions,
# final model). Data is generated once, timed on its own.
#   benchmarks/model_zoo.sh [OUT_DIR] [ROW ...]   (default: save/zoo, every row below)
# Rows: relation_network (the README's demo, over object regions from an oracle detector),
# relation_network_quality (the demo model, 3x longer), visual_bert (pixels), visual_bert_regions,
# mmbt, concat_bert, quality (visual_bert on pixels, 3x longer), regions_quality (visual_bert
# over object regions, 3x longer).
# Each row is reproduced alone by the mmvl_run line printed before it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-save/zoo}
shift || true
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(relation_network relation_network_quality visual_bert visual_bert_regions mmbt concat_bert quality regions_quality)
data=${MMVL_DATA_DIR:-$out/data}
mkdir -p "$out"
py=${PYTHON:-python}

echo "# machine: $(nproc) cores; OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}; load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s.%N)
$py - "$data" <<'PY'
import sys
from mmvl.config import load_config
from mmvl.build import build_datasets
load_config  # noqa: B018
config = load_config(["model=visual_bert", "datasets=sort_of_clevr", f"env.data_dir={sys.argv[1]}"])
build_datasets(config)["sort_of_clevr"].prepare()
PY
echo "# data: $(echo "$(date +%s.%N) - $start" | bc | cut -d. -f1) s to generate (or find) Sort-of-CLEVR in $data"

config_of() {
  case "$1" in
    quality) echo "projects/visual_bert/configs/sort_of_clevr/quality.yaml" ;;
    visual_bert_regions) echo "projects/visual_bert/configs/sort_of_clevr/regions.yaml" ;;
    regions_quality) echo "projects/visual_bert/configs/sort_of_clevr/regions_quality.yaml" ;;
    relation_network_quality) echo "projects/relation_network/configs/sort_of_clevr/quality.yaml" ;;
    *) echo "projects/$1/configs/sort_of_clevr/defaults.yaml" ;;
  esac
}

for m in "${models[@]}"; do
  cfg=$(config_of "$m")
  dir="$out/$m"
  echo "# $m: mmvl_run config=$cfg env.save_dir=$dir env.data_dir=$data"
  t0=$(date +%s.%N)
  mmvl_run config="$cfg" env.save_dir="$dir" env.data_dir="$data" checkpoint.resume=false \
    training.progress_bar=false > "$out/$m.log" 2>&1
  echo "$(date +%s.%N) - $t0" | bc > "$dir/wall_s.txt"
  echo "#   done in $(cut -d. -f1 "$dir/wall_s.txt") s; load now: $(cut -d' ' -f1-3 /proc/loadavg)"
done

$py benchmarks/sort_of_clevr_table.py --header
for m in "${models[@]}"; do
  $py benchmarks/sort_of_clevr_table.py --label "$m ($(config_of "$m"))" "$out/$m"
done
