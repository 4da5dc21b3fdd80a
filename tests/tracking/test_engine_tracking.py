"""The Engine's trackers in this process (TensorBoard: cheap to start): ``log_with``,
``init_trackers``, ``log``, ``get_tracker``, ``end_training``, read back from the event files."""
from __future__ import annotations

import pytest
import torch

from mmvl.engine import Accelerator
from mmvl.errors import UserError
from tests.tracking.readers import tensorboard_scalars

pytest.importorskip("tensorboard")


def test_init_log_end_training_writes_event_files_under_project_dir(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("demo", config={"lr": 0.1, "model": {"hidden": 8}})
    logged = {1: {"loss": 0.5, "pair": {"a": 1.0, "b": 2.0}}, 2: {"loss": 0.25, "pair": {"a": 3.0, "b": 4.0}}}
    for step, values in logged.items():
        accelerator.log({**values, "note": f"step {step}", "tensor": torch.tensor(float(step))}, step=step)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert accelerator.get_tracker("tensorboard").tracker is writer and writer.log_dir == str(tmp_path / "demo")
    accelerator.end_training()
    assert accelerator.trackers == []
    scalars = tensorboard_scalars(tmp_path / "demo")
    assert scalars["loss"] == {s: v["loss"] for s, v in logged.items()}
    assert scalars["tensor"] == {s: float(s) for s in logged}  # one-element tensors log as numbers
    assert tensorboard_scalars(tmp_path / "demo" / "pair_b")["pair"] == {1: 2.0, 2: 4.0}  # add_scalars: a folder per line
    acc = EventAccumulator(str(tmp_path / "demo"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "    model:" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "note/text_summary" in acc.Tags()["tensors"]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # end_training wrote the table


def test_without_log_with_nothing_is_started_and_get_tracker_says_so(tmp_path):
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 1.0}, step=0)
    with pytest.raises(UserError, match="get_tracker.'wandb'.*none"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()
    assert not (tmp_path / "demo").exists()
