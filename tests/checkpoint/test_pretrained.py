"""Matching state dicts to models: wrapper prefixes, shape mismatches, pretrained prefix maps."""
import pytest
import torch

from mmvl.checkpoint import load_model_state
from mmvl.errors import UserError

def _state(value: float, update: int = 0) -> dict:
    return {"model": {"w": torch.full((2, 3), value)}, "trainer": {"update": update, "best": None},
            "rng": {"torch": torch.get_rng_state()}, "config": {"a": [1, 2]}}

def test_load_model_state_prefixes_and_mismatches():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    src = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    ddp_style = {f"module.{k}": v for k, v in src.state_dict().items()}
    assert load_model_state(model, {"model": ddp_style}) == ([], [])
    assert torch.equal(model[0].weight, src[0].weight)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    wrapped = Wrapper(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)))
    load_model_state(wrapped, src.state_dict())  # adds the prefix
    assert torch.equal(wrapped.module[1].bias, src[1].bias)

    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).state_dict()
    with pytest.raises(UserError, match=r"another model\? key '0\.weight': checkpoint \(3, 4\) vs model \(5, 4\)"):
        load_model_state(model, other)
    partial = {k: v for k, v in src.state_dict().items() if k.startswith("0.")}
    partial["extra"] = torch.zeros(1)
    with pytest.raises(UserError, match=r"missing \['1\.weight', '1\.bias'\].*unexpected \['extra'\]"):
        load_model_state(model, partial)
    assert load_model_state(model, partial, strict=False) == (["1.weight", "1.bias"], ["extra"])

def test_apply_state_mapping_moves_pretrained_prefix():
    from mmvl.checkpoint import apply_state_mapping

    state = {"module.bert.layer.w": 1, "bert.emb": 2, "classifier.w": 3}
    assert apply_state_mapping(state, {"bert": "model.encoder."}) == {"model.encoder.layer.w": 1,
                                                                      "model.encoder.emb": 2}
    assert apply_state_mapping(state, {"bert.": ""}) == {"layer.w": 1, "emb": 2}
    assert apply_state_mapping(state, {}) == state
