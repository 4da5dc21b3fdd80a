"""One torchrun worker: run many cases of Accelerate's test scripts in this process, on one
implementation, writing one JSON line per finished case to ``<out>/rank<r>.jsonl``.

``python -m torch.distributed.run ... child.py IMPL OUT CASE_ID...``; ``IMPL`` is ``accelerate``
(the scripts as shipped) or ``mmvl`` (each script module's Accelerate names replaced by
``mmvl.engine``'s of the same name; an Accelerate name mmvl lacks becomes a stand-in that raises,
so a case never passes on Accelerate's code; the test utilities stay Accelerate's).

At 2 processes the ranks agree on each case's outcome through the launch's store; after a failure
the process group is made anew (:class:`Group`). A launch that crashes or hangs is followed by
another with the cases left (the parent's work).
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.engine.accelerate_scripts.cases import CASES, SCRIPTS  # noqa: E402

#: torch's seed in a new process
DEFAULT_SEED = 67280421310721
#: Accelerate's test utilities: the scripts' measuring tools, kept on both implementations
KEEP = {"RegressionDataset", "RegressionModel", "are_the_same_tensors", "get_torch_accelerator_backend",
        "is_bf16_available", "is_cuda_available", "is_datasets_available", "is_fp16_available",
        "is_hpu_available", "is_mps_available", "is_pytest_available"}


class Missing:
    """An Accelerate name mmvl does not define: any use raises (the case fails on mmvl)."""

    def __init__(self, name: str):
        self._name = name

    def _raise(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name} is not defined by mmvl.engine")

    __call__ = _raise

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._raise()


def _from_accelerate(value: Any) -> bool:
    module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] == "accelerate"


def port(module: Any) -> dict[str, str]:
    """Replace ``module``'s Accelerate names by mmvl.engine's; returns name -> what it became."""
    import mmvl.engine as engine

    done = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__") or not _from_accelerate(value) or name in KEEP \
                or getattr(value, "__module__", None) == module.__name__:  # the script's own test code
            continue
        if isinstance(value, type(module)):  # a module object (none of the scripts hold one)
            continue
        if hasattr(engine, name):
            setattr(module, name, getattr(engine, name))
            done[name] = "mmvl"
        else:
            setattr(module, name, Missing(name))
            done[name] = "missing"
    return done


def _reset_accelerate(impl: str) -> None:
    """Accelerate's process state afresh; on mmvl, set up for the test utilities only
    (``are_the_same_tensors`` reads it), as Accelerate's launcher would have."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if impl == "mmvl":
        AcceleratorState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)


class Group:
    """The default process group on a store of this launch, re-made after a failed case: a rank
    that failed early may have left its peers a collective behind, so the next case starts on new
    connections (no relaunch needed). Each rank's outcome of a case is agreed through the store."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.count = rank, world, 0
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                                   timeout=datetime.timedelta(seconds=120))
        self.make()

    def make(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.count += 1
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg{self.count}", self.store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def agree(self, case: str, ok: bool) -> bool:
        """Whether every rank passed ``case`` (each waits for the others' word, a stuck peer being
        released by the collective timeout); after a failure the group is made anew."""
        self.store.set(f"result/{case}/{self.rank}", "1" if ok else "0")
        keys = [f"result/{case}/{r}" for r in range(self.world)]
        self.store.wait(keys, datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S * 3))
        every = all(self.store.get(k) == b"1" for k in keys)
        if not every:
            self.make()
        return every


#: how long a rank waits in a collective its peer will not join (a failed case) before giving up
COLLECTIVE_TIMEOUT_S = 20


def main() -> None:
    impl, out, ids = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    group = Group(rank, world) if world > 1 else None
    modules = {}
    for key, name in SCRIPTS.items():
        modules[key] = importlib.import_module(name)
        if impl == "mmvl":
            port(modules[key])
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)
    workdir = out / f"work{rank}"
    workdir.mkdir(exist_ok=True)
    os.chdir(out)  # process_execution_check writes into the working folder (one shared file, as in main())
    for case_id in ids:
        case = CASES[case_id]
        module = modules[case.script]
        log.write(json.dumps({"case": case_id, "event": "start"}) + "\n")
        error = None
        try:
            _reset_accelerate(impl)
            # as a fresh process (torch's default seed, the same on every rank); data_loop's main() seeds by rank
            torch.manual_seed(rank if case.script == "data_loop" else DEFAULT_SEED)
            with warnings.catch_warnings():
                # as main(): an accelerator made first (its state is what AcceleratorState() reads)
                acc = module.create_accelerator() if case.script == "data_loop" else module.Accelerator()
                case.call(module, acc)
        except BaseException as e:  # noqa: BLE001 - a case's failure of any kind is its result
            error = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:]
        log.write(json.dumps({"case": case_id, "event": "end", "ok": error is None, "error": error}) + "\n")
        if group is not None:
            group.agree(case_id, error is None)
    log.close()
    os._exit(0)  # no teardown race between the implementations' exit handlers


if __name__ == "__main__":
    main()
