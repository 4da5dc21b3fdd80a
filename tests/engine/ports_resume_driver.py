"""Runs port scripts' kill-and-resume cases in this process, one after another: the uninterrupted run,
the run killed right after a mid-epoch ``save_state`` (``--stop_after``: ``SystemExit(3)`` on every
rank) and the run resumed from that folder. Under ``torchrun`` every rank runs the same sequence, so
one launch covers every script (a launch costs seconds; three per script for seven scripts do not fit
the slow suite), and each script's ``Accelerator()`` is made again in the same process: after
``end_training()`` left the process group, and after a ``SystemExit`` left it up.

``python tests/engine/ports_resume_driver.py PLAN.json``: the plan is a list of cases, each
``{"script", "args", "stop", "every", "out"}``; each case writes ``<out>/full`` and ``<out>/killed``
(each with the script's result.json and model.pt) for the test to compare. A case without ``stop``
is one plain run of the script with ``args`` into ``--output_dir <out>`` (the other 2-process
comparisons of tests/engine/test_ports.py share the launch).
"""
from __future__ import annotations

import json
import random
import runpy
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

#: the status a script exits with right after the save its ``--stop_after`` names
KILLED = 3


def run_here(script: Path, *args: str) -> int:
    """``python script args`` in this process (no interpreter start per run); its exit status. Python's,
    NumPy's and torch's RNGs are left as they were (each script seeds them itself, with ``set_seed``)."""
    argv, py_state, np_state = sys.argv, random.getstate(), np.random.get_state()
    sys.argv = [str(script), *args]
    try:
        with torch.random.fork_rng(devices=[]):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = argv
        random.setstate(py_state)
        np.random.set_state(np_state)
    return 0


def killed_and_resumed(launch: Callable[..., None], args: list[str], stop: int, every: int, out: Path) -> None:
    """The three runs of one case through ``launch(*argv, status=...)``: ``out/full`` uninterrupted
    (no checkpoints), then ``out/killed`` killed after the save at step ``stop`` (saves every
    ``every`` steps) and resumed from that save's folder into the same ``out/killed``."""
    killed = out / "killed"
    launch(*args, "--output_dir", str(out / "full"))
    launch(*args, "--checkpointing_steps", str(every), "--stop_after", str(stop), "--output_dir", str(killed),
           status=KILLED)
    folder, = (f for f in killed.iterdir() if f.name.split("_")[:2] == ["step", str(stop)])  # memory: + _batch_<size>
    launch(*args, "--resume_from_checkpoint", str(folder), "--output_dir", str(killed))


def main(plan_file: str) -> int:
    for case in json.loads(Path(plan_file).read_text()):
        script = Path(case["script"])

        def launch(*argv: str, status: int = 0) -> None:
            got = run_here(script, *argv)
            if got != status:
                raise RuntimeError(f"{script.name} {' '.join(argv)}: exit status {got}, expected {status}")

        if "stop" in case:
            killed_and_resumed(launch, case["args"], case["stop"], case["every"], Path(case["out"]))
        else:
            launch(*case["args"], "--output_dir", case["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
