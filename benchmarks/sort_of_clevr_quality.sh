#!/usr/bin/env bash
# Reproduces the Sort-of-CLEVR figures in docs/sort_of_clevr.md: the demo (minutes), the quality run (longer),
# the demo under ddp on 2 gloo processes (training.batch_size is the global batch: 32 per process), and the earlier VisualBERT demo with the
# MiniLM-initialised text encoder (one override). The seed and thread-count rows:
# benchmarks/sort_of_clevr_seeds.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rn=projects/relation_network/configs/sort_of_clevr
case "${1:-demo}" in
  demo)    /usr/bin/time -v mmvl_run config=$rn/defaults.yaml env.save_dir=save/bench_demo ;;
  quality) /usr/bin/time -v mmvl_run config=$rn/quality.yaml env.save_dir=save/bench_quality ;;
  ddp)     /usr/bin/time -v mmvl_run config=$rn/defaults.yaml distributed.world_size=2 distributed.strategy=ddp \
             env.save_dir=save/bench_ddp ;;
  minilm)  /usr/bin/time -v mmvl_run config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml \
             model_config.visual_bert.text_encoder.pretrained_path=minilm env.save_dir=save/bench_minilm ;;
  *) echo "usage: $0 [demo|quality|ddp|minilm]" >&2; exit 2 ;;
esac
# held-out numbers: the last "val" event in <save_dir>/metrics.jsonl
