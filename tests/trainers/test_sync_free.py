"""Between two log intervals a training update never waits for the device: counted on the CPU
(tests/fixtures/syncs.py) for the demo model and a pretraining model, and on a GPU under
``torch.cuda.set_sync_debug_mode("error")``. Nor, after the first, does it copy a host value to
the device (``torch.tensor(...)``, ``.to(device)`` of anything but the batch: tests/fixtures/copies.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer
from mmvl.trainers.callbacks import Callback
from tests.e2e.test_sort_of_clevr_run import tiny_opts as demo_opts
from tests.fixtures.copies import CopyCounter
from tests.fixtures.syncs import SyncCounter

ROOT = Path(__file__).resolve().parents[2]
LOG_INTERVAL, UPDATES = 4, 9


def _per_update_syncs(trainer: Trainer) -> tuple[dict[int, list], dict[int, list]]:
    """Run ``trainer.fit()`` counting, per update, the syncs and the host-to-device copies from
    on_update_start to on_update_end."""
    seen: dict[int, list] = {}
    copied: dict[int, list] = {}
    counter, copies = SyncCounter(), CopyCounter()

    class Start(Callback):
        def on_update_start(self):
            counter.calls.clear()
            copies.calls.clear()

    class End(Callback):
        def on_update_end(self, info):
            seen[trainer.update] = list(counter.calls)
            copied[trainer.update] = list(copies.calls)

    trainer.callbacks.insert(0, Start(trainer))
    trainer.callbacks.append(End(trainer))
    with counter, copies:
        trainer.fit()
    return seen, copied


def _check(counted: tuple[dict[int, list], dict[int, list]]) -> None:
    seen, copied = counted
    quiet = {u: calls for u, calls in seen.items() if u % LOG_INTERVAL and u != UPDATES}
    assert len(quiet) == UPDATES - UPDATES // LOG_INTERVAL - 1
    assert all(not calls for calls in quiet.values()), {u: c for u, c in quiet.items() if c}
    assert seen[LOG_INTERVAL], "the counter sees the reads of a log interval"
    after_first = {u: copied[u] for u in quiet if u > 1}
    assert all(not calls for calls in after_first.values()), {u: c for u, c in after_first.items() if c}
    assert copied[LOG_INTERVAL], "the copy counter sees the log interval's reduction"


COMMON = ["run_type=train", f"training.max_updates={UPDATES}", f"training.log_interval={LOG_INTERVAL}",
          "training.checkpoint_interval=0", "training.evaluation_interval=0"]


def test_demo_model_updates_do_not_sync(tmp_path):
    """The Sort-of-CLEVR demo: visual_bert with film_cnn and the pooled_and_visual head, its loss and,
    next to it, a cross entropy with class weights (placed on the device once, in the first update)."""
    weighted = "{type: cross_entropy, params: {weight: [1, 2, 1, 1, 0.5, 1, 1, 1, 1, 3]}}"
    trainer = Trainer(load_config(demo_opts(tmp_path) + COMMON + [
        "training.clip_grad_norm=1.0", f"model_config.visual_bert.losses=[cross_entropy, {weighted}]"]))
    assert [name for name, _ in trainer.losses] == ["cross_entropy", "cross_entropy_1"]
    assert trainer.losses[1][1].weight is not None
    _check(_per_update_syncs(trainer))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pretraining_model_updates_do_not_sync(tmp_path, precision):
    """visual_bert's pretraining heads (masked LM + image-text matching) on tiny COCO captions."""
    from mmvl.data.processors.text import write_word_vocab
    from tests.fixtures.vl_data import write_coco_captions

    write_coco_captions(tmp_path)
    captions = [a["caption"] for split in ("train2014", "val2014") for a in json.loads(
        (tmp_path / "coco" / "annotations" / f"captions_{split}.json").read_text())["annotations"]]
    vocab = write_word_vocab(captions, tmp_path / "vocab.txt")
    opts = [f"config={ROOT / 'projects/visual_bert/configs/coco_captions/pretrain.yaml'}",
            f"env.data_dir={tmp_path}", f"env.save_dir={tmp_path}/save", "training.batch_size=4",
            "training.num_workers=0", "training.progress_bar=false", f"training.precision={precision}",
            "scheduler.params.num_warmup_steps=1", "model_config.visual_bert.text_encoder.pretrained_path=null",
            "dataset_config.coco_captions.image_size=32",
            f"dataset_config.coco_captions.processors.text_processor.params.tokenizer_path={vocab}",
            "model_config.visual_bert.hidden_size=32", "model_config.visual_bert.num_hidden_layers=2",
            "model_config.visual_bert.num_attention_heads=2", "model_config.visual_bert.intermediate_size=64",
            "model_config.visual_bert.max_position_embeddings=64",
            "model_config.visual_bert.image_encoder={type: cnn, params: {channels: [8, 16], strides: [4, 4]}}"]
    trainer = Trainer(load_config(opts + COMMON))
    _check(_per_update_syncs(trainer))


def test_counter_sees_reads_and_value_sized_ops():
    x = torch.tensor([1.0, -2.0, 3.0])
    with SyncCounter() as counter:
        float(x.sum())
        if x.max() > 0:
            pass
        _ = x[x > 0]
        torch.nonzero(x)
        f"{x.mean():.2f}"
        y = x * 2  # queued work only
        torch.where(y > 0, y, 0.0)
        source = torch.ones(3, requires_grad=True)
        torch.zeros(3).masked_scatter(x > 0, source).sum().backward()  # the source's gradient: selected by the mask
    kinds = [what for what, _ in counter.calls]
    assert kinds == ["Tensor.__float__", "Tensor.__bool__", "aten.index", "aten.nonzero", "Tensor.__format__",
                     "aten.masked_scatter_backward"], kinds


def test_copy_counter_sees_host_values_and_device_moves_not_casts():
    x = torch.ones(3)
    with CopyCounter() as copies:
        torch.tensor([1.0, 2.0])
        torch.as_tensor(3.0)
        x.to("cpu")
        x.to(device=torch.device("cpu"), dtype=torch.float64)
        x.to(x)
        x.to(torch.float16)  # a cast stays on the tensor's device
        x.float() * 2
        torch.nn.utils.clip_grad_norm_([], 1.0)  # torch.tensor(0.0) inside torch: its own business
    assert [what for what, _ in copies.calls] == ["torch.tensor", "torch.as_tensor"] + ["Tensor.to"] * 3, copies.calls
    assert all(where.startswith(__file__) for _, where in copies.calls)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_updates_do_not_sync(tmp_path, precision):
    """On a GPU any synchronising call raises between the start and the end of a quiet update
    (not the first, which counts FLOPs and creates optimizer state, and not a log update)."""
    opts = demo_opts(tmp_path) + COMMON + ["training.device=cuda", f"training.precision={precision}",
                                           "training.clip_grad_norm=1.0"]
    trainer = Trainer(load_config(opts))
    checked: list[int] = []

    def quiet(update: int) -> bool:
        return update > 1 and update % LOG_INTERVAL != 0 and update < UPDATES

    class StrictFrom(Callback):  # first callback: the update starts
        def on_update_start(self):
            if quiet(trainer.update + 1):
                torch.cuda.set_sync_debug_mode("error")

    class StrictUntil(Callback):  # last callback: the update ends
        def on_update_end(self, info):
            if torch.cuda.get_sync_debug_mode() == 2:
                checked.append(trainer.update)
            torch.cuda.set_sync_debug_mode("default")

    trainer.callbacks.insert(0, StrictFrom(trainer))
    trainer.callbacks.append(StrictUntil(trainer))
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert checked == [u for u in range(1, UPDATES + 1) if quiet(u)]


@pytest.mark.parametrize("packing_length", [96, None])
def test_packed_vlm_updates_do_not_sync(tmp_path, packing_length):
    """``training.packing``: the vlm on packed conversation rows (images spliced in placeholder order,
    attention in buckets from the packer's indices), in rows of 96 tokens and in one row. (Syncs
    only: its ``.to(device)`` calls, transformers' rotary table and the token loss's, move tensors
    already on the device, which a CPU counter cannot tell from copies.)"""
    from tests.fixtures.easy_vqa_generative_run import opts, write_root

    data = write_root(tmp_path / "easy_vqa")
    trainer = Trainer(load_config(opts(data, tmp_path / "save", *COMMON, "training.packing=true",
                                       f"training.packing_length={packing_length or 'null'}",
                                       "dataset_config.easy_vqa_generative.task=conversation")))
    seen, _ = _per_update_syncs(trainer)
    quiet = {u: calls for u, calls in seen.items() if u % LOG_INTERVAL and u != UPDATES}
    assert len(quiet) == UPDATES - UPDATES // LOG_INTERVAL - 1
    assert all(not calls for calls in quiet.values()), {u: c for u, c in quiet.items() if c}
