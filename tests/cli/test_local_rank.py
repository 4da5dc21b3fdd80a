"""The MMF guide's launch line: ``python -m torch.distributed.launch ... mmvl_cli/run.py config=...``
passes ``--local-rank=N`` (older torch: ``--local_rank=N``) to every worker; mmvl takes it as the
local rank, never as a config key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmvl.distributed.init import detect_launcher, split_local_rank
from mmvl.errors import UserError
from mmvl_cli import common
from tests.fixtures.faults import child_env, communicate, free_port
from tests.fixtures.toy import toy_opts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag", [["--local-rank=1"], ["--local_rank=1"], ["--local-rank", "1"], ["--local_rank", "1"]])
def test_every_spelling_is_taken_out_with_its_rank(flag):
    argv = ["config=a.yaml", *flag, "training.batch_size=4"]
    assert split_local_rank(argv) == (["config=a.yaml", "training.batch_size=4"], 1)


def test_without_the_flag_nothing_changes():
    assert split_local_rank(["config=a.yaml", "local_rank_x=3"]) == (["config=a.yaml", "local_rank_x=3"], None)


@pytest.mark.parametrize("bad", [["--local-rank=one"], ["--local_rank"]])
def test_a_malformed_rank_is_a_user_error(bad):
    with pytest.raises(UserError, match="local rank"):
        split_local_rank(["config=a.yaml", *bad])


def test_the_cli_hands_the_command_its_options_without_the_flag(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen: list[list[str]] = []
    assert common.cli_main(lambda opts: seen.append(opts) or 0, ["x=1", "--local-rank=3"]) == 0
    assert seen == [["x=1"]] and os.environ["LOCAL_RANK"] == "3"


def test_the_launcher_environment_wins_over_the_flag(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    common.launcher_free(["--local_rank=5"])
    assert os.environ["LOCAL_RANK"] == "0"


def test_the_engine_set_up_reads_the_flag_when_local_rank_is_unset(monkeypatch):
    """A script on the Engine under ``torch.distributed.launch --use-env=0`` without LOCAL_RANK."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--local-rank=1"])
    layout = detect_launcher(None, {"RANK": "3", "WORLD_SIZE": "4"})
    assert layout is not None and layout["local_rank"] == 1 and layout["rank"] == 3


@pytest.mark.slow  # two worker processes under torch.distributed.launch
def test_the_mmf_guide_launch_line_trains(tmp_path):
    package = tmp_path / "toy_user_dir"
    package.mkdir()
    (package / "__init__.py").write_text("from tests.fixtures.toy import register\nregister()\n")
    opts = toy_opts(tmp_path, f"env.user_dir={package}", "distributed.world_size=2", "training.max_updates=4",
                    "training.evaluation_interval=4", "training.checkpoint_interval=4")
    command = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
               f"--master_port={free_port()}", str(ROOT / "mmvl_cli" / "run.py"), *opts]
    popen = subprocess.Popen(command, env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = communicate(popen, 240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Unknown config key" not in result.stderr
    assert (tmp_path / "save" / "metrics.jsonl").read_text().count('"split": "train"') >= 1
