"""``mmvl_launch`` (as ``accelerate launch``): the settings file, ``mmvl_launch config`` on stdin,
the launch config's mixed precision in a launched Engine, and real launches (slow)."""
from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mmvl.distributed.launch_script import ACCUMULATION_ENV, DEFAULT_PORT, MIXED_PRECISION_ENV, read_settings
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl_cli import launch
from tests.fixtures.faults import child_env, communicate

PROBE = Path(__file__).resolve().parent / "launch_probe.py"


def _configure(tmp_path, answers: str) -> tuple[dict, str]:
    out = io.StringIO()
    assert launch.configure(["--config_file", str(tmp_path / "launch.yaml")], io.StringIO(answers), out) == 0
    return yaml.safe_load((tmp_path / "launch.yaml").read_text()), out.getvalue()


def test_config_on_one_machine_asks_no_address(tmp_path):
    written, said = _configure(tmp_path, "\n1\nmulti_cpu\n2\nbf16\n\n")
    assert written == {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
                       "mixed_precision": "bf16", "gradient_accumulation_steps": 1, "num_machines": 1,
                       "machine_rank": 0, "main_process_ip": None,
                       "main_process_port": None}
    assert "IP address" not in said and str(tmp_path / "launch.yaml") in said


def test_config_for_two_machines_asks_rank_address_and_port(tmp_path):
    written, _ = _configure(tmp_path, "LOCAL_MACHINE\n2\n1\n10.0.0.1\n\nMULTI_GPU\n4\nno\n3\n")
    assert (written["num_machines"], written["machine_rank"], written["main_process_ip"]) == (2, 1, "10.0.0.1")
    assert written["main_process_port"] == DEFAULT_PORT and written["num_processes"] == 4
    assert written["gradient_accumulation_steps"] == 3


def test_a_wrong_answer_is_asked_again(tmp_path):
    written, said = _configure(tmp_path, "\n1\nTPU\nMULTI_CPU\nthree\n3\n\n\n")
    assert said.count("is not a valid") == 2 and written["num_processes"] == 3


def test_input_ending_early_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n1\n"))
    assert launch.main(["config", "--config_file", str(tmp_path / "l.yaml")]) == 2
    assert "input ended before distributed_type" in capsys.readouterr().err
    assert not (tmp_path / "l.yaml").exists()


def test_command_line_flags_override_the_file(tmp_path, caplog):
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump({"num_processes": 4, "mixed_precision": "fp16", "gpu_ids": "all"}))
    with caplog.at_level(logging.WARNING):
        settings = read_settings(path, {"num_processes": 2, "mixed_precision": None})
    assert (settings.num_processes, settings.mixed_precision) == (2, "fp16")
    assert "gpu_ids" in caplog.text  # Accelerate's keys mmvl has no use for: named, not fatal


@pytest.mark.parametrize("content, overrides, match", [
    ({"num_procesess": 2}, {}, "unknown launch setting 'num_procesess'.*num_processes"),
    ({"num_machines": 2}, {}, "needs main_process_ip"),
    ({}, {"machine_rank": 3}, "machine_rank=3"),
    ({}, {"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"gradient_accumulation_steps": 0}, {}, "gradient_accumulation_steps=0"),
    ({"distributed_type": "DEEPSPEED"}, {}, "distributed_type='DEEPSPEED'"),
])
def test_settings_that_cannot_be_launched_are_user_errors(tmp_path, content, overrides, match):
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(UserError, match=match):
        read_settings(path, overrides)


def test_a_missing_config_file_or_script_or_bad_flag_exits_2(tmp_path, capsys):
    assert launch.main(["--config_file", str(tmp_path / "none.yaml"), "train.py"]) == 2
    assert launch.main(["--num_processes", "two", "train.py"]) == 2
    assert launch.main(["--config_file", str(_file(tmp_path)), str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "none.yaml" in err[0] and "num_processes" in err[1] and "nope.py" in err[2]


def _file(tmp_path) -> Path:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"num_processes": 1}))
    return path


def test_a_launched_engine_takes_the_launch_precision_unless_it_names_one(monkeypatch):
    monkeypatch.setenv(MIXED_PRECISION_ENV, "bf16")
    assert Engine(cpu=True).precision == "bf16"
    assert Engine(cpu=True, mixed_precision="no").precision == "fp32"
    assert Engine(OmegaConf.create({"training": {"precision": "fp32"}}), device="cpu").precision == "fp32"
    monkeypatch.setenv(MIXED_PRECISION_ENV, "fp8")
    with pytest.raises(UserError, match=MIXED_PRECISION_ENV):
        Engine(cpu=True)


def test_a_launched_engine_takes_the_launch_accumulation_unless_it_names_one(monkeypatch):
    monkeypatch.setenv(ACCUMULATION_ENV, "4")
    assert Engine(cpu=True).gradient_accumulation == 4
    assert Engine(cpu=True, gradient_accumulation_steps=2).gradient_accumulation == 2
    assert Engine(OmegaConf.create({"training": {"gradient_accumulation": 1}}), device="cpu").gradient_accumulation == 1
    monkeypatch.setenv(ACCUMULATION_ENV, "0")
    with pytest.raises(UserError, match=ACCUMULATION_ENV):
        Engine(cpu=True)


def _launch(*args: str) -> subprocess.CompletedProcess:
    popen = subprocess.Popen([sys.executable, "-m", "mmvl_cli.launch", *args], env=child_env(CUDA_VISIBLE_DEVICES=""),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = communicate(popen, 240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# `mmvl_launch --num_processes 2` running a port script (the tracking one, ending where one process
# ends) is tests/tracking/test_tracked_runs.py's two-process run; here: the config file's settings
@pytest.mark.slow  # two worker interpreters
def test_config_file_sets_processes_mixed_precision_and_accumulation(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                      "num_processes": 2, "mixed_precision": "bf16",
                                      "gradient_accumulation_steps": 2}))
    _launch("--config_file", str(config), str(PROBE), str(tmp_path / "out"), "--my-arg", "--debug")
    seen = [json.loads((tmp_path / "out" / f"rank_{r}.json").read_text()) for r in range(2)]
    assert all(s == {"num_processes": 2, "mixed_precision": "bf16", "gradient_accumulation_steps": 2,
                     "argv": ["--my-arg", "--debug"]} for s in seen)
