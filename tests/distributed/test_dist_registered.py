"""Every registered strategy is held to the contract: the 2-rank ones by a ``StrategyContract``
class (``dist_checks.PLANS``), the one-process ones here against the same reference."""
from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from dist_checks import HALF, ONE_PROCESS, PLANS, RUNS, STEPS, resume_single, roundtrip
from dist_contract import StrategyContract, assert_params_close
from dist_models import build, full_params, train
from mmvl.distributed import strategies  # noqa: F401  (registers the built-in strategies)
from mmvl.registry import STRATEGIES

HERE = os.path.dirname(os.path.abspath(__file__))


def _contract_classes() -> dict[str, type]:
    """``strategy -> StrategyContract subclass`` from the test modules next to this one."""
    found: dict[str, type] = {}
    for path in sorted(glob.glob(os.path.join(HERE, "test_dist_*.py"))):
        spec = importlib.util.spec_from_file_location(f"_contract_scan_{os.path.basename(path)[:-3]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, StrategyContract) and obj is not StrategyContract:
                found[obj.strategy] = obj
    return found


def test_every_registered_strategy_is_covered_by_the_contract():
    registered = {n for n in STRATEGIES.names() if STRATEGIES.get(n).__module__.startswith("mmvl.")}
    covered = set(PLANS) | set(ONE_PROCESS)
    assert registered == covered, (
        f"registered but not in the contract: {sorted(registered - covered)} (add them to dist_checks.PLANS "
        f"with a StrategyContract class, or to ONE_PROCESS); in the contract but not registered: "
        f"{sorted(covered - registered)}")
    assert not set(PLANS) & set(ONE_PROCESS)
    for name in PLANS:
        assert STRATEGIES.get(name).needs_process_group, f"{name} runs at world size 2 in the contract"
    for name in ONE_PROCESS:
        assert not STRATEGIES.get(name).needs_process_group, f"{name} needs a process group: put it in PLANS"


def test_every_two_rank_strategy_has_a_contract_class():
    classes = _contract_classes()
    assert set(classes) == set(PLANS)
    for name, cls in classes.items():
        assert STRATEGIES.get(name).__name__ == cls.cls_name


@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_one_process_strategy_matches_the_reference(name, references):
    """On CPU (or one GPU) ``dp`` leaves the model as it is, so it must equal the reference exactly;
    the runs, the clipping norm and a checkpoint resumed in a fresh process are checked as at world 2."""
    model_name = ONE_PROCESS[name]
    ref = references[model_name]
    for run, (accum, clip) in RUNS.items():
        strat, model, opt = build(model_name, name)
        assert type(strat) is STRATEGIES.get(name)
        norms = train(strat, model, opt, model_name, range(STEPS), accum=accum, clip=clip)
        assert_params_close(full_params(strat, model), ref["clip" if clip else "plain"])
        if clip:
            assert norms == pytest.approx(ref["clip_norms"], rel=1e-5)
    strat, model, opt = build(model_name, name)
    train(strat, model, opt, model_name, range(HALF))
    ckpt = roundtrip({"model": strat.model_state_dict(model), "optimizer": strat.optimizer_state_dict(model, opt)})
    assert_params_close(resume_single(model_name, ckpt), ref["plain"])
