"""``model: hf_vlm`` on tiny random folders of real architectures (LLaVA, Idefics3, Qwen2-VL, PaliGemma),
through their own processors and chat templates without ``{% generation %}`` marks, on a LLaVA JSON set
with one-colour images, a two-image sample and a text-only one: the labels are exactly the assistant
turns, no answer token sees a later one, a few updates lower the loss, the model generates, its parts
are found under common names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmvl.build import build_datasets, build_model, model_config
from mmvl.config import load_config
from mmvl.data.processors.vlm_processor import IMAGES, ROWS
from mmvl.labels import IGNORE_INDEX
from mmvl.losses import build_losses, compute_losses
from tests.fixtures.released_vlms import ARCHITECTURES, folder_maker

ARCHS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(arch) -> (model folder, data folder)``, each written once."""
    return folder_maker(tmp_path_factory.mktemp("hf_vlm"))


def opts(model: Path, data: Path, save: Path, *extra: str) -> list[str]:
    """A run of the shipped hf_vlm project config on the tiny set."""
    return ["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model}", "datasets=llava",
            f"dataset_config.llava.annotations.train={data}/train.json",
            f"dataset_config.llava.annotations.val={data}/val.json",
            f"dataset_config.llava.annotations.test={data}/val.json", f"dataset_config.llava.image_folder={data}/images",
            f"env.data_dir={data}", f"env.save_dir={save}", "model_config.hf_vlm.freeze=[]", *extra]


def built(folders, arch: str, tmp_path: Path, *extra: str):
    model_dir, data = folders(arch)
    config = load_config(opts(model_dir, data, tmp_path / "save", *extra))
    builders = build_datasets(config)
    for builder in builders.values():
        builder.prepare()
    (builder,) = builders.values()
    torch.manual_seed(0)
    model = build_model(config, builders)
    losses = build_losses(list(model_config(config, builders).get("losses")))
    return builder, model, losses


def tokens(builder, ids) -> list[str]:
    return builder.text_processor.tok.convert_ids_to_tokens([int(i) for i in ids])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_labels_are_each_assistant_turn_and_its_end_nothing_else(arch, folders, tmp_path):
    builder, _, _ = built(folders, arch, tmp_path)
    processor = builder.text_processor
    end = tokens(builder, [processor.end_id])[0]
    train, val = builder.build("train"), builder.build("val")
    four = train[1]  # two exchanges: both answers labelled in training
    labelled = [tokens(builder, [t])[0] for t in four["targets"].tolist() if t != IGNORE_INDEX]
    assert labelled == ["red", end, "a", "big", "square", end] or labelled == ["blue", end, "a", "big", "square", end]
    assert four["targets"].ne(IGNORE_INDEX).sum() == 6
    image_positions = four["input_ids"].eq(processor.model_token_id)
    assert image_positions.sum() > 1 and four["targets"][image_positions].eq(IGNORE_INDEX).all()
    last = [tokens(builder, [t])[0] for t in val[1]["targets"].tolist() if t != IGNORE_INDEX]
    assert last == ["a", "big", "square", end]  # evaluation labels (and scores) the last turn only


@pytest.mark.parametrize("arch", ARCHS)
def test_no_answer_token_sees_a_later_one(arch, folders, tmp_path):
    """Changing the last answer token leaves the logits at every earlier position as they were (a prefix
    LM such as PaliGemma needs token_type_ids 1 on the answer for that)."""
    builder, model, _ = built(folders, arch, tmp_path)
    model.eval()
    batch = builder.collate([builder.build("train")[1]])
    answer = batch["targets"][0].ne(IGNORE_INDEX).nonzero().flatten()
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    at = int(answer[-2])  # the last answer word, before the end-of-turn token
    changed["input_ids"][0, at] = builder.text_processor.tok.convert_tokens_to_ids("circle")
    with torch.no_grad():
        before, after = model(batch)["scores"], model(changed)["scores"]
    assert torch.equal(before[0, :at], after[0, :at])
    assert not torch.equal(before[0, at], after[0, at])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_with_two_images_a_sample_and_a_text_only_one_trains_and_generates(arch, folders, tmp_path):
    builder, model, losses = built(folders, arch, tmp_path)
    train = builder.build("train")
    two = next(i for i in range(len(train)) if train.records.column("image")[i].count("\n") == 1)
    text_only = next(i for i in range(len(train)) if not train.records.column("image")[i])
    batch = builder.collate([train[0], train[two], train[text_only], train[1]])
    images = batch[IMAGES]
    if ROWS in images and images[ROWS]:  # per-image keys: the two-image sample holds twice the first's rows
        rows = next(iter(images[ROWS].values()))
        assert rows[1] == 2 * rows[0] and rows[2] == 0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    first = None
    for _ in range(12):
        optimizer.zero_grad()
        loss = sum(compute_losses(losses, batch, model(batch)).values())
        loss.backward()
        optimizer.step()
        first = float(loss) if first is None else first
    assert float(loss) < 0.6 * first
    model.eval()
    new = model.generate(batch, max_new_tokens=5)
    assert new.shape == (4, 5) and new.dtype == torch.long
    texts = builder.generated_text(new)
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_parts_have_common_names_and_a_connector_is_not_vision(arch, folders, tmp_path):
    _, model, _ = built(folders, arch, tmp_path)
    parts = model.part_parameters()
    assert {"vision", "connector", "language_model", "base"} <= set(parts)
    assert not set(parts["vision"]) & set(parts["connector"])
    model.freeze(["vision", "language_model"])  # LLaVA's stage 1: only the connector trains
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable <= set(parts["connector"])  # the output head is the language model's


@pytest.mark.parametrize("arch", ARCHS)
def test_the_length_checked_at_start_is_the_sample_s_own(arch, folders, tmp_path):
    """What the start-of-run check counts from the text and each image's size alone (no pixels) is
    what the processor makes of the sample: tiles and dynamic resolution included."""
    import json

    builder, _, _ = built(folders, arch, tmp_path)
    processor, train = builder.text_processor, builder.build("train")
    folder = Path(str(builder.image_folder))
    from PIL import Image

    for i in range(len(train)):
        paths = [p for p in train.records.column("image")[i].split("\n") if p]
        sizes = [Image.open(folder / p).size for p in paths]
        turns = json.loads(train.records.column("turns")[i])
        total, image_end = processor.planned_length(turns, sizes, "all")
        ids = train[i]["input_ids"]
        assert total == len(ids)
        if paths:  # the end of the last image's expansion (wrapper tokens after its image tokens included)
            assert int(ids.eq(processor.model_token_id).nonzero().max()) + 1 <= image_end <= total


def test_a_dataset_without_the_model_s_processor_is_refused(folders, tmp_path, capsys):
    from mmvl_cli.run import main

    model_dir, data = folders("llava")
    code = main(["model=hf_vlm", "datasets=llava", f"model_config.hf_vlm.path={model_dir}",
                 f"dataset_config.llava.annotations.train={data}/train.json",
                 f"dataset_config.llava.annotations.val={data}/val.json", f"dataset_config.llava.image_folder={data}/images",
                 "dataset_config.llava.processors.text_processor.params.image_tokens=16", f"env.save_dir={tmp_path}",
                 "training.num_workers=0"])
    assert code == 2
    assert "model hf_vlm reads samples made by its folder's processor" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_a_batch_cut_to_its_first_samples_cuts_their_images_and_generates_the_same(arch, folders, tmp_path):
    """Evaluation decodes only the first rows of a batch (generate_max_samples): the image tensors are
    cut with them, and those rows generate what they generate alone."""
    from mmvl.trainers.evaluation.rows import first_rows

    builder, model, _ = built(folders, arch, tmp_path)
    model.eval()
    train = builder.build("train")
    two = next(i for i in range(len(train)) if train.records.column("image")[i].count("\n") == 1)
    batch = builder.collate([train[two], train[0], train[1]])
    cut = first_rows(batch, 2, 3)
    alone = builder.collate([train[two], train[0]])
    for key, value in alone[IMAGES].items():
        if key != ROWS:
            assert torch.equal(cut[IMAGES][key], value), key
    assert torch.equal(model.generate(cut, max_new_tokens=3), model.generate(alone, max_new_tokens=3))


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_the_project_config_trains_on_the_cauldron_s_layout_scores_val_and_predicts(arch, folders, tmp_path):
    """datasets=hf_dataset (images list, texts of user/assistant pairs, two images in some rows, text-only
    rows) with only the model folder and the data given."""
    import json

    from mmvl_cli.predict import main as predict
    from mmvl_cli.run import main as run
    from tests.fixtures.hf_files import write_cauldron

    model_dir, _ = folders(arch)
    disk = write_cauldron(tmp_path / "hf", train=16, test=6, several=True)["disk"]
    common = ["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model_dir}",
              "datasets=hf_dataset", f"dataset_config.hf_dataset.path={disk}", "dataset_config.hf_dataset.splits.val=test",
              f"env.save_dir={tmp_path / 'save'}", "training.num_workers=0", "training.batch_size=4"]
    assert run([*common, "training.max_updates=4", "training.evaluation_interval=4", "run_type=train_val"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r.get("split") == "val"]
    assert val and "generated_vqa_accuracy" in val[-1] and "answer_tokens" in val[-1]
    assert predict(common) == 0
    rows = json.loads((tmp_path / "save" / "predictions" / "hf_dataset_test.json").read_text())
    assert len(rows) == 6 and all(set(r) == {"id", "answer", "reference"} for r in rows)


@pytest.mark.parametrize("arch", ["llava", "idefics3", "qwen2_vl"])
def test_the_project_config_trains_on_llava_json_scores_val_and_predicts(arch, folders, tmp_path):
    """The issue's command: only the model folder and the data paths given (LLaVA JSON with a two-image
    and a text-only sample), a generation metric on val, then mmvl_predict."""
    import json

    from mmvl_cli.predict import main as predict
    from mmvl_cli.run import main as run

    model_dir, data = folders(arch)
    common = [o for o in opts(model_dir, data, tmp_path / "save") if o != "model_config.hf_vlm.freeze=[]"]
    common.append("training.num_workers=0")
    assert run([*common, "training.max_updates=6", "training.evaluation_interval=6", "run_type=train_val"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "val" and "generated_vqa_accuracy" in r for r in rows)
    assert predict(common) == 0
    written = json.loads((tmp_path / "save" / "predictions" / "llava_test.json").read_text())
    assert [r["id"] for r in written] == [f"val{i}" for i in range(6)]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_run_stopped_mid_epoch_resumes_bitwise(arch, folders, tmp_path):
    """6 updates of 4 samples over 25 (a two-image and a text-only sample among them); stopped at 3 and
    resumed, the weights and the optimizer state end where the uninterrupted run's end."""
    from mmvl.io import safe_load
    from mmvl.trainers import Trainer
    from tests.fixtures.toy import register

    register()
    model_dir, data = folders(arch)
    common = ["run_type=train", "training.batch_size=4", "training.max_updates=6", "training.checkpoint_interval=3",
              "training.evaluation_interval=0", "training.num_workers=0", "training.progress_bar=false",
              "training.tensorboard=false", "training.curves=false", "optimizer.params.lr=1e-3"]
    Trainer(load_config(opts(model_dir, data, tmp_path / "full", *common))).fit()
    stop = "training.callbacks=[{type: stop_at, params: {update: 3}}]"
    Trainer(load_config(opts(model_dir, data, tmp_path / "part", *common, stop))).fit()
    Trainer(load_config(opts(model_dir, data, tmp_path / "part", *common, "checkpoint.resume=true"))).fit()
    full = safe_load(str(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    resumed = safe_load(str(tmp_path / "part" / "checkpoints" / "last.ckpt"))
    first = safe_load(str(tmp_path / "part" / "checkpoints" / "model_3.ckpt"))
    assert resumed["trainer"]["update"] == 6
    assert any(not torch.equal(first["model"][k], v) for k, v in full["model"].items())  # updates 4-6 moved it
    for key, value in full["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    for pid, state in full["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][pid][key], value), (pid, key)


def test_a_cauldron_row_whose_image_tokens_would_be_cut_is_refused_before_the_first_update(folders, tmp_path, capsys):
    from mmvl_cli.run import main as run
    from tests.fixtures.hf_files import write_cauldron

    model_dir, _ = folders("llava")
    disk = write_cauldron(tmp_path / "hf", train=8, test=4, several=True)["disk"]
    code = run(["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model_dir}",
                "datasets=hf_dataset", f"dataset_config.hf_dataset.path={disk}", "dataset_config.hf_dataset.splits.val=test",
                "dataset_config.hf_dataset.processors.text_processor.params.max_length=30",
                f"env.save_dir={tmp_path / 'save'}", "training.num_workers=0", "training.max_updates=2"])
    err = capsys.readouterr().err
    assert code == 2  # row 6 shows two images: 2 + 2 x 16 tokens; the one-image rows end at token 18
    assert "hf_dataset train row 6: its image tokens end at token 34, after max_length=30" in err
    assert not (tmp_path / "save" / "metrics.jsonl").exists()


@pytest.mark.parametrize("task", ["vqa", "conversation"])
def test_easy_vqa_generative_makes_its_samples_through_the_model_s_processor(task, folders, tmp_path):
    """easy-VQA's questions (one a sample, or one image's as the turns of a conversation) through the
    folder's processor: its pixels, the answers labelled, a forward and a generation of the model."""
    from tests.data.datasets.test_easy_vqa_generative import write_root

    model_dir, _ = folders("qwen2_vl")
    root = write_root(tmp_path / "easy_vqa")
    d = "dataset_config.easy_vqa_generative"
    config = load_config(["model=hf_vlm", "datasets=easy_vqa_generative", f"model_config.hf_vlm.path={model_dir}",
                          f"{d}.data_root={root}", f"{d}.val_images=1", f"{d}.task={task}",
                          f"{d}.processors.text_processor.type=hf_processor",
                          f"{d}.processors.text_processor.params.path={model_dir}", f"env.save_dir={tmp_path}"])
    builders = build_datasets(config)
    (b,) = builders.values()
    b.prepare()
    train = b.build("train")
    item = train[0]
    assert IMAGES in item and "image" not in item and "image_grid_thw" in item[IMAGES]
    labelled = item["targets"].ne(IGNORE_INDEX)
    last_image = int(item["input_ids"].eq(b.text_processor.model_token_id).nonzero().max())
    assert labelled.any() and not labelled[:last_image].any()
    model = build_model(config, builders).eval()
    batch = b.collate([train[i] for i in range(min(3, len(train)))])
    assert model(batch)["scores"].shape[:2] == batch["input_ids"].shape
    assert model.generate(batch, max_new_tokens=2).shape == (batch["input_ids"].size(0), 2)


def test_an_architecture_whose_parts_are_not_found_is_refused_listing_its_modules():
    from mmvl.errors import UserError
    from mmvl.models.hf_vlm import find_parts

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.ModuleDict({"eyes": torch.nn.Linear(2, 2), "language_model": torch.nn.Linear(2, 2)})

    with pytest.raises(UserError, match=r"Odd has no vision module .* its modules are model, model\.eyes, "
                                        r"model\.language_model"):
        find_parts(Odd())


def test_the_issue_s_command_on_the_llava_conversation_files(folders, tmp_path):
    """The LLaVA JSON of the conversation-data work (its placeholders before or after the question,
    text-only records) with a LLaVA folder someone else wrote: 30 updates, val scored by generation."""
    import json

    from mmvl_cli.predict import main as predict
    from mmvl_cli.run import main as run
    from tests.fixtures.llava_files import write_llava

    model_dir, _ = folders("llava")
    files = write_llava(tmp_path / "llava", train=24, val=6)
    common = ["config=projects/hf_vlm/configs/defaults.yaml", f"model_config.hf_vlm.path={model_dir}", "datasets=llava",
              f"dataset_config.llava.annotations.train={files['train']}", f"dataset_config.llava.annotations.val={files['val']}",
              f"dataset_config.llava.annotations.test={files['val']}", f"dataset_config.llava.image_folder={files['images']}",
              f"env.save_dir={tmp_path / 'save'}", "training.num_workers=0"]
    assert run([*common, "training.max_updates=30", "training.evaluation_interval=30", "run_type=train_val"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "val" and r.get("update") == 30 and "generated_vqa_accuracy" in r for r in rows)
    assert predict(common) == 0
    assert len(json.loads((tmp_path / "save" / "predictions" / "llava_test.json").read_text())) == 6


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_a_batch_without_images_runs_the_vision_tower_only_where_every_part_must_run(arch, folders, tmp_path):
    """Under FSDP every forward gathers each vision layer on every rank: a rank whose batch has no image
    encodes the blank image the batch carries (placed nowhere: zero gradient, the same logits); in one
    process or under DDP the tower does not run for it."""
    from mmvl.data.processors.vlm_processor import UNPLACED

    builder, model, losses = built(folders, arch, tmp_path)
    train = builder.build("train")
    text_only = next(i for i in range(len(train)) if not train.records.column("image")[i])
    batch = builder.collate([train[text_only]])
    assert batch[IMAGES][UNPLACED]
    vision = [p for n, p in model.named_parameters() if n in set(model.part_parameters()["vision"])]
    plain = model(batch)["scores"]
    sum(compute_losses(losses, batch, {"scores": plain}).values()).backward()
    assert all(p.grad is None for p in vision)
    model.zero_grad(set_to_none=True)
    model.every_part_each_forward = True
    sharded = model(batch)["scores"]
    sum(compute_losses(losses, batch, {"scores": sharded}).values()).backward()
    assert torch.equal(sharded, plain)
    assert any(p.grad is not None for p in vision) and all(p.grad is None or not p.grad.any() for p in vision)
