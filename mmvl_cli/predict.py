"""usage: mmvl_predict [config=FILE.yaml ...] [checkpoint.resume_file=PATH.ckpt] [key=value ...] [--debug]

Run a model on the test split and write its predictions to
<env.save_dir>/predictions/<dataset>_test.json (VQA: question_id, answer; Sort-of-CLEVR:
id, answer) or .csv (Hateful Memes: id, proba, label). It is mmvl_run with
run_type=test and evaluation.predict=true preset, so it takes the same arguments:

  config=FILE        a YAML file (repeatable); later layers win, command line last
  model=NAME         a registered model (mmvl_run --list model)
  datasets=A[,B]     the datasets to predict on (dataset= also works)
  run_type=TYPE      test (preset); val predicts on the validation split instead
  a.b.c=VALUE        any config key, VALUE read as YAML (3, 1e-3, true, null, [a,b])
  checkpoint.resume_file=PATH   the checkpoint whose weights make the predictions; without it,
                     the newest checkpoint in env.save_dir; with neither it stops (untrained
                     weights predict nothing useful)

Options:
  --debug            show the full traceback of an error (also MMVL_DEBUG=1); without it
                     a mistake prints one line naming the value and the fix, exit code 2
  -h, --help         this text
  (the names model= and datasets= accept: `mmvl_run --list model`, `mmvl_run --list dataset`)

Examples:
  # predictions of the demo's best checkpoint on the Sort-of-CLEVR test split
  mmvl_predict config=projects/relation_network/configs/sort_of_clevr/defaults.yaml \\
      checkpoint.resume_file=save/relation_network_sort_of_clevr/checkpoints/best.ckpt
  # VQA v2 test-split answers from a trained model, written under save/vqa
  mmvl_predict config=projects/visual_bert/configs/vqa2/defaults.yaml env.save_dir=save/vqa \\
      checkpoint.resume_file=save/vqa/checkpoints/best.ckpt
  # predictions on the validation split instead
  mmvl_predict config=projects/relation_network/configs/sort_of_clevr/defaults.yaml run_type=val \\
      checkpoint.resume_file=save/relation_network_sort_of_clevr/checkpoints/best.ckpt
"""
from __future__ import annotations

import sys
from typing import Any

from mmvl_cli.common import cli_main, command, run_or_launch


def require_checkpoint(config: Any) -> None:
    """A UserError unless ``config`` names a checkpoint or finds one in ``env.save_dir``."""
    from mmvl.checkpoint import CheckpointManager
    from mmvl.errors import UserError

    ck = config.checkpoint
    if ck.get("resume_file"):
        return
    manager = CheckpointManager(str(config.env.save_dir))
    if str(ck.get("resume")).lower() == "false":
        why = "checkpoint.resume=false keeps it from loading one"
    elif manager.find_latest(best=bool(ck.get("resume_best"))) is None:
        why = f"there is no checkpoint in {manager.directory}"
    else:
        return
    raise UserError(f"mmvl_predict needs trained weights, and {why}; set checkpoint.resume_file=<path.ckpt>, "
                    "or env.save_dir=<the training run's folder>.")


def check_outputs(config: Any) -> None:
    """A UserError when a prediction file could not be written, before the split is evaluated."""
    from mmvl.data.predictions import check_prediction_targets

    check_prediction_targets(str(config.env.save_dir), [str(n) for n in config.get("datasets") or []],
                             [str(config.get("run_type"))])


def _predict(opts: list[str]) -> int:
    import mmvl  # noqa: F401
    from mmvl.config import load_config
    from mmvl.trainers import run

    config = load_config(["run_type=test", "evaluation.predict=true", *opts])
    require_checkpoint(config)
    check_outputs(config)
    return run_or_launch(config, "mmvl_cli.predict", opts, run)


def main(argv: list[str] | None = None) -> int:
    """``argv`` given: run in this process and return the exit status (tests, scripts). None: the
    command itself, which ends the process (see :func:`mmvl_cli.common.command`)."""
    if argv is None:
        command(lambda: cli_main(_predict, sys.argv[1:], __doc__ or ""))
    return cli_main(_predict, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
