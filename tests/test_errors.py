"""mmvl.errors: a library's input errors become one line naming the cause; its bugs keep their traceback."""
from __future__ import annotations

import pytest

from mmvl.errors import UserError, first_line, library_input


def test_first_line_skips_an_introducing_line_and_cuts():
    assert first_line(ValueError("Class validation error for 'x':\n  ValueError: heads (5)\n more")) == \
        "ValueError: heads (5)"
    assert first_line(OSError("not JSON.\nsecond")) == "not JSON"
    assert first_line(ValueError("a" * 500), limit=20) == "a" * 17 + "..."
    assert first_line(KeyError()) == "KeyError"


def test_library_input_names_the_cause_and_the_fix():
    with pytest.raises(UserError, match=r"^key=3 does not build: ValueError: bad heads; use 4\.$"):
        with library_input("key=3 does not build", "use 4."):
            raise ValueError("bad heads\ntraceback-like detail")


def test_library_input_leaves_bugs_and_user_errors_alone():
    with pytest.raises(RuntimeError):
        with library_input("x", "y"):
            raise RuntimeError("a bug, not the user's input")
    with pytest.raises(UserError, match="^already said$"):
        with library_input("x", "y"):
            raise UserError("already said")
