"""Run cases of Accelerate's test scripts under torchrun, on Accelerate or on mmvl.

One launch per (implementation, world size) runs every case in one process per rank (start-up is
the cost); a launch that ends early (a failed case at 2 processes, a crash, a hang) is followed by
another with the cases left. ``python -m tests.engine.accelerate_scripts.harness`` prints the table.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.engine.accelerate_scripts.cases import CASES, cases_at
from tests.fixtures.faults import child_env, communicate, free_port

CHILD = Path(__file__).resolve().parent / "child.py"
IMPLS = ("accelerate", "mmvl")


def _launch(impl: str, world: int, ids: list[str], out: Path, timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.2",
           str(CHILD), impl, str(out), *ids]
    # ACCELERATE_USE_CPU: what `accelerate launch --cpu` sets; without it Accelerate on a machine without
    # GPUs sees one process (DistributedType.NO) at any world size
    popen = subprocess.Popen(cmd, env=child_env(CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
                                                ACCELERATE_USE_CPU="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    result = communicate(popen, timeout)
    (out / "launches.log").open("a").write(f"== {ids[0]} .. ({len(ids)}): rc {result.returncode}\n"
                                           f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}\n")


def _read(out: Path, world: int) -> tuple[dict[str, dict[int, tuple[bool, str | None]]], dict[int, str]]:
    """Finished cases (case -> rank -> (ok, error)) and each rank's case in progress."""
    ended: dict[str, dict[int, tuple[bool, str | None]]] = {}
    running: dict[int, str] = {}
    for rank in range(world):
        path = out / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "start":
                running[rank] = rec["case"]
            else:
                ended.setdefault(rec["case"], {})[rank] = (rec["ok"], rec["error"])
                running.pop(rank, None)
    return ended, running


def run_cases(impl: str, world: int, ids: list[str], timeout_per_case: float = 60.0,
              out: Path | None = None) -> dict[str, tuple[bool, str | None]]:
    """``{case id: (passed on every rank, the first error)}`` for ``ids`` on ``impl`` at ``world``."""
    out = Path(out or tempfile.mkdtemp(prefix=f"accel_{impl}_{world}_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, tuple[bool, str | None]] = {}
    left = list(ids)
    while left:
        _launch(impl, world, left, out, timeout=30 + timeout_per_case * len(left))
        ended, running = _read(out, world)
        for case in list(left):
            ranks = ended.get(case, {})
            failed = [err for ok, err in ranks.values() if not ok]
            if failed or len(ranks) == world:
                results[case] = (not failed, failed[0] if failed else None)
        newly = [c for c in left if c in results]
        left = [c for c in left if c not in results]
        if left and not newly:  # the launch died in its first case without a word from it
            stuck = next((c for c in running.values() if c in left), left[0])
            results[stuck] = (False, "the launch ended inside this case (crash or hang); see launches.log")
            left.remove(stuck)
        for rank in range(world):  # the next launch starts its records afresh
            path = out / f"rank{rank}.jsonl"
            if path.exists():
                path.rename(out / f"rank{rank}.{time.monotonic_ns()}.jsonl")
    return results


def run_all(worlds: tuple[int, ...] = (1, 2), extra: bool = True, out: Path | None = None,
            impls: tuple[str, ...] = IMPLS) -> dict[tuple[str, int], dict[str, tuple[bool, str | None]]]:
    root = Path(out or tempfile.mkdtemp(prefix="accel_scripts_"))
    return {(impl, w): run_cases(impl, w, [c.id for c in cases_at(w, extra)], out=root / f"{impl}_{w}")
            for w in worlds for impl in impls}


def table(results: dict[tuple[str, int], dict[str, tuple[bool, str | None]]]) -> str:
    lines = []
    worlds = sorted({w for _, w in results})
    for w in worlds:
        for script in ("script", "sync", "data_loop"):
            for extra in (False, True):
                ids = [c for c in next(r for (_, rw), r in results.items() if rw == w) if CASES[c].script == script
                       and CASES[c].extra == extra]
                if not ids:
                    continue
                counts = "  ".join(f"{i} {sum(results[(i, w)][c][0] for c in ids):2d}/{len(ids)}"
                                   for i in IMPLS if (i, w) in results)
                label = f"{script}{' (GPU-only in main)' if extra else ''}"
                lines.append(f"world {w} {label:32s} {counts}")
    return "\n".join(lines)


def main() -> None:
    """``harness [accelerate|mmvl] [1] [2]``: the implementations and world sizes to run (default all)."""
    impls = tuple(a for a in sys.argv[1:] if a in IMPLS) or IMPLS
    worlds = tuple(int(w) for w in sys.argv[1:] if w.isdigit()) or (1, 2)
    results = run_all(worlds, impls=impls)
    for (impl, w), res in sorted(results.items()):
        for case, (ok, err) in res.items():
            first = (err or "").splitlines()[0][:160] if err else ""
            print(f"{impl:10s} w{w} {'PASS' if ok else 'FAIL'} {case}  {first}")
    print(table(results))


if __name__ == "__main__":
    main()
