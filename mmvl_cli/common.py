"""What every mmvl command shares: one-line user errors with exit code 2, ``--debug``."""
from __future__ import annotations

import os
import sys
from typing import Callable


def cli_main(fn: Callable[[list[str]], int], argv: list[str], doc: str = "") -> int:
    """Run ``fn(opts)``; a UserError prints one line and returns 2 (``--debug`` shows the traceback)."""
    debug = "--debug" in argv or os.environ.get("MMVL_DEBUG", "") not in ("", "0")
    opts = [a for a in argv if a != "--debug"]
    if opts and opts[0] in ("-h", "--help"):
        print(doc.strip())
        return 0
    from mmvl.errors import UserError

    try:
        return fn(opts)
    except UserError as e:
        if debug:
            raise
        rank = os.environ.get("RANK", "0")
        prefix = "mmvl: error: " if rank == "0" else f"mmvl: error (rank {rank}): "
        print(prefix + user_message(e), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("mmvl: interrupted", file=sys.stderr)
        return 130


def user_message(error: BaseException) -> str:
    """The error's message on one line; for one re-raised from a DataLoader worker, the original
    message without the worker's traceback that torch wraps around it."""
    text = " ".join(str(error).split())
    marker = f"{type(error).__module__}.{type(error).__name__}: "
    if "Original Traceback" in text and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text


def print_registry(kind: str | None) -> None:
    """Print every registered name, by kind (``mmvl_run --list [kind]``)."""
    from mmvl import registry
    from mmvl.errors import UserError, did_you_mean

    kinds = registry.ALL
    if kind is not None and kind.rstrip("s") not in kinds:
        raise UserError(f"Unknown registry kind {kind!r}.{did_you_mean(kind, kinds)} "
                        f"Kinds: {', '.join(kinds)}.")
    for name, reg in kinds.items():
        if kind is None or name == kind.rstrip("s"):
            print(f"{name}: {', '.join(reg.names()) or '(none)'}")
