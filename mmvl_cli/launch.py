"""usage: mmvl_launch [options] SCRIPT.py [script arguments ...]
       mmvl_launch config [--config_file FILE]

Run your own training script (written on mmvl's Engine, or Accelerate's Accelerator ported to
it) in several processes, as `accelerate launch` does; `mmvl_run` starts its own processes and
does not need this.

Options (each overrides the config file's setting of the same name):
  --config_file FILE       launch settings (YAML); default $MMVL_LAUNCH_CONFIG, else
                           ~/.cache/mmvl/launch.yaml when it exists
  --num_processes N        processes on this machine
  --num_machines N         machines taking part (each runs mmvl_launch with its --machine_rank)
  --machine_rank R         this machine's rank, 0 to num_machines-1
  --main_process_ip ADDR   machine 0's address, reachable from every machine (several machines)
  --main_process_port P    its port (default 29500 with several machines, a free one with one)
  --mixed_precision MODE   no | fp16 | bf16: what an Engine made without its own precision uses
  --gradient_accumulation_steps K
                           what an Engine made without its own accumulation uses (default 1)
  --distributed_type TYPE  NO | MULTI_CPU (no GPUs in the workers) | MULTI_GPU
  --max_restarts N         restart every process up to N times after a failure (default 0)
  MMVL_DEBUG=1             (environment) show the full traceback of a launch mistake
  -h, --help               this text

`mmvl_launch config` asks each setting in the terminal (Enter keeps the default shown) and writes
the file (--config_file, else the default above).

Examples:
  mmvl_launch --num_processes 2 train.py --lr 1e-3
  mmvl_launch --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --num_processes 8 train.py
  mmvl_launch config --config_file launch.yaml && mmvl_launch --config_file launch.yaml train.py
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable, TextIO

from mmvl_cli.common import cli_main, command

#: the launcher's own flags: (name, type); everything from the script's path on is the script's
FLAGS: tuple[tuple[str, type], ...] = (
    ("config_file", str), ("num_processes", int), ("num_machines", int), ("machine_rank", int),
    ("main_process_ip", str), ("main_process_port", int), ("mixed_precision", str), ("gradient_accumulation_steps", int),
    ("distributed_type", str),
    ("max_restarts", int))


def _parser() -> argparse.ArgumentParser:
    from mmvl.errors import UserError

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line and exit code 2, as every mmvl mistake
            raise UserError(f"mmvl_launch: {message}; see mmvl_launch --help.")

    parser = Parser(prog="mmvl_launch", add_help=False, allow_abbrev=False)
    for name, kind in FLAGS:
        parser.add_argument(f"--{name}", type=kind, default=None)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _launch(argv: list[str]) -> int:
    from mmvl.distributed.launch_script import launch_script, read_settings

    if argv and argv[0] == "config":
        return configure(argv[1:])
    args = vars(_parser().parse_args(argv))
    overrides = {name: args[name] for name, _ in FLAGS if name not in ("config_file", "max_restarts")}
    settings = read_settings(args["config_file"], overrides)
    return launch_script(settings, args["script"], args["script_args"], max_restarts=args["max_restarts"] or 0)


#: ``mmvl_launch config``'s questions: (setting, question, parse), asked in this order
def _questions() -> list[tuple[str, str, Callable[[str], Any]]]:
    from mmvl.distributed.launch_script import COMPUTE_ENVIRONMENTS, DISTRIBUTED_TYPES, MIXED_PRECISIONS

    return [
        ("compute_environment", "In which compute environment are you running? (LOCAL_MACHINE)",
         _one_of(COMPUTE_ENVIRONMENTS)),
        ("num_machines", "How many machines will take part?", int),
        ("machine_rank", "What is the rank of this machine (0 to num_machines-1)?", int),
        ("main_process_ip", "What is the IP address of machine 0 (reachable from every machine)?", str),
        ("main_process_port", "Which port on machine 0 should the processes meet at?", int),
        ("distributed_type", "Which kind of processes? (NO, MULTI_CPU, MULTI_GPU)", _one_of(DISTRIBUTED_TYPES)),
        ("num_processes", "How many processes on this machine?", int),
        ("mixed_precision", "Mixed precision? (no, fp16, bf16)", _one_of(MIXED_PRECISIONS)),
        ("gradient_accumulation_steps", "How many batches to accumulate gradients over (1: none)?", int),
    ]


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A parser accepting one of ``allowed`` (any case for the upper-case names)."""
    def parse(answer: str) -> str:
        for value in allowed:
            if answer in (value, value.lower()):
                return value
        raise ValueError(answer)
    return parse


def configure(argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Ask every launch setting (defaults in brackets) and write the config file."""
    import torch

    from mmvl.distributed.launch_script import DEFAULT_PORT, LaunchSettings, write_settings
    from mmvl.errors import UserError

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    parser = argparse.ArgumentParser(prog="mmvl_launch config", add_help=False)
    parser.add_argument("--config_file", default=None)
    known, rest = parser.parse_known_args(argv)
    if rest:
        raise UserError(f"mmvl_launch config: unexpected {' '.join(rest)}; it takes only --config_file FILE.")
    cuda = torch.cuda.is_available()
    values: dict[str, Any] = {**dataclasses.asdict(LaunchSettings()),
                              "distributed_type": "MULTI_GPU" if cuda else "MULTI_CPU",
                              "num_processes": max(1, torch.cuda.device_count()) if cuda else 1}
    for key, question, parse in _questions():
        if key in ("machine_rank", "main_process_ip", "main_process_port") and values["num_machines"] == 1:
            continue  # one machine: a free local port, no address to ask for
        if key == "main_process_port" and values[key] is None:
            values[key] = DEFAULT_PORT
        values[key] = _ask(question, values[key], parse, key, stdin, stdout)
    path = write_settings(LaunchSettings(**values), known.config_file)
    print(f"mmvl_launch: settings written to {path}", file=stdout, flush=True)
    return 0


def _ask(question: str, default: Any, parse: Callable[[str], Any], key: str, stdin: TextIO, stdout: TextIO) -> Any:
    """One answer (Enter: ``default``); asked again after an answer that does not parse."""
    from mmvl.errors import UserError

    shown = "" if default is None else f" [{default}]"
    while True:
        print(f"{question}{shown}: ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            raise UserError(f"mmvl_launch config: the input ended before {key} was answered.")
        answer = line.strip()
        if not answer and default is not None:
            return default
        try:
            return parse(answer)
        except ValueError:
            print(f"  {answer!r} is not a valid {key}; try again.", file=stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``argv`` given: run in this process and return the exit status; None: the command itself."""
    if argv is None:
        command(lambda: cli_main(_launch, sys.argv[1:], __doc__ or "", raw=True))
    return cli_main(_launch, argv, __doc__ or "", raw=True)


if __name__ == "__main__":
    sys.exit(main())
