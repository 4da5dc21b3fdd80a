"""The one exception type for mistakes a user can cause.

The CLI catches :class:`UserError`, prints its message on one line and exits
with code 2; everything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import difflib
from typing import Iterable


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
