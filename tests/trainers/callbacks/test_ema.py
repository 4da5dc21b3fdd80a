"""Model EMA: the average after every update, evaluated in place of the live weights (and swapped back),
checkpointed and resumed bitwise, under ddp the EMA of the unwrapped module."""
from __future__ import annotations

import pytest
import torch

from mmvl.checkpoint import schema
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.io import safe_load
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.toy import register, toy_opts

EMA = "training.ema.decay=0.9"


def _fit(tmp_path, *opts: str) -> Trainer:
    register()
    trainer = Trainer(load_config(toy_opts(tmp_path, *opts)))
    trainer.fit()
    return trainer


def _ema(path) -> dict[str, torch.Tensor]:
    return safe_load(str(path))[schema.EMA]["weights"]


def _live(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.unwrap_model(trainer.model).state_dict().items()}


def test_ema_follows_every_update_and_is_what_evaluation_sees(tmp_path, capsys):
    register()
    trainer = Trainer(load_config(toy_opts(tmp_path, EMA, "training.max_updates=3", "run_type=train")))
    module = trainer.engine.unwrap_model(trainer.model)
    expected = {n: p.detach().clone() for n, p in module.named_parameters()}
    seen = []
    from mmvl.trainers.callbacks import Callback

    class Record(Callback):  # after the ema callback: the weights each update ended with
        def on_update_end(self, info):
            for n, p in module.named_parameters():
                expected[n] = 0.9 * expected[n] + 0.1 * p.detach()
            seen.append(1)

    trainer.callbacks.append(Record(trainer))
    trainer.fit()
    ema = next(c for c in trainer.callbacks if type(c).__name__ == "EmaCallback")
    assert len(seen) == 3 and ema.updates == 3
    names = [n for n, _ in module.named_parameters()]
    for name, averaged in zip(names, ema.shadow()):
        torch.testing.assert_close(averaged, expected[name], atol=1e-6, rtol=0)
    live = _live(trainer)
    capsys.readouterr()
    with ema.evaluating("val"):
        inside = _live(trainer)
    assert "Evaluating val with the EMA weights (training.ema.decay=0.9, 3 updates averaged)" in capsys.readouterr().out
    for name, averaged in zip(names, ema.shadow()):
        assert torch.equal(inside[name], averaged) and not torch.equal(inside[name], live[name])
    assert all(torch.equal(v, _live(trainer)[k]) for k, v in live.items())  # swapped back


def test_evaluation_uses_the_ema_weights(tmp_path):
    plain = _fit(tmp_path / "plain", "run_type=train")
    averaged = _fit(tmp_path / "ema", EMA, "run_type=train")
    assert all(torch.equal(v, _live(averaged)[k]) for k, v in _live(plain).items())  # EMA never touches training
    with_ema = averaged.evaluate("val")
    assert with_ema != plain.evaluate("val")
    ema = next(c for c in averaged.callbacks if type(c).__name__ == "EmaCallback")
    with torch.no_grad():  # the plain run given the EMA weights evaluates exactly as the EMA run does
        for p, s in zip(plain.engine.unwrap_model(plain.model).parameters(), ema.shadow()):
            p.copy_(s)
    assert plain.evaluate("val") == with_ema


def test_resume_is_bitwise(tmp_path):
    opts = (EMA, "model_config.toy_mlp.hidden_dropout_prob=0.2", "run_type=train")
    straight = _fit(tmp_path / "straight", *opts)
    first = _fit(tmp_path / "resumed", *opts, "training.callbacks=[{type: stop_at, params: {update: 6}}]")
    assert first.update == 6
    second = _fit(tmp_path / "resumed", *opts, "checkpoint.resume=true")
    assert second.update == 12
    a = _ema(tmp_path / "straight" / "save" / "checkpoints" / "last.ckpt")
    b = _ema(tmp_path / "resumed" / "save" / "checkpoints" / "last.ckpt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], _live(straight)[k]) for k in a)  # an average, not the weights


def test_turning_ema_on_at_a_resume_starts_from_the_resumed_weights(tmp_path):
    first = _fit(tmp_path, "run_type=train", "training.max_updates=6")
    weights = _live(first)
    second = Trainer(load_config(toy_opts(tmp_path, "run_type=train", EMA, "training.max_updates=6",
                                          "checkpoint.resume=true")))
    ema = next(c for c in second.callbacks if type(c).__name__ == "EmaCallback")
    names = [n for n, _ in second.engine.unwrap_model(second.model).named_parameters()]
    assert all(torch.equal(s, weights[n]) for n, s in zip(names, ema.shadow()))


def test_off_by_default_and_user_errors(tmp_path):
    register()
    t = Trainer(load_config(toy_opts(tmp_path / "a", "run_type=train")))
    assert not any(type(c).__name__ == "EmaCallback" for c in t.callbacks) and schema.EMA not in t.engine.checkpointables
    with pytest.raises(UserError, match="in \\(0, 1\\)"):
        Trainer(load_config(toy_opts(tmp_path / "b", "training.ema.decay=1.5")))
    with pytest.raises(UserError, match="'ema' callback"):
        Trainer(load_config(toy_opts(tmp_path / "c", EMA, "training.builtin_callbacks=[logging,evaluation]")))


def _ddp(env, root):
    register()
    opts = toy_opts(root, EMA, "run_type=train", "distributed.strategy=ddp")
    trainer = Trainer(load_config(opts), env=env)
    trainer.fit()
    return {"ema": _ema(f"{root}/save/checkpoints/last.ckpt") if env.rank == 0 else None}


@pytest.mark.slow  # ~16 s: two ranks start, build a run and train or evaluate it
@pytest.mark.proc
def test_ddp_averages_the_unwrapped_module(tmp_path):
    single = _fit(tmp_path / "single", EMA, "run_type=train")
    reference = _ema(tmp_path / "single" / "save" / "checkpoints" / "last.ckpt")
    assert set(reference) == set(dict(single.engine.unwrap_model(single.model).named_parameters()))
    ema = launch(_ddp, world_size=2, args=(str(tmp_path / "ddp"),), timeout=200)[0]["ema"]
    assert set(ema) == set(reference)  # no "module." prefix
    for k, v in reference.items():
        torch.testing.assert_close(ema[k], v, atol=1e-5, rtol=0)


def test_ema_updates_do_not_sync(tmp_path):
    """The EMA's lerp after each update reads nothing back and copies nothing to the device
    (counted as tests/trainers/test_sync_free.py counts the step's)."""
    from tests.trainers.test_sync_free import COMMON, _check, _per_update_syncs

    register()
    trainer = Trainer(load_config(toy_opts(tmp_path, EMA, *COMMON)))
    assert any(type(c).__name__ == "EmaCallback" for c in trainer.callbacks)
    _check(_per_update_syncs(trainer))
