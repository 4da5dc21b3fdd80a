"""Everything a run writes (checkpoints and their links, config.yaml, metrics.jsonl, train.log,
predictions, the save folder itself) gets the permissions a plain ``open()``/``mkdir`` gives
under the umask, so teammates on a shared cluster can read them (0600 files before)."""
from __future__ import annotations

from mmvl_cli.run import main
from tests.fixtures.modes import tree, wrong_modes
from tests.fixtures.toy import register, toy_opts

register()


def test_run_outputs_follow_the_umask(tmp_path, umask):
    assert main(toy_opts(tmp_path, "training.max_updates=4", "training.checkpoint_interval=2",
                         "training.evaluation_interval=2", "evaluation.predict=true")) == 0
    save = tmp_path / "save"
    written = {p.relative_to(save).as_posix() for p in save.rglob("*")}
    assert {"config.yaml", "metrics.jsonl", "train.log", "checkpoints/last.ckpt", "checkpoints/best.ckpt",
            "checkpoints/model_4.ckpt", "predictions/toy_val.json"} <= written, written
    assert wrong_modes(tree(save), umask) == []
