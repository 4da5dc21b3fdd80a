"""Accelerate-style training scripts (tests/engine/ports/), each kept once, run with Accelerate and
with mmvl, where only the import lines differ, at 1 and at 2 gloo processes (torchrun)."""
from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.ports_resume_driver import killed_and_resumed, run_here
from tests.fixtures.faults import child_env, communicate, free_port

PORTS = Path(__file__).resolve().parent / "ports"
SCRIPTS = sorted(p for p in PORTS.glob("*.py") if p.name != "__init__.py")


def ported(script: Path, folder: Path) -> Path:
    """The mmvl form of an Accelerate script: every ``from accelerate... import X`` imports X from mmvl."""
    lines = []
    for line in script.read_text().splitlines(keepends=True):
        if line.startswith(("from accelerate import ", "from accelerate.utils import ", "from accelerate.local_sgd import ")):
            line = "from mmvl.engine import " + line.split(" import ", 1)[1]
        lines.append(line)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / script.name
    target.write_text("".join(lines))
    return target


REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "accelerate_reference.py"
#: runs every script's kill-and-resume case in one process (one torchrun launch for all)
DRIVER = Path(__file__).resolve().parent / "ports_resume_driver.py"


def run(script: Path, *args: str, nproc: int = 1, timeout: float = 300) -> str:
    """``script`` run to its end (at ``nproc`` torchrun processes); an Accelerate original (in PORTS)
    through ``accelerate_reference.py``, which ends it without Accelerate's exit race."""
    if script.parent == PORTS:
        script, args = REFERENCE, (str(script), *args)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.2"]
    popen = subprocess.Popen([*launcher, str(script), *args], env=child_env(CUDA_VISIBLE_DEVICES=""),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    result = communicate(popen, timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _outcome(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / "result.json").read_text()), torch.load(folder / "model.pt", weights_only=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_only_import_lines_differ(script, tmp_path):
    diff = [d for d in difflib.unified_diff(script.read_text().splitlines(), ported(script, tmp_path).read_text()
                                            .splitlines(), lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert diff and all(d[1:].startswith(("from accelerate", "from mmvl.engine import")) for d in diff), diff


def _flat(orders: list[list[list[int]]]) -> list[list[int]]:
    return [step for epoch in orders for step in epoch]


#: each script's kill-and-resume case: its arguments, the step after whose save_state the run is killed,
#: and the save interval (a save at every multiple of it); the kill is mid-epoch, on shuffled data
RESUMES = {
    "checkpointing": (["--batch_size", "8", "--dropout", "0.1"], 15, 5),  # 12 batches an epoch
    "nlp_example": (["--batch_size", "16", "--dropout", "0.1"], 10, 5),  # 8 batches an epoch
    "cv_example": (["--batch_size", "16"], 6, 3),  # 4 batches an epoch
    # 12 batches an epoch, updates at 5, 10, 12, 17, 22, 24 (a save only at an update)
    "gradient_accumulation": (["--batch_size", "8", "--gradient_accumulation_steps", "5"], 22, 2),
    "multi_process_metrics": (["--batch_size", "8"], 12, 4),  # 8 batches an epoch
    "early_stopping": (["--batch_size", "8"], 12, 4),  # 8 batches an epoch, stopping later (at 20)
    # batch 12 is over the simulated limit, the search settles on 10 (10 batches an epoch); on resume it
    # runs again, and the try at 10 loads the state (two tries a run: each one's gc.collect takes long here)
    "memory": (["--batch_size", "12", "--max_device_batch", "10"], 15, 5),
    # 12 batches an epoch, averages every 5 (a new LocalSGD each epoch): both saves fall between averages,
    # where the processes' parameters and momentum differ (at 1 process LocalSGD is off)
    "local_sgd": (["--batch_size", "8", "--local_sgd_steps", "5"], 14, 7),
}


def _case_args(name: str, nproc: int) -> list[str]:
    """``name``'s kill-and-resume arguments at ``nproc`` processes: the same global batch."""
    args = _halved(RESUMES[name][0]) if nproc > 1 else list(RESUMES[name][0])
    return args + ([] if name in ("nlp_example", "checkpointing") else ["--cpu"])  # (those two: CPU always)


def _resumed_is_uninterrupted(out: Path, name: str) -> None:
    """``out/full``, the uninterrupted run (no checkpoints; checkpointing.py's saves every 5 steps by
    default), against ``out/killed``, killed right after a mid-epoch save_state and resumed from that
    folder: the resumed run trains on the rest of the same batches, in the same order, and ends
    bitwise where the uninterrupted one ends, with the same metrics."""
    stop = RESUMES[name][1]
    (full, full_model), (resumed, resumed_model) = _outcome(out / "full"), _outcome(out / "killed")
    epoch_ends, total = set(), 0
    for epoch in full["orders"]:
        total += len(epoch)
        epoch_ends.add(total)
    assert 0 < stop < total and stop not in epoch_ends  # killed mid-epoch, before the run's end
    assert _flat(resumed["orders"]) == _flat(full["orders"])[stop:]
    assert full_model.keys() == resumed_model.keys()
    for key, value in full_model.items():
        assert torch.equal(resumed_model[key], value), key
    if "sums" in full:  # local_sgd: each process's parameter sum after every batch, from the kill on
        assert resumed["sums"] == full["sums"][stop:]
    counted_here = ("orders", "optimizer_steps", "sums")  # what each process counts of its own updates
    assert {k: v for k, v in resumed.items() if k not in counted_here} == \
        {k: v for k, v in full.items() if k not in counted_here}


# in this process (one interpreter for all, a real exit is SystemExit here); seconds each: slow
@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMES)
def test_each_port_killed_after_save_state_mid_epoch_and_resumed_is_bitwise_uninterrupted(tmp_path, name):
    script = ported(PORTS / f"{name}.py", tmp_path / "port")

    def launch(*args: str, status: int = 0) -> None:
        assert run_here(script, *args) == status

    killed_and_resumed(launch, _case_args(name, 1), *RESUMES[name][1:], tmp_path)
    _resumed_is_uninterrupted(tmp_path, name)


@pytest.mark.slow  # one torchrun launch of two processes for all seven (the fixture's)
@pytest.mark.parametrize("name", RESUMES)
def test_each_port_resumed_at_two_processes_is_bitwise_uninterrupted(at_two_processes, name):
    _resumed_is_uninterrupted(at_two_processes / name, name)
    full, args = _outcome(at_two_processes / name / "full")[0], _case_args(name, 2)
    per_process = full["tried"][-1] if "tried" in full else int(args[args.index("--batch_size") + 1])
    assert len(_flat(full["orders"])[0]) == 2 * per_process  # a gathered batch: both processes' parts


def _orders_are_new_disjoint_permutations(orders: list[list[list[int]]], n: int, nproc: int) -> None:
    epochs = [sum(epoch, []) for epoch in orders]
    assert all(sorted(e) == list(range(n)) for e in epochs) and len({tuple(e) for e in epochs}) == len(epochs)
    for epoch in orders:
        for step in epoch:  # gather() puts rank 0's part first
            parts = [step[r * len(step) // nproc:(r + 1) * len(step) // nproc] for r in range(nproc)]
            assert not set(parts[0]) & set(parts[-1]) or nproc == 1


@pytest.mark.slow
@pytest.mark.parametrize("name, global_batch, n", [("nlp_example", 16, 128), ("checkpointing", 8, 96)])
def test_shuffled_runs_are_accelerates_at_one_and_two_processes(tmp_path, at_two_processes, name, global_batch, n):
    """Shuffled, dropout off: the same batches in the same order as Accelerate's run of the same script and
    seed, epoch after epoch, and its weights: bitwise at 1 process, to float reduction error at 2 (the
    global batch split in two); each epoch a new order, the ranks' parts disjoint."""
    mmvl, out = ported(PORTS / f"{name}.py", tmp_path / "mmvl"), "--output_dir"
    in_process(mmvl, "--batch_size", str(global_batch), out, str(tmp_path / "one"))
    run(PORTS / f"{name}.py", "--batch_size", str(global_batch), out, str(tmp_path / "acc1"))
    run(PORTS / f"{name}.py", "--batch_size", str(global_batch // 2), out, str(tmp_path / "acc2"), nproc=2)
    (one, one_model), (acc1, acc1_model), (acc2, acc2_model) = (_outcome(tmp_path / k) for k in ("one", "acc1", "acc2"))
    two, two_model = _outcome(at_two_processes / f"{name}-two")
    assert one == acc1 and one_model.keys() == acc1_model.keys()
    assert all(torch.equal(one_model[k], v) for k, v in acc1_model.items())
    assert two["orders"] == acc2["orders"] != one["orders"]  # Accelerate's 2-process order is another draw
    _orders_are_new_disjoint_permutations(two["orders"], n, 2)
    _models_agree(acc2_model, two_model, TWO_VS_ACCELERATE)
    _agree(acc2, two, TWO_VS_ACCELERATE)


#: the feature scripts: their arguments at 1 process (halved at 2: the same global batch) and train samples
FEATURES = {
    "cv_example": (["--batch_size", "16"], 64),
    "gradient_accumulation": (["--batch_size", "8", "--gradient_accumulation_steps", "5"], 96),
    "multi_process_metrics": (["--batch_size", "8"], 64),
    "early_stopping": (["--batch_size", "8"], 64),
    "memory": (["--batch_size", "20", "--max_device_batch", "10"], 100),  # tries 20, 18, ..., 10
}
#: mmvl against Accelerate at 2 processes (the same batches; gradients averaged by each one's all-reduce):
#: weights, float metrics and parameter sums, relative
TWO_VS_ACCELERATE = 1e-6


def _halved(args: list[str]) -> list[str]:
    return [str(int(a) // 2) if a.isdigit() and args[i - 1] not in ("--gradient_accumulation_steps", "--local_sgd_steps")
            else a
            for i, a in enumerate(args)]


def _agree(a: dict, b: dict, tol: float, skip: tuple[str, ...] = ()) -> None:
    """Equal results, floats (and the per-batch parameter sums) within ``tol`` relative."""
    assert a.keys() == b.keys()
    for key in a.keys() - set(skip):
        if isinstance(a[key], float) or key == "sums":
            torch.testing.assert_close(torch.tensor(b[key], dtype=torch.float64),
                                       torch.tensor(a[key], dtype=torch.float64), rtol=tol, atol=tol * 1e-3, msg=key)
        else:
            assert a[key] == b[key], key


def _models_agree(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=tol, atol=tol * 1e-3, msg=key)


def in_process(script: Path, *args: str) -> None:
    """``script`` (an mmvl port) run to its end at 1 process in this interpreter: no start per run."""
    assert run_here(script, *args) == 0, f"{script.name} {' '.join(args)}"


#: the plain mmvl runs at 2 processes that share the fixture's launch: (case, arguments)
TWO_PROCESS_RUNS = {**{f"{name}-two": (name, ["--batch_size", str(batch // 2)])
                       for name, batch, _ in (("nlp_example", 16, 128), ("checkpointing", 8, 96))},
                    **{f"{name}-features": (name, [*_halved(FEATURES[name][0]), "--cpu"]) for name in FEATURES}}


@pytest.fixture(scope="module")
def at_two_processes(tmp_path_factory) -> Path:
    """Every mmvl run at 2 gloo processes, in one torchrun launch of ports_resume_driver.py: each
    rank runs them in its process, one after another (a launch per run cost ~15-60 s each): every
    script's three resume runs (``<folder>/<name>/{full,killed}``) and the plain runs of
    :data:`TWO_PROCESS_RUNS` (``<folder>/<key>``)."""
    folder = tmp_path_factory.mktemp("at_two")
    plan = [{"script": str(ported(PORTS / f"{name}.py", folder / "port")), "args": _case_args(name, 2),
             "stop": RESUMES[name][1], "every": RESUMES[name][2], "out": str(folder / name)} for name in RESUMES]
    plan += [{"script": str(ported(PORTS / f"{name}.py", folder / "port")), "args": args, "out": str(folder / key)}
             for key, (name, args) in TWO_PROCESS_RUNS.items()]
    (folder / "plan.json").write_text(json.dumps(plan))
    run(DRIVER, str(folder / "plan.json"), nproc=2, timeout=900)
    return folder


# mmvl's run in this process, Accelerate's in its own interpreter: slow; only the import-line check stays fast
@pytest.mark.slow
@pytest.mark.parametrize("name", FEATURES)
def test_one_process_shuffled_ends_bitwise_where_accelerate_ends(tmp_path, name):
    args = [*FEATURES[name][0], "--cpu", "--output_dir"]
    in_process(ported(PORTS / f"{name}.py", tmp_path / "port"), *args, str(tmp_path / "mmvl"))
    run(PORTS / f"{name}.py", *args, str(tmp_path / "acc"))
    (mine, my_model), (acc, acc_model) = _outcome(tmp_path / "mmvl"), _outcome(tmp_path / "acc")
    assert mine == acc and my_model.keys() == acc_model.keys()  # the same orders, counts and metrics
    assert all(torch.equal(my_model[k], v) for k, v in acc_model.items())
    if name == "gradient_accumulation":
        assert mine["optimizer_steps"] == 3 * 3  # batches 5, 10 and the epoch's last, 12
    if name == "early_stopping":
        assert 0 < mine["stopped_at"] < 20 * 8 and mine["loss"] < 0.25
    if name == "memory":
        assert mine["tried"] == [20, 18, 16, 14, 12, 10]
    if name == "multi_process_metrics":
        assert mine["eval_ids"] == list(range(37))


@pytest.mark.slow
@pytest.mark.parametrize("name", FEATURES)
def test_feature_scripts_at_two_processes_are_accelerates(tmp_path, at_two_processes, name):
    """mmvl at 2 processes against Accelerate at 2, shuffled: the same batches in the same order, each epoch
    a new permutation with the ranks' parts disjoint, the weights and metrics within TWO_VS_ACCELERATE."""
    args, n = FEATURES[name]
    run(PORTS / f"{name}.py", *_halved(args), "--cpu", "--output_dir", str(tmp_path / "acc"), nproc=2)
    acc, acc_model = _outcome(tmp_path / "acc")
    two, two_model = _outcome(at_two_processes / f"{name}-features")
    assert two["orders"] == acc["orders"]
    complete = two["orders"][:-1] if name == "early_stopping" else two["orders"]
    assert len(complete) >= 2
    _orders_are_new_disjoint_permutations(complete, n, 2)
    _models_agree(acc_model, two_model, TWO_VS_ACCELERATE)
    _agree(acc, two, TWO_VS_ACCELERATE)
    if name == "memory":  # each process's batch: half of one process's
        assert two["tried"] == [10, 9, 8, 7, 6, 5]
    if name == "multi_process_metrics":  # every eval sample counted once, the uneven last batch's padding dropped
        assert two["eval_ids"] == list(range(37))
    if name == "gradient_accumulation":
        assert two["optimizer_steps"] == 9


@pytest.mark.slow  # four script launches (~15 s each)
@pytest.mark.proc
@pytest.mark.parametrize("nproc", [1, 2])
def test_local_sgd_follows_accelerates_own_trajectory(tmp_path, nproc):
    """Accelerate's by_feature/local_sgd.py form (ports/local_sgd.py), shuffled: mmvl's run and
    Accelerate's see the same batches and give every process the same parameter sum after every batch
    and the same final weights: bitwise at 1 process (LocalSGD off), to 1e-6 relative at 2 (averaged
    every 5 batches)."""
    args = ["--batch_size", str(8 // nproc), "--local_sgd_steps", "5", "--cpu", "--output_dir"]
    run(ported(PORTS / "local_sgd.py", tmp_path / "port"), *args, str(tmp_path / "mmvl"), nproc=nproc)
    run(PORTS / "local_sgd.py", *args, str(tmp_path / "acc"), nproc=nproc)
    (mine, my_model), (acc, acc_model) = _outcome(tmp_path / "mmvl"), _outcome(tmp_path / "acc")
    assert mine["orders"] == acc["orders"] and mine["eval_total"] == acc["eval_total"]
    assert my_model.keys() == acc_model.keys()
    if nproc == 1:
        assert mine["sums"] == acc["sums"]
        assert all(torch.equal(my_model[k], v) for k, v in acc_model.items())
        return
    averaged = [i for i, s in enumerate(mine["sums"]) if s[0] == s[1]]
    assert averaged[:2] == [4, 9] and len(averaged) < len(mine["sums"]) // 2  # apart between averages
    torch.testing.assert_close(torch.tensor(mine["sums"]), torch.tensor(acc["sums"]), rtol=1e-6, atol=0)
    for key, value in acc_model.items():
        torch.testing.assert_close(my_model[key], value, rtol=1e-6, atol=1e-7, msg=key)


#: the trajectories the proc tier holds to Accelerate's: each script's arguments at 1 process (halved at 2)
TRAJECTORIES = {"nlp_example": ["--batch_size", "16"],
                "gradient_accumulation": ["--batch_size", "8", "--gradient_accumulation_steps", "5", "--cpu"]}


@pytest.mark.proc  # Accelerate's run in its own interpreter (two torchrun launches at 2 processes): ~10-40 s
@pytest.mark.parametrize("name, nproc", [("nlp_example", 1), ("gradient_accumulation", 1), ("gradient_accumulation", 2)])
def test_parameter_sums_after_every_update_are_accelerates(tmp_path, name, nproc):
    """The same script and seed, shuffled, on mmvl and on Accelerate: the same batches in the same order,
    and the sum of the parameters after every batch bitwise equal at 1 process, within 1e-6 at 2."""
    args = TRAJECTORIES[name] if nproc == 1 else _halved(TRAJECTORIES[name])
    mmvl = ported(PORTS / f"{name}.py", tmp_path / "port")
    if nproc == 1:
        in_process(mmvl, *args, "--output_dir", str(tmp_path / "mmvl"))
    else:
        run(mmvl, *args, "--output_dir", str(tmp_path / "mmvl"), nproc=nproc)
    run(PORTS / f"{name}.py", *args, "--output_dir", str(tmp_path / "acc"), nproc=nproc)
    (mine, _), (acc, _) = _outcome(tmp_path / "mmvl"), _outcome(tmp_path / "acc")
    assert mine["orders"] == acc["orders"] and len(mine["sums"]) == sum(len(e) for e in mine["orders"])
    assert len(set(mine["sums"])) > 1  # the parameters moved
    if nproc == 1:
        assert mine["sums"] == acc["sums"]
    else:
        _agree(acc, mine, TWO_VS_ACCELERATE)
