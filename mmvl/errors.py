"""The one exception type for mistakes a user can cause.

The CLI catches :class:`UserError`, prints its message on one line and exits
with code 2; everything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import difflib
import re
import sys
from typing import Iterable, Iterator


class UserError(Exception):
    """A problem the user can fix: bad config, missing file, corrupt data.

    The message must name the offending value and say what to do.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Closest names to ``name`` (for "did you mean" hints)."""
    candidates = [str(c) for c in candidates]
    hits = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    if not hits:
        lowered = name.lower()
        hits = [c for c in candidates if lowered in c.lower() or c.lower() in lowered][:n]
    return hits


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    hits = closest(name, candidates)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


#: what a library raises when its input (a config value, a folder, a file) is wrong
LIBRARY_INPUT_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, KeyError, AssertionError)


def first_line(error: BaseException, limit: int = 120) -> str:
    """What ``error`` says, as one line cut at ``limit`` characters: its first line, or where that
    line only introduces the next (ends with ``:``, as a validator's name does), the next one (a
    library's message can run to pages: transformers lists every model type it knows)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    while len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    text = lines[0].rstrip(".") if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: (module, class) of library errors that derive from ``Exception`` alone yet mean bad input:
#: transformers' config validation (huggingface_hub) and chat-template rendering (jinja2)
_BARE_INPUT_ERRORS = (("huggingface_hub.errors", "StrictDataclassError"), ("jinja2.exceptions", "TemplateError"))


def _validation_errors() -> tuple[type[BaseException], ...]:
    """The classes of :data:`_BARE_INPUT_ERRORS` whose library is loaded: only a loaded library can
    have raised one, so nothing is imported to find them."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in _BARE_INPUT_ERRORS)
    return tuple(cls for cls in found if isinstance(cls, type))


@contextlib.contextmanager
def library_input(what: str, fix: str) -> Iterator[None]:
    """Run a library call (transformers, timm, torch) on the user's input; its input errors become a
    :class:`UserError` that says ``what`` caused them (the key and value or folder), the library's
    own first line, and ``fix``."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not isinstance(e, LIBRARY_INPUT_ERRORS + _validation_errors()):
            raise
        said = first_line(e)
        kind = "" if re.match(r"\w+(Error|Exception): ", said) else f"{type(e).__name__}: "
        raise UserError(f"{what}: {kind}{said}; {fix}") from e
