"""Generation inside evaluation: a generative model's split is decoded and scored by the registered
generation metrics (``cider``, ``bleu4``, ``rouge_l``, ``generated_vqa_accuracy``), capped at
``evaluation.generate_max_samples`` in dataset order, the best checkpoint kept by them, and the same
scores at 2 gloo ranks as in one process."""
from __future__ import annotations

import json

import pytest
import torch

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.io import safe_load
from mmvl.metrics import build_metrics
from mmvl.metrics.generation import caption_scores, vqa_accuracy
from mmvl.registry import METRICS
from mmvl.trainers import Trainer
from mmvl.trainers.evaluation import check_metrics
from mmvl_cli.run import main
from tests.fixtures.easy_vqa_generative_run import opts, write_root

GENERATION = ("cider", "bleu4", "rouge_l", "generated_vqa_accuracy")
NAME = "easy_vqa_generative"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_root(tmp_path_factory.mktemp("gen_eval") / "easy_vqa")


def test_mmvl_run_lists_the_generation_metrics(capsys):
    assert main(["--list", "metric"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in GENERATION)
    assert all(METRICS.get(name).generates for name in GENERATION)


def _decode_directly(trainer: Trainer, n: int) -> tuple[dict, dict]:
    """The first ``n`` val samples decoded by the model's own ``generate``, outside the evaluation."""
    builder = trainer.builders[NAME]
    dataset = builder.build("val")
    batch = builder.collate([dataset[i] for i in range(n)])
    model = trainer.engine.unwrap_model(trainer.model).eval()
    texts = builder.generated_text(model.generate(batch))
    return dict(enumerate(texts)), {i: [a] for i, a in enumerate(batch["answer"])}


def _expected(trainer, n: int) -> dict[str, float]:
    candidates, references = _decode_directly(trainer, n)
    return {"generated_vqa_accuracy": vqa_accuracy(candidates, references), **caption_scores(candidates, references)}


def test_evaluation_during_training_scores_the_first_n_decoded_samples_and_after_it_all(data, tmp_path):
    cap = 5
    config = load_config(opts(data, tmp_path / "save", f"evaluation.metrics=[{', '.join(GENERATION)}]",
                              f"evaluation.generate_max_samples={cap}", "training.max_updates=3"))
    trainer = Trainer(config)
    trainer.fit()  # its last update evaluates val: the periodic evaluation, capped
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    during, = [r for r in rows if r.get("split") == "val"]
    assert {k: during[k] for k in GENERATION} == pytest.approx(_expected(trainer, cap))
    assert "answer_tokens" in during and len(trainer.builders[NAME].build("val")) == 12 > cap  # the loss: all
    log = (tmp_path / "save" / "train.log").read_text()
    assert f"scored the first {cap} of 12 samples (evaluation.generate_max_samples, during training)" in log
    after = trainer.evaluate("val")[NAME]  # after training (run_type val, test): the whole split
    assert {k: after[k] for k in GENERATION} == pytest.approx(_expected(trainer, 12))
    assert (tmp_path / "save" / "train.log").read_text().count("scored the first") == 1  # no cap after training


def test_best_checkpoint_is_the_best_generated_score(data, tmp_path):
    """8 updates evaluated after each: best.ckpt holds the first update of the highest val score."""
    save = tmp_path / "save"
    criteria = f"{NAME}/generated_vqa_accuracy"
    assert main(opts(data, save, "training.max_updates=8", "training.evaluation_interval=1",
                     "training.checkpoint_interval=1", "checkpoint.max_to_keep=10", "optimizer.params.lr=2e-3",
                     f"training.early_stop.criteria={criteria}")) == 0
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    val = [(r["update"], r["generated_vqa_accuracy"]) for r in rows if r.get("split") == "val"]
    scores = [s for _, s in val]
    assert len(set(scores)) > 1, val  # the choice is a real one
    best_update = next(u for u, s in val if s == max(scores))
    best = safe_load(str(save / "checkpoints" / "best.ckpt"))
    assert best["trainer"]["update"] == best_update and best["trainer"]["best_value"] == max(scores)
    same = safe_load(str(save / "checkpoints" / f"model_{best_update}.ckpt"))
    assert all(torch.equal(v, same["model"][k]) for k, v in best["model"].items())


def _evaluate_at(env, data: str, root: str, ckpt: str, cap: int) -> dict:
    """Every rank: the checkpoint's val scores under DDP."""
    from pathlib import Path

    torch.set_num_threads(1)
    config = load_config(opts(Path(data), Path(root) / "save", "run_type=val", f"checkpoint.resume_file={ckpt}",
                              f"evaluation.metrics=[{', '.join(GENERATION)}]", f"evaluation.generate_max_samples={cap}",
                              "distributed.strategy=ddp", "checkpoint.resume_pretrained=true"))
    trainer = Trainer(config, env=env)
    return trainer.evaluate("val", during_training=True)[NAME]  # as during training: the cap applies


@pytest.mark.proc  # 2 spawned gloo ranks
@pytest.mark.parametrize("cap", [7, None])
def test_two_ranks_score_what_one_process_scores(data, tmp_path, cap):
    from tests.distributed.dist_launch import launch

    train = opts(data, tmp_path / "train", "training.max_updates=4", "optimizer.params.lr=2e-3", "run_type=train")
    assert main(train) == 0
    ckpt = str(tmp_path / "train" / "checkpoints" / "last.ckpt")
    cap_opt = "null" if cap is None else cap
    one = Trainer(load_config(opts(data, tmp_path / "one", "run_type=val", f"checkpoint.resume_file={ckpt}",
                                   f"evaluation.metrics=[{', '.join(GENERATION)}]", "checkpoint.resume_pretrained=true",
                                   f"evaluation.generate_max_samples={cap_opt}")))
    one = one.evaluate("val", during_training=True)[NAME]
    ranks = launch(_evaluate_at, world_size=2, args=(str(data), str(tmp_path / "two"), ckpt, cap_opt), timeout=300)
    for rank in ranks:
        assert {k: rank[k] for k in GENERATION} == {k: one[k] for k in GENERATION}


class _Builder:
    """A dataset builder without text targets (no ``generated_text``)."""


def test_generation_metrics_need_a_generating_model_a_text_dataset_and_no_fsdp():
    metrics = {"d": build_metrics(["cider"])}
    config = load_config(["model=vlm", "datasets=easy_vqa_generative"])
    names = (config.model, config.training.early_stop.criteria)  # the model's name, the early-stop criterion

    class Generates(torch.nn.Module):
        def generate(self, batch):
            return batch

    with pytest.raises(UserError, match="model 'vlm' does not generate"):
        check_metrics(*names, torch.nn.Linear(1, 1), {"d": _Builder()}, metrics, [])
    with pytest.raises(UserError, match="dataset 'd' has no text targets"):
        check_metrics(*names, Generates(), {"d": _Builder()}, metrics, [])
    text = type("TextBuilder", (), {"generated_text": lambda self, ids: []})()
    check_metrics(*names, Generates(), {"d": text}, metrics, [])  # under fsdp too: the ranks decode in lockstep


def test_a_train_val_run_ends_with_the_whole_split_scored(data, tmp_path):
    """The last update's periodic val is capped; run_type's val stage scores all 12 again, last."""
    save = tmp_path / "save"
    assert main(opts(data, save, f"evaluation.metrics=[{', '.join(GENERATION)}]", "evaluation.generate_max_samples=5",
                     "training.max_updates=2", "run_type=train_val")) == 0
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r.get("split") == "val"]
    assert [r["update"] for r in val] == [2, 2]
    log = (save / "train.log").read_text()
    assert log.count("scored the first 5 of 12 samples") == 1


def test_every_rank_knows_how_many_rows_the_busiest_rank_decodes_without_a_collective():
    """Lockstep decoding (sharded parameters) decodes a batch round when any rank has a row to score:
    that count comes from the positions alone. 5 samples over 2 ranks, batches of 2, the first 3 scored:
    round one, rank 0 scores positions 0 and 2, rank 1 position 1; round two, none (position 4 is past
    the cap), unless predictions are written (every real row)."""
    from types import SimpleNamespace

    from mmvl.trainers.evaluation.decoding import Decoding

    class Metric:
        generates = True

    for rank in (0, 1):
        env = SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
        engine = SimpleNamespace(env=env, strategy=SimpleNamespace(shards_parameters=True),
                                 unwrap_model=lambda m: m)
        decoding = Decoding(engine, torch.nn.Linear(1, 1), 5, [Metric()], cap=3)
        assert decoding.lockstep
        assert decoding.busiest(0, 2, written=False) == 2 and decoding.busiest(2, 2, written=False) == 0
        assert decoding.busiest(2, 2, written=True) == 1
