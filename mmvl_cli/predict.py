"""``mmvl_predict config=... checkpoint.resume_file=path.ckpt [key=value ...]``

Runs the model on the test split and writes
``<save_dir>/predictions/<dataset>_test.<json|csv>``. Same options as mmvl_run.
"""
from __future__ import annotations

import sys

from mmvl_cli.common import cli_main


def _predict(opts: list[str]) -> int:
    import mmvl  # noqa: F401
    from mmvl.config import load_config
    from mmvl.trainers import run

    config = load_config(["run_type=test", "evaluation.predict=true", *opts])
    run(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_predict, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
