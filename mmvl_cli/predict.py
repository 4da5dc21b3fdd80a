"""``mmvl_predict config=... checkpoint.resume_file=path.ckpt [key=value ...]``

Runs the model on the test split and writes
``<save_dir>/predictions/<dataset>_test.<json|csv>``. Same options as mmvl_run.
The weights come from ``checkpoint.resume_file``, else from the newest checkpoint in
``env.save_dir``; without either it stops (predicting with untrained weights helps nobody).
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


def _predict(opts: list[str]) -> int:
    import mmvl  # noqa: F401
    from mmvl.config import load_config
    from mmvl.trainers import run

    config = load_config(["run_type=test", "evaluation.predict=true", *opts])
    require_checkpoint(config)
    return run_or_launch(config, "mmvl_cli.predict", opts, run)


def main(argv: list[str] | None = None) -> int:
    """``argv`` given: run in this process and return the exit status (tests, scripts). None: the
    command itself, which ends the process (see :func:`mmvl_cli.common.command`)."""
    if argv is None:
        command(lambda: cli_main(_predict, sys.argv[1:], __doc__ or ""))
    return cli_main(_predict, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
