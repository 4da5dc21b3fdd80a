"""LoRA on released VLMs (``model_config.hf_vlm.lora``): adapters on the parts by their common names,
a connector inside the vision tower (Qwen2-VL's merger) left to itself, and ``mmvl_export adapters``
writing one peft folder that ``PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(M),
OUT)`` loads and that generates the tokens mmvl's model generates, merged or not."""
from __future__ import annotations

import pytest
import torch

from mmvl.adapters import is_adapter
from mmvl.config import load_config
from tests.fixtures.released_vlms import folder_maker
from tests.models.test_hf_vlm import built, opts

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(arch) -> (model folder, data folder)``, each written once."""
    return folder_maker(tmp_path_factory.mktemp("hf_vlm_lora"))


LORA = ["model_config.hf_vlm.lora.r=4", "model_config.hf_vlm.lora.alpha=8"]


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3", "paligemma"])
def test_adapters_go_on_the_language_model_and_its_own_weights_stop_training(arch, folders, tmp_path):
    _, model, _ = built(folders, arch, tmp_path, *LORA)
    parts = model.part_parameters()
    language = set(parts["language_model"])
    adapters = {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert adapters and adapters <= language
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable & language == adapters  # the language model's own weights are frozen, its adapters train
    assert set(parts["vision"]) <= trainable and set(parts["connector"]) <= trainable  # freeze: [] leaves them


def test_a_connector_inside_the_vision_tower_gets_no_adapters_and_keeps_training(folders, tmp_path):
    """Qwen2-VL's merger sits inside model.visual: LoRA on vision adapts the tower's blocks, not the merger,
    whose own weights still train."""
    _, model, _ = built(folders, "qwen2_vl", tmp_path, *LORA, "model_config.hf_vlm.lora.parts=[vision]")
    parts = model.part_parameters()
    named = dict(model.named_parameters())
    assert not any(is_adapter(n) for n in parts["connector"])
    assert all(named[n].requires_grad for n in parts["connector"])
    vision = [n for n in parts["vision"] if is_adapter(n)]
    assert vision and all(not named[n].requires_grad for n in parts["vision"] if not is_adapter(n))


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_exported_adapters_load_in_peft_and_generate_the_same_tokens_merged_or_not(arch, folders, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmvl.trainers import Trainer
    from mmvl_cli.export import main as export

    model_dir, data = folders(arch)
    keys = opts(model_dir, data, tmp_path / "save", *LORA, "model_config.hf_vlm.lora.parts=[language_model,vision]",
                "run_type=train", "training.max_updates=8", "training.batch_size=4", "training.num_workers=0",
                "training.checkpoint_interval=8", "training.evaluation_interval=0", "optimizer.params.lr=3e-2",
                "training.progress_bar=false", "training.tensorboard=false", "training.curves=false")
    trainer = Trainer(load_config(keys))
    trainer.fit()
    mine = trainer.engine.unwrap_model(trainer.model).eval()
    assert export(["adapters", str(tmp_path / "save"), str(tmp_path / "adapters")]) == 0
    builder = next(iter(trainer.builders.values()))
    train = builder.build("train")
    batch = builder.collate([train[i] for i in range(4)])
    ours = mine.generate(batch, max_new_tokens=4)

    base = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
    inner, mine.model = mine.model, peft_model
    try:
        assert torch.equal(mine.generate(batch, max_new_tokens=4), ours)
        mine.model = peft_model.merge_and_unload()
        assert torch.equal(mine.generate(batch, max_new_tokens=4), ours)
        mine.model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        scores = mine(batch)["scores"]
    finally:
        mine.model = inner
    assert not torch.allclose(scores, mine(batch)["scores"], atol=1e-4)  # the trained adapters change the outputs
