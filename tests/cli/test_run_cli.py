"""`mmvl_run`: user mistakes give one line on stderr and exit code 2, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmvl_cli.run import main
from tests.fixtures.toy import register, toy_opts

register()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("extra, needle", [
    (["training.batchsize=4"], "training.batch_size"),            # unknown key, suggestion
    (["model=toy_mlpp"], "toy_mlp"),                               # unknown model, suggestion
    (["training.precision=fp8"], "training.precision"),            # bad value
    (["config=/nonexistent/run.yaml"], "/nonexistent/run.yaml"),    # missing file
    (["training.max_updates=abc"], "training.max_updates"),        # wrong type
    (["checkpoint.resume=true"], "checkpoint.resume"),              # resume with nothing to resume
    (["training.batch_size=1000"], "batch"),                        # dataset smaller than a batch
    (["oops"], "oops"),                                             # not key=value
])
def test_user_errors_exit_2_with_one_line(tmp_path, capsys, extra, needle):
    code = main(toy_opts(tmp_path) + extra)
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mmvl: error: ") and needle in lines[0]
    assert "Traceback" not in err


def test_debug_flag_shows_traceback(tmp_path):
    from mmvl.errors import UserError

    with pytest.raises(UserError):
        main(toy_opts(tmp_path) + ["training.batchsize=4", "--debug"])


def test_list_prints_registries(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "model:" in out and "visual_bert" in out and "dataset:" in out
    assert main(["--list", "model"]) == 0
    assert capsys.readouterr().out.startswith("model:")
    assert main(["--list", "modle"]) == 2


@pytest.mark.proc
def test_real_process_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mmvl_cli.run", "model=visual_bret", "datasets=sort_of_clevr",
         f"env.save_dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "visual_bert" in proc.stderr.strip().splitlines()[-1]


def test_predict_writes_predictions_file(tmp_path):
    import json

    from mmvl_cli.predict import main as predict

    assert main(toy_opts(tmp_path)) == 0
    ckpt = tmp_path / "save" / "checkpoints" / "last.ckpt"
    assert predict(toy_opts(tmp_path, f"checkpoint.resume_file={ckpt}",
                            f"env.save_dir={tmp_path}/pred")) == 0
    rows = json.loads((tmp_path / "pred" / "predictions" / "toy_test.json").read_text())
    assert len(rows) == 21 and sorted(r["id"] for r in rows) == list(range(21))
    assert all(r["answer"] in (0, 1, 2) for r in rows)


@pytest.mark.proc
def test_world_size_mismatch_exit_2(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29655")
    proc = subprocess.run(
        [sys.executable, "-m", "mmvl_cli.run", "model=toy_mlp", "datasets=toy",
         "env.user_dir=tests/fixtures", f"env.save_dir={tmp_path}", "distributed.world_size=4"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "distributed.world_size=4" in lines[0] and "Traceback" not in proc.stderr


def test_datasets_without_model_is_one_line(tmp_path, capsys):
    code = main(["datasets=toy", f"env.save_dir={tmp_path}/save", f"env.data_dir={tmp_path}/data"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("mmvl: error: No model chosen; set model=<name> (") and "toy_mlp" in err
