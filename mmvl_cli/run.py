"""``mmvl_run config=... [key=value ...]``: train/evaluate from YAML.

``python -m mmvl_cli.run`` works too, so ``torchrun ... -m mmvl_cli.run`` does.
``mmvl_run --list [kind] [env.user_dir=...]`` prints the registered names, the user's too.
Without a launcher, ``distributed.world_size=N`` (N > 1) starts N local processes itself, as
``torchrun --standalone --nproc-per-node=N`` would (``distributed.max_restarts`` restarts).
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
