"""``model_config.<model>.freeze``: every registered model freezes each part it offers, and a frozen
part gets no gradient, no optimizer state and no update, and resumes strictly.

The models come from the registry and their tiny configs (tests/models/tiny/<model>.yaml), so a
model registered later is held to the same contract. The 2-process ``ddp`` / ``fsdp`` runs are in
tests/distributed/test_dist_freeze.py.
"""
from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import mmvl  # noqa: F401  (registers the built-in models)
from mmvl.build import build_datasets, build_model, freeze_model, model_config
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.losses import build_losses, compute_losses
from mmvl.models.base import BASE_PART
from mmvl.optim import build_optimizer, optimizer_section
from mmvl.registry import MODELS
from tests.fixtures.tiny_models import tiny_opts

#: the models mmvl registers (test fixtures register their own, which ship nothing)
SHIPPED = [name for name in MODELS.names() if MODELS.get(name).__module__.startswith("mmvl.")]
UPDATES = 2
#: what a dataset would fill in (the fast tests build models without generating data)
VOCAB_SIZE, NUM_LABELS = 40, 5
#: every null size a dataset fills in, by key (a generative VLM's token ids too)
DATA_SIZES = {"vocab_size": VOCAB_SIZE, "num_labels": NUM_LABELS, "image_token_id": VOCAB_SIZE - 1,
              "pad_token_id": 0, "eos_token_id": 3, "processor": "the model folder"}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def no_data(tmp_path):
    """``no_data(name, *overrides) -> (config, model_config)``: the tiny config with the dataset's
    sizes set by hand, so a model builds without generating data."""
    def get(name: str, *overrides: str):
        shipped = OmegaConf.load(CONFIGS / "models" / f"{name}.yaml").model_config[name]
        sizes = {k: v for k, v in DATA_SIZES.items() if k in shipped}  # the null keys this model reads
        config = load_config([*tiny_opts(name, tmp_path), f"env.save_dir={tmp_path}", *(f"model_config.{name}.{k}={v}" for k, v in sizes.items()),
                              *overrides])
        return config, model_config(config, {})

    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(name, *overrides) -> (config, builders, losses, batch)``, data generated once."""
    data_dir = tmp_path_factory.mktemp("freeze_data")
    save_dir = tmp_path_factory.mktemp("freeze_save")
    cache: dict[tuple[str, ...], tuple] = {}

    def get(name: str, *overrides: str):
        key = (name, *overrides)
        if key not in cache:
            config = load_config([*tiny_opts(name, data_dir), f"env.save_dir={save_dir}", *overrides])
            builders = build_datasets(config)
            for builder in builders.values():
                builder.prepare()
            (builder,) = builders.values()
            loader = torch.utils.data.DataLoader(builder.build("train"), batch_size=4, shuffle=False,
                                                 collate_fn=builder.collate)
            losses = build_losses(list(model_config(config, builders).get("losses") or []))
            cache[key] = (config, builders, losses, next(iter(loader)))
        return cache[key]

    return get


def _update(model, optimizer, losses, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    sum(compute_losses(losses, batch, model(batch)).values()).backward()
    optimizer.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _fresh(name, mcfg, seed=0):
    torch.manual_seed(seed)
    model = MODELS.get(name)(mcfg)
    model.eval()  # no dropout: the resumed model and the original must take the same update
    return model


@pytest.mark.slow  # generates data and trains every part of every model (~25 s on a shared CPU)
@pytest.mark.parametrize("name", SHIPPED)
def test_every_offered_part_freezes_and_resumes_strictly(name, tiny):
    config, builders, losses, batch = tiny(name)
    mcfg = model_config(config, builders)
    parts = _fresh(name, mcfg).part_parameters()
    assert BASE_PART in parts and len(parts) >= 3, f"{name} offers only {sorted(parts)}"
    for part, frozen_names in parts.items():
        model = _fresh(name, mcfg)
        assert model.freeze([part]) == [part]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = build_optimizer(model, optimizer_section(config))
        for _ in range(UPDATES):
            _update(model, optimizer, losses, batch)
        named = dict(model.named_parameters())
        trained = [n for n in named if n not in set(frozen_names)]
        with_state = {id(p) for p in optimizer.state}
        for n in frozen_names:
            p = named[n]
            assert not p.requires_grad and p.grad is None, f"{name}.{part}: {n} got a gradient"
            assert id(p) not in with_state, f"{name}.{part}: {n} has optimizer state"
            assert torch.equal(p, before[n]), f"{name}.{part}: frozen {n} changed"
        in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert in_groups == {id(named[n]) for n in trained}, f"{name}.{part}: the optimizer holds frozen tensors"
        assert any(not torch.equal(named[n], before[n]) for n in trained), f"{name}.{part}: nothing trained"

        saved = _roundtrip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        resumed = _fresh(name, mcfg, seed=1)
        resumed.freeze([part])
        resumed.load_state_dict(saved["model"], strict=True)
        resumed_opt = build_optimizer(resumed, optimizer_section(config))
        resumed_opt.load_state_dict(saved["optimizer"])
        _update(model, optimizer, losses, batch)
        _update(resumed, resumed_opt, losses, batch)
        for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
            torch.testing.assert_close(b, a, msg=f"{name}.{part}: {n} differs after the resume")


@pytest.mark.parametrize("name", SHIPPED)
def test_an_unknown_part_names_it_and_lists_the_parts(name, no_data):
    model = _fresh(name, no_data(name)[1])
    with pytest.raises(UserError) as err:
        model.freeze(["no_such_part"])
    message = str(err.value)
    assert "no_such_part" in message and f"model_config.{name}.freeze" in message
    assert all(part in message for part in model.part_parameters())
    assert all(p.requires_grad for p in model.parameters())


def test_a_part_this_configuration_did_not_build_is_refused(no_data):
    # region features instead of pixels: visual_bert builds no image encoder
    model = _fresh("visual_bert", no_data("visual_bert", "model_config.visual_bert.feature_dim=8")[1])
    assert "image_encoder" in model.PARTS and "image_encoder" not in model.part_parameters()
    with pytest.raises(UserError, match="part 'image_encoder' has no parameters in this configuration"):
        model.freeze("image_encoder")


def test_the_config_key_freezes_and_the_log_counts_what_trains(no_data, caplog):
    config, _ = no_data("mmbt", "model_config.mmbt.freeze=[text_encoder,image_encoder]")
    with caplog.at_level(logging.INFO, logger="mmvl"):
        model = build_model(config, {})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < total
    assert not any(p.requires_grad for p in model.bert.parameters())
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert f"training {trainable:,} of {total:,} parameters (frozen: text_encoder, image_encoder)" in caplog.text


def test_mmf_freeze_base_trains_only_the_head(no_data):
    """An MMF config's ``freeze_base: true`` freezes everything but the head (it used to be dropped)."""
    config, _ = no_data("visual_bert", "model_config.visual_bert.freeze_base=true")
    assert list(config.model_config.visual_bert.freeze) == [BASE_PART]
    model = build_model(config, {})
    head = {n for n, _ in model.named_parameters() if n.split(".")[0] in model.HEAD}
    assert head and all(p.requires_grad == (n in head) for n, p in model.named_parameters())
    optimizer = build_optimizer(model, optimizer_section(config))
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in head}


def test_a_model_with_every_part_frozen_is_refused_by_the_optimizer(no_data):
    config, mcfg = no_data("relation_network")
    model = _fresh("relation_network", mcfg)
    model.freeze([BASE_PART, "classifier"])
    with pytest.raises(UserError, match="no trainable parameters; freeze fewer parts"):
        build_optimizer(model, optimizer_section(config))


def test_a_freeze_value_that_is_not_a_list_is_one_line(no_data):
    with pytest.raises(UserError, match=r"model_config.mmbt.freeze' in command line must be a list"):
        no_data("mmbt", "model_config.mmbt.freeze=true")  # the loader checks it against the shipped []
    _, mcfg = no_data("mmbt")
    model = _fresh("mmbt", mcfg)
    with pytest.raises(UserError, match=r"model_config.mmbt.freeze=True; give a list of parts"):
        freeze_model(model, "mmbt", True)  # a config built in Python, past the loader
