"""Padding-free packing (``training.packing``): the rows it plans, the batch it makes, and that one
update on packed rows computes the padded batch's loss and gradients (``vlm``: conversations of
different lengths, text-only samples, two images in a sample)."""
from __future__ import annotations

import pytest
import torch

import functools

from mmvl.data.packing import pack, placed_images, plan_rows
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from mmvl.losses.tokens import AnswerTokensLoss
from tests.fixtures import tiny_vlm


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_vlm.make_chat_lm(tmp_path_factory.mktemp("packing_lm"))


def test_rows_are_few_balanced_and_keep_every_sample_once():
    lengths = [90, 30, 120, 45, 60, 75, 20, 100, 64, 50]
    rows = plan_rows(lengths, 256)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    filled = [sum(lengths[i] for i in row) for row in rows]
    assert len(rows) == -(-sum(lengths) // 256) and max(filled) <= 256
    assert max(filled) - min(filled) <= max(lengths)
    assert all(row == sorted(row) for row in rows)  # within a row, the sampler's order
    assert plan_rows(lengths, 256) == rows


def test_a_sample_longer_than_a_row_is_one_line():
    with pytest.raises(UserError, match="a sample of 300 tokens is longer than the rows' 256"):
        plan_rows([300, 20], 256)


def _conversations(proc, gen):
    """Samples of 1 to 3 turns: one image, none (a blank), and two images."""
    words = "what is shown color shape red blue green a big small square circle".split()
    out = []
    for i in range(9):
        turns, images = [], 0 if i % 4 == 3 else (2 if i % 4 == 2 else 1)
        for t in range(1 + i % 3):
            ask = " ".join(words[(i + t + k) % len(words)] for k in range(1 + (i + t) % 5))
            if t == 0 and images:
                ask = "<image> " * images + ask
            turns += [{"role": "user", "content": ask},
                      {"role": "assistant", "content": " ".join(words[(i * t + k) % len(words)] for k in range(1 + i % 4))}]
        item = proc.conversation(turns, images)
        size = tiny_vlm.IMAGE_SIZE
        item["image"] = torch.randn(2, 3, size, size, generator=gen) if images == 2 else \
            torch.randn(3, size, size, generator=gen) if images else torch.zeros(3, size, size)
        item["id"] = i
        out.append(item)
    return out


def _images(info):
    return functools.partial(placed_images, image_token_id=info["image_token_id"], image_tokens=info["image_tokens"])


def _padded(proc, items):
    """The padded batch: a sample with one image next to one with two gets its image as 1 x C x H x W."""
    items = [dict(it, image=it["image"].unsqueeze(0)) if it["image"].dim() == 3 else it for it in items]
    return tiny_vlm.collate(proc, items)


def test_the_packed_batch_holds_each_sample_with_positions_restarting(lm):
    proc = tiny_vlm.processor(lm, max_length=128)
    items = _conversations(proc, torch.Generator().manual_seed(0))
    info = proc.model_info()
    batch = pack(items, capacity=96, pad_id=info["pad_token_id"], images=_images(info))
    assert batch["image"].shape[0] == sum(0 if i % 4 == 3 else (2 if i % 4 == 2 else 1) for i in range(9))
    starts = batch["position_ids"].eq(0)
    real = batch["input_ids"].ne(info["pad_token_id"])
    assert int(real.sum()) == sum(int(it["input_ids"].numel()) for it in items)
    assert batch["targets"][starts].eq(IGNORE_INDEX).all()  # a sample's first token: never a label
    labelled = sum(int(it["targets"][1:].ne(IGNORE_INDEX).sum()) for it in items)
    assert int(batch["targets"].ne(IGNORE_INDEX).sum()) == labelled


def _assert_same_update(results, atol, rtol=1e-5):
    """The padded and the packed update's ``(loss, gradients)``: equal within ``rtol`` (1e-5) relative."""
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=rtol, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("attn, device", [("sdpa", "cpu"), ("eager", "cpu"),
                                          pytest.param("sdpa", "cuda", marks=pytest.mark.cuda)])
def test_one_update_on_packed_rows_equals_the_padded_batch(lm, attn, device):
    """On a GPU (fp32, TF32 off) the buckets run CUDA's attention kernels and the padded batch another
    (with a mask): their sums differ in order, so 1e-4 there."""
    from mmvl.data.sample import to_device

    proc = tiny_vlm.processor(lm, max_length=128)
    items = _conversations(proc, torch.Generator().manual_seed(1))
    info = proc.model_info()
    packed = pack(items, capacity=96, pad_id=info["pad_token_id"], images=_images(info))
    padded = _padded(proc, items)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    results = []
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for batch in (padded, packed):
            batch = to_device(batch, torch.device(device))
            model = tiny_vlm.build_model(lm, proc, seed=3, **{"language_model.attn_implementation": attn}).to(device)
            loss_fn = AnswerTokensLoss()
            loss_fn.begin_update([batch])
            loss = loss_fn(batch, model(batch))
            loss.backward()
            results.append((loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()
                                                  if p.grad is not None}))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    _assert_same_update(results, atol=1e-7, rtol=1e-5 if device == "cpu" else 1e-4)


# --- runs: the Trainer packs the training batches (tests/fixtures/easy_vqa_generative_run's toy VLM) ---

PACKED = ["training.packing=true", "training.packing_length=96", "dataset_config.easy_vqa_generative.task=conversation",
          "training.log_interval=1", "run_type=train"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.fixtures.easy_vqa_generative_run import write_root

    return write_root(tmp_path_factory.mktemp("packing_runs") / "easy_vqa")


def _losses(save):
    import json

    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["answer_tokens"] for r in rows if r.get("split") == "train" and "answer_tokens" in r]


def test_a_packed_run_trains_the_padded_run_s_losses(data, tmp_path):
    from mmvl_cli.run import main as run
    from tests.fixtures.easy_vqa_generative_run import opts

    common = ["dataset_config.easy_vqa_generative.task=conversation", "training.log_interval=1", "run_type=train",
              "training.max_updates=4", "training.batch_size=6"]
    assert run(opts(data, tmp_path / "padded", *common)) == 0
    assert run(opts(data, tmp_path / "packed", *common, "training.packing=true", "training.packing_length=96")) == 0
    padded, packed = _losses(tmp_path / "padded"), _losses(tmp_path / "packed")
    assert len(padded) == len(packed) == 4
    assert packed[0] == pytest.approx(padded[0], rel=1e-5)  # the same samples, the same weights: the same loss
    assert packed == pytest.approx(padded, rel=1e-3)  # later updates: float sums in another order


def test_a_packed_run_stopped_mid_epoch_resumes_bitwise(data, tmp_path):
    from mmvl.io import safe_load
    from mmvl_cli.run import main as run
    from tests.fixtures.easy_vqa_generative_run import opts
    from tests.fixtures.toy import register

    register()  # stop_at
    common = [*PACKED, "training.max_updates=6", "training.checkpoint_interval=1", "checkpoint.max_to_keep=2"]
    assert run(opts(data, tmp_path / "full", *common)) == 0
    assert run(opts(data, tmp_path / "part", *common, "training.callbacks=[{type: stop_at, params: {update: 3}}]")) == 0
    assert run(opts(data, tmp_path / "part", *common, "checkpoint.resume=true")) == 0
    full = safe_load(str(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    part = safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt"))
    assert all(torch.equal(full["model"][k], part["model"][k]) for k in full["model"])
    for pid, state in full["optimizer"]["state"].items():
        assert all(torch.equal(v, part["optimizer"]["state"][pid][k]) for k, v in state.items()
                   if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("extra, needle", [
    (["training.group_by_length=true"], "training.packing=true with training.group_by_length=true"),
    (["training.packing_length=20"], "training.packing_length=20 is shorter than dataset easy_vqa_generative's"),
])
def test_packing_refusals_are_one_line(data, tmp_path, capsys, extra, needle):
    from mmvl_cli.run import main as run
    from tests.fixtures.easy_vqa_generative_run import opts

    assert run(opts(data, tmp_path / "save", *PACKED, "training.max_updates=1", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_model_that_takes_no_packed_rows_is_one_line(tmp_path, capsys):
    from mmvl_cli.run import main as run
    from tests.fixtures.toy import register, toy_opts

    register()
    assert run([*toy_opts(tmp_path), "training.packing=true", "training.max_updates=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model toy_mlp takes no packed rows" in err[0], err


# --- hf_vlm: a released VLM's processor and model (tests/fixtures/released_vlms) ---

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.fixtures.released_vlms import folder_maker

    return folder_maker(tmp_path_factory.mktemp("packing_hf"))


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_hf_vlm_one_update_on_packed_rows_equals_the_padded_batch(arch, folders, tmp_path):
    from mmvl.losses import compute_losses
    from tests.models.test_hf_vlm import built

    short = "dataset_config.llava.processors.text_processor.params.max_length=200"  # several rows
    builder, _, losses = built(folders, arch, tmp_path, short)
    train = builder.build("train")
    items = [train[i] for i in range(len(train))][:10]  # two images in one, text-only ones, one to two turns
    padded, packed = builder.collate(items), builder.packer(200)(items)
    assert packed["input_ids"].numel() < padded["input_ids"].numel() and 1 < packed["input_ids"].size(0) < len(items)
    results = []
    for batch in (padded, packed):
        _, model, _ = built(folders, arch, tmp_path, short)  # the same seed: the same weights
        model.train()
        for _, loss_fn in losses:
            loss_fn.begin_update([batch])
        loss = sum(compute_losses(losses, batch, model(batch)).values())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    _assert_same_update(results, atol=1e-6)


@pytest.mark.parametrize("arch, needle", [("qwen2_vl", "multimodal rotary positions"), ("paligemma", "attends both ways")])
def test_hf_vlm_architectures_that_cannot_pack_are_one_line(arch, needle, folders, tmp_path, capsys):
    from mmvl_cli.run import main as run
    from tests.models.test_hf_vlm import opts

    model, data = folders(arch)
    capsys.readouterr()  # what writing the folder printed
    assert run(opts(model, data, tmp_path / "save", "training.packing=true", "training.max_updates=1",
                    "run_type=train")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[-1], err
