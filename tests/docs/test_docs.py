"""Every tutorial in docs/ runs: its code blocks are executed, in order, on tiny settings.

The convention (docs/README.md tells authors the same):

- a fenced block whose info string is ``bash run`` or ``python run`` is executed (bash with
  ``-e -o pipefail``; python as its own script), all blocks of a page in one fresh folder
  that has the repo's ``projects/`` and ``examples/``;
- ``LANG file=PATH`` is written to PATH (in that folder) before the blocks after it run;
- ``text output`` right after a run block lists lines that must appear in that block's
  output (stdout and stderr); ``...`` inside a line matches anything;
- ``tiny=NAME`` puts :data:`TINY` [NAME] before the options of every ``load_config`` call
  the block makes (mmvl_run, mmvl_predict, torchrun workers, Python), so the page shows
  the real command and CI runs it small; a key the page sets itself still wins, except
  the options written ``!key=value``, which go after the page's;
- ``slow``: only under ``pytest -m slow`` (it must not feed a block that is not slow); the slow pass
  runs the ``slow`` blocks and the ``setup`` blocks (those that make what a slow block needs), not
  the others, which the fast pass runs;
- any other block (``bash``, ``yaml``, ...) is shown, not run.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HARNESS = Path(__file__).resolve().parent / "harness"
BLOCK_TIMEOUT_S = 300

_DATA = ["dataset_config.sort_of_clevr.num_images=64", "dataset_config.sort_of_clevr.num_val_images=8",
         "dataset_config.sort_of_clevr.num_test_images=8", "dataset_config.sort_of_clevr.questions_per_image=4"]
_SHORT = ["training.batch_size=8", "training.max_updates=8", "training.num_workers=0", "training.log_interval=2",
          "training.evaluation_interval=8", "training.checkpoint_interval=4",
          "scheduler.params.num_warmup_steps=2"]
_DEMO_MODEL = ["model_config.visual_bert.hidden_size=32", "model_config.visual_bert.num_hidden_layers=1",
               "model_config.visual_bert.num_attention_heads=2", "model_config.visual_bert.intermediate_size=64",
               "model_config.visual_bert.text_encoder.num_layers=1",
               "model_config.visual_bert.image_encoder.params.channels=[8,8,16,16]"]
_RN_MODEL = ["model_config.relation_network.question_encoder.hidden_size=16",
             "model_config.relation_network.object_encoder_sizes=[16]",
             "model_config.relation_network.g_hidden_sizes=[16,16]", "model_config.relation_network.f_hidden_sizes=[16]"]
#: named tiny settings a block asks for with ``tiny=NAME``
TINY = {
    "demo": _DATA + _RN_MODEL + _SHORT,       # the README's demo config (relation_network on Sort-of-CLEVR)
    "visual_bert": _DATA + _DEMO_MODEL + _SHORT,  # the tutorials' VisualBERT config on Sort-of-CLEVR
    "sort_of_clevr": _DATA + _SHORT + ["!training.max_updates=8"],  # any model, small Sort-of-CLEVR
    "short": ["!training.max_updates=20", "training.log_interval=10", "training.evaluation_interval=10"],
}


@dataclass
class Block:
    line: int
    lang: str
    words: list[str]
    body: str

    def has(self, *words: str) -> bool:
        """Whether the info string has any of ``words``."""
        return any(word in self.words for word in words)

    def option(self, name: str) -> str | None:
        return next((w.split("=", 1)[1] for w in self.words if w.startswith(name + "=")), None)


def parse(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their info-string words."""
    blocks, current, body = [], None, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if current is None and line.startswith("```"):
            words = shlex.split(line[3:].strip()) or [""]
            current, body = Block(number, words[0], words[1:], ""), []
        elif current is not None and line.startswith("```"):
            current.body = "\n".join(body) + "\n"
            blocks.append(current)
            current = None
        elif current is not None:
            body.append(line)
    assert current is None, f"{path}: the block opened at line {current.line} is not closed"
    return blocks


def pages() -> list[Path]:
    """The tutorials, and the README, whose snippets follow the same convention."""
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def _env(tiny: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMVL_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the harness, then this checkout: its blocks run the tree under test, not whichever mmvl is installed
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS), str(ROOT)])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    if tiny is not None:
        assert tiny in TINY, f"unknown tiny={tiny}; known: {sorted(TINY)}"
        env["MMVL_DOCS_TINY"] = json.dumps(TINY[tiny])
    return env


def _matches(expected: str, output: str) -> bool:
    pattern = ".*".join(re.escape(part.strip()) for part in expected.strip().split("..."))
    return re.search(pattern, output) is not None


def run_page(page: Path, work: Path, with_slow: bool) -> list[str]:
    """Execute ``page``'s blocks in ``work``; returns the outputs of its run blocks."""
    work.mkdir(parents=True, exist_ok=True)
    for name in ("projects", "examples"):
        (work / name).symlink_to(ROOT / name)
    blocks, outputs, last = parse(page), [], None
    for i, block in enumerate(blocks):
        where = f"{page.name}:{block.line}"
        if block.option("file"):
            target = work / block.option("file")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.body, encoding="utf-8")
        elif block.has("output"):
            assert last is not None, f"{where}: an output block must follow a run block"
            if last == "skipped":
                continue
            for line in filter(str.strip, block.body.splitlines()):
                assert _matches(line, last), f"{where}: {line!r} not in the output:\n{last[-3000:]}"
        elif block.has("run"):
            if (not with_slow and block.has("slow")) or (with_slow and not block.has("slow", "setup")):
                last = "skipped"
                continue
            script = work / f"_block_{i}.{'py' if block.lang == 'python' else 'sh'}"
            script.write_text(block.body, encoding="utf-8")
            command = [sys.executable, script.name] if block.lang == "python" else \
                ["bash", "-e", "-o", "pipefail", script.name]
            assert block.lang in ("python", "bash"), f"{where}: run blocks are bash or python"
            proc = subprocess.run(command, cwd=work, env=_env(block.option("tiny")), capture_output=True,
                                  text=True, timeout=BLOCK_TIMEOUT_S)
            last = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"{where} exited with {proc.returncode}:\n{last[-4000:]}"
            outputs.append(last)
    return outputs


def _params():
    params = []
    for page in pages():
        name = page.stem if page.parent == DOCS else "repo-" + page.stem
        params.append(pytest.param(page, False, id=name))
        if any(b.has("slow") for b in parse(page)):
            params.append(pytest.param(page, True, id=f"{name}-with-slow", marks=pytest.mark.slow))
    return params


@pytest.mark.proc
@pytest.mark.parametrize("page, with_slow", _params())
def test_page_runs(page, with_slow, tmp_path):
    run_page(page, tmp_path / "work", with_slow)


def test_every_page_is_linked_and_has_code_that_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        if page.name == "README.md":
            continue
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
        assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"
        assert any(b.has("run") and not b.has("slow") for b in parse(page)), f"{page.name} runs nothing in CI"
    for link in re.findall(r"\]\((docs/[^)#\s]+)", readme):
        assert (ROOT / link).exists(), f"README.md links the missing {link}"


@pytest.mark.proc
def test_harness_convention(tmp_path):
    """The harness itself: file blocks, tiny options around the page's own, output matching, failures."""
    page = tmp_path / "page.md"
    t = "c.training"
    page.write_text("\n".join([
        "```python file=show.py", "from mmvl import load_config",
        "c = load_config(['model=visual_bert', 'datasets=sort_of_clevr', 'training.max_updates=3',",
        "                 'training.log_interval=3'])",
        f"print('log', {t}.log_interval, 'updates', {t}.max_updates, 'images', "
        "c.dataset_config.sort_of_clevr.num_images)", "```",
        "```bash run tiny=sort_of_clevr", "python show.py", "```",
        "```text output", "log 3 updates 8 images ...", "```",
        "```bash run slow", "exit 1", "```",
        "```bash", "exit 1", "```"]))
    outputs = run_page(page, tmp_path / "a", with_slow=False)
    # the page's log_interval wins over TINY's, TINY's forced max_updates over the page's
    assert outputs == [outputs[0]] and "log 3 updates 8 images 64" in outputs[0]
    with pytest.raises(AssertionError, match="exited with 1"):
        run_page(page, tmp_path / "b", with_slow=True)
    # the slow pass runs the slow blocks and the setup blocks they need, not the fast pass's others
    page.write_text("```bash run\ntouch fast\n```\n```bash run setup\ntouch setup\n```\n"
                    "```bash run slow\ntest -f setup && test ! -f fast\n```\n")
    run_page(page, tmp_path / "d", with_slow=True)
    assert len(run_page(page, tmp_path / "e", with_slow=False)) == 2  # the fast pass: no slow block
    page.write_text("```bash run\necho hello\n```\n```text output\ngoodbye\n```\n")
    with pytest.raises(AssertionError, match="'goodbye' not in the output"):
        run_page(page, tmp_path / "c", with_slow=False)
