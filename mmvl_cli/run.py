"""``mmvl_run config=... [key=value ...]``: train/evaluate from YAML.

``python -m mmvl_cli.run`` works too, so ``torchrun ... -m mmvl_cli.run`` does.
``mmvl_run --list [kind] [env.user_dir=...]`` prints the registered names, the user's too.
"""
from __future__ import annotations

import sys

from mmvl_cli.common import cli_main, print_registry


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
    run(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_run, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
