"""What every mmvl command shares: one-line user errors with exit code 2, ``--debug``, starting
local processes for ``distributed.world_size``, and how a command process ends."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn


def cli_main(fn: Callable[[list[str]], int], argv: list[str], doc: str = "", raw: bool = False) -> int:
    """Run ``fn(opts)``; a UserError prints one line and returns 2 (``--debug`` shows the traceback).

    ``raw``: ``argv`` reaches ``fn`` as given (``mmvl_launch``, whose arguments end with the user
    script's own, which may use ``--debug`` or ``--local-rank`` themselves); MMVL_DEBUG=1 still works."""
    debug = (not raw and "--debug" in argv) or os.environ.get("MMVL_DEBUG", "") not in ("", "0")
    opts = argv if raw else [a for a in argv if a != "--debug"]
    if opts and opts[0] in ("-h", "--help"):
        print(doc.strip())
        return 0
    from mmvl.errors import UserError

    try:
        return fn(opts if raw else launcher_free(opts))
    except UserError as e:
        if debug:
            raise
        if os.environ.get("RANK") is not None:
            from mmvl.distributed.launch import report_user_error

            if report_user_error(user_message(e)):
                return 2  # the launcher prints it, once for all ranks
        rank = os.environ.get("RANK", "0")
        prefix = "mmvl: error: " if rank == "0" else f"mmvl: error (rank {rank}): "
        print(prefix + user_message(e), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("mmvl: interrupted", file=sys.stderr)
        return 130


def launcher_free(opts: list[str]) -> list[str]:
    """``opts`` without the ``--local-rank=N`` that ``python -m torch.distributed.launch`` adds (the
    MMF guide's launch line); its rank becomes ``LOCAL_RANK`` when the launcher did not set that."""
    from mmvl.distributed.init import split_local_rank

    rest, local_rank = split_local_rank(opts)
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    return rest


def command(fn: Callable[[], int]) -> NoReturn:
    """Run a command as this process's entry point and end the process with its exit status.

    A crash prints its traceback as Python would (status 1). The process ends through
    :func:`mmvl.distributed.init.exit_process`, which in a distributed run leaves the process
    group and skips interpreter shutdown (why: see there).
    """
    try:
        code = fn()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported here, before the process group is left
        sys.excepthook(*sys.exc_info())  # as Python would print it (torch prefixes "[rankN]:")
        code = 1
    from mmvl.distributed.init import exit_process

    exit_process(code)


def user_message(error: BaseException) -> str:
    """The error's message on one line; for one re-raised from a DataLoader worker, the original
    message without the worker's traceback that torch wraps around it."""
    text = " ".join(str(error).split())
    marker = f"{type(error).__module__}.{type(error).__name__}: "
    if "Original Traceback" in text and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text


def run_or_launch(config: Any, module: str, opts: list[str], run: Callable[[Any], Any]) -> int:
    """``run(config)`` in this process, or, when ``distributed.world_size`` > 1 and nothing launched
    this process, ``python -m <module> <opts>`` in that many local processes (as torchrun would)."""
    from mmvl.distributed.launch import launch_local, processes_to_start

    if processes_to_start(config):
        return launch_local(config, module, opts)
    run(config)
    return 0


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
