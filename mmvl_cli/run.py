"""usage: mmvl_run [config=FILE.yaml ...] [key=value ...] [--debug]
       mmvl_run --list [KIND] [env.user_dir=DIR]

Train and/or evaluate a model from YAML configs (``python -m mmvl_cli.run`` is the same,
so ``torchrun ... -m mmvl_cli.run`` works).

Arguments are key=value pairs, applied in this order (later wins):
  configs/defaults.yaml -> the model's YAML -> each dataset's YAML -> config= files
  (their `includes:` first) -> the key=value pairs on the command line.
  config=FILE        a YAML file with any of the keys below (repeatable)
  model=NAME         a registered model (visual_bert, mmbt, concat_bert, ...)
  datasets=A[,B]     one or more registered datasets (dataset= also works)
  run_type=TYPE      stages joined by _: train_val (default), train, val, test, train_val_test, ...
  a.b.c=VALUE        any key of configs/defaults.yaml or of the chosen model/dataset YAMLs,
                     dotted; VALUE is read as YAML: 3, 1e-3, true, null, [a,b], {k: v}.
                     Misspelt keys are rejected with a suggestion.
  env.user_dir=DIR   import your own package first (models, datasets, metrics you registered)
  distributed.world_size=N   without a launcher (torchrun, SLURM), N > 1 starts N local
                     processes itself, as torchrun --standalone --nproc-per-node=N would

Options:
  --list [KIND]      print every registered name, or those of one KIND (model, dataset,
                     processor, loss, metric, optimizer, scheduler, ...), and exit; with
                     env.user_dir=DIR (or config=FILE naming one) your registrations too
  --debug            show the full traceback of an error (also MMVL_DEBUG=1); without it
                     a mistake prints one line naming the value and the fix, exit code 2
  -h, --help         this text

Outputs go to env.save_dir: config.yaml, train.log, metrics.jsonl, checkpoints/, curves.png
(compare runs with mmvl_plot), and the training.trackers' files: tensorboard/, wandb/, mlruns/.
Under `python -m torch.distributed.launch` the --local-rank=N it adds is taken as the local rank.

Examples:
  # the demo: a Relation Network on generated Sort-of-CLEVR, a few minutes on 2 CPU cores
  mmvl_run config=projects/relation_network/configs/sort_of_clevr/defaults.yaml
  # the same with a smaller lr and batch, into another folder
  mmvl_run config=projects/relation_network/configs/sort_of_clevr/defaults.yaml \\
      optimizer.params.lr=5e-4 training.batch_size=16 env.save_dir=save/lr5e-4
  # evaluate a checkpoint on the validation split
  mmvl_run config=projects/relation_network/configs/sort_of_clevr/defaults.yaml run_type=val \\
      checkpoint.resume_file=save/relation_network_sort_of_clevr/checkpoints/best.ckpt

Tutorials: docs/README.md.
"""
from __future__ import annotations

import sys

from mmvl_cli.common import cli_main, command, print_registry, run_or_launch


def _run(opts: list[str]) -> int:
    import mmvl  # noqa: F401  (registers built-ins)
    from mmvl.config import load_config
    from mmvl.trainers import run

    if opts and opts[0] == "--list":  # --list [kind] [env.user_dir=... | config=...]
        from mmvl.config import import_registrations

        kinds = [o for o in opts[1:] if "=" not in o]
        import_registrations([o for o in opts[1:] if "=" in o])
        print_registry(kinds[0] if kinds else None)
        return 0
    config = load_config(opts)
    return run_or_launch(config, "mmvl_cli.run", opts, run)


def main(argv: list[str] | None = None) -> int:
    """``argv`` given: run in this process and return the exit status (tests, scripts). None: the
    command itself, which ends the process (see :func:`mmvl_cli.common.command`)."""
    if argv is None:
        command(lambda: cli_main(_run, sys.argv[1:], __doc__ or ""))
    return cli_main(_run, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
