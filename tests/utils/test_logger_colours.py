"""``training.colored_logs``: level names in colour on a terminal, plain in a pipe and in train.log."""
from __future__ import annotations

import io
import logging

from mmvl.utils import logger as logger_module
from mmvl.utils.logger import COLOURS, RESET, setup_logging


class _Console(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _logged(tmp_path, monkeypatch, tty: bool, colored: bool) -> tuple[str, str]:
    console = _Console(tty)
    monkeypatch.setattr(logger_module.sys, "stdout", console)
    monkeypatch.setattr(logger_module.tqdm, "write", lambda text: console.write(text + "\n"))
    log = setup_logging(str(tmp_path), 0, colored=colored)
    log.warning("careful")
    for handler in log.handlers:
        handler.flush()
    text = (tmp_path / "train.log").read_text()
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    return console.getvalue(), text


def test_a_terminal_shows_coloured_level_names_and_the_file_stays_plain(tmp_path, monkeypatch):
    shown, written = _logged(tmp_path, monkeypatch, tty=True, colored=True)
    assert f"{COLOURS['WARNING']}WARNING{RESET} | careful" in shown
    assert "| WARNING | careful" in written and "\033[" not in written


def test_a_pipe_or_the_switch_off_shows_plain_names(tmp_path, monkeypatch):
    for tty, colored in ((False, True), (True, False)):
        shown, _ = _logged(tmp_path, monkeypatch, tty=tty, colored=colored)
        assert "| WARNING | careful" in shown and "\033[" not in shown
    assert logging.getLogger("mmvl").handlers == []
