"""Read the big arrays of a JSON document one element at a time.

``json.load`` of VQA v2's 350 MB train annotations builds ~5 M Python objects (2-3 GB)
before the first one can be used. :func:`iter_arrays` reads the file in chunks and
decodes one element of the wanted top-level arrays at a time with the standard library's
C decoder, so memory stays at one chunk plus what the caller keeps; other top-level
values (``info``, ``license``...) are decoded and dropped. Errors name the line and
column like ``json.load``'s.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
CHUNK = 8 << 20
_NUMBER = frozenset("0123456789.eE+-")


class JSONStreamError(ValueError):
    """Invalid JSON or an unexpected layout; ``lineno``/``colno`` locate the problem (1-based)."""

    def __init__(self, msg: str, lineno: int, colno: int):
        super().__init__(f"{msg} (line {lineno}, column {colno})")
        self.msg, self.lineno, self.colno = msg, lineno, colno


class NotAnArray(ValueError):
    """A wanted top-level key holds something other than a list."""

    def __init__(self, key: str, found: str):
        super().__init__(f"field {key!r} must be a list, got {found}")
        self.key, self.found = key, found


class _Reader:
    def __init__(self, path: Path, chunk: int):
        self.f = open(path, "r", encoding="utf-8")
        self.chunk = chunk
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.line_start = 1, 0  # line number at buf[0], and the column offset of buf[0]

    def close(self) -> None:
        self.f.close()

    def more(self) -> bool:
        """Drop the consumed prefix and append the next chunk; False at the end of the file."""
        if self.eof:
            return False
        done = self.buf[: self.pos]
        newlines = done.count("\n")
        if newlines:
            self.line += newlines
            self.line_start = -(len(done) - done.rfind("\n") - 1)
        else:
            self.line_start -= len(done)
        self.buf, self.pos = self.buf[self.pos:], 0
        data = self.f.read(self.chunk)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def where(self, pos: int) -> tuple[int, int]:
        before = self.buf[:pos]
        newlines = before.count("\n")
        if newlines:
            return self.line + newlines, pos - before.rfind("\n")
        return self.line, pos - self.line_start + 1

    def fail(self, msg: str, pos: int | None = None) -> JSONStreamError:
        return JSONStreamError(msg, *self.where(self.pos if pos is None else pos))

    def skip_space(self) -> str:
        """The next non-space character (not consumed), '' at the end of the file."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str, what: str) -> str:
        c = self.skip_space()
        if not c or c not in chars:
            raise self.fail(f"Expecting {what}" if c else f"Expecting {what}, found the end of the file")
        self.pos += 1
        return c

    def value(self) -> Any:
        """Decode the next complete value (reading more while it may be cut by the chunk's end)."""
        self.skip_space()
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                where = self.where(e.pos)  # before more() moves the buffer
                if self.more():
                    continue
                raise JSONStreamError(e.msg, *where) from None
            if isinstance(obj, (int, float)) and (end >= len(self.buf) or self.buf[end] in _NUMBER) and self.more():
                continue  # a number cut by the chunk's end ("0." of "0.5") may go on
            self.pos = end
            return obj

    def key(self) -> str:
        while True:
            try:
                key, end = json.decoder.scanstring(self.buf, self.pos + 1)
            except json.JSONDecodeError as e:
                where = self.where(e.pos)  # before more() moves the buffer
                if self.more():
                    continue
                raise JSONStreamError(e.msg, *where) from None
            self.pos = end
            return key


def iter_arrays(path: str | Path, keys: tuple[str, ...], chunk: int = CHUNK) -> Iterator[tuple[str, int, Any]]:
    """``(key, index, element)`` for each element of the top-level arrays ``keys``, in file order.

    Raises :class:`JSONStreamError` for invalid JSON or a document that is not an object,
    :class:`NotAnArray` when a wanted key holds something else, and ``KeyError`` (with the
    keys found) when a wanted key is missing.
    """
    r = _Reader(Path(path), chunk)
    try:
        found: list[str] = []
        r.expect("{", "a JSON object at the top level")
        if r.skip_space() == "}":
            r.pos += 1
        else:
            while True:
                if r.skip_space() != '"':
                    raise r.fail("Expecting property name enclosed in double quotes")
                key = r.key()
                found.append(key)
                r.expect(":", "':' delimiter")
                if key in keys:
                    if r.skip_space() != "[":
                        raise NotAnArray(key, type(r.value()).__name__)
                    r.pos += 1
                    yield from _elements(r, key)
                else:
                    r.value()
                if r.expect(",}", "',' delimiter") == "}":
                    break
        if r.skip_space():
            raise r.fail("Extra data")
        missing = [k for k in keys if k not in found]
        if missing:
            raise KeyError(missing[0], sorted(found))
    finally:
        r.close()


def _elements(r: _Reader, key: str) -> Iterator[tuple[str, int, Any]]:
    if r.skip_space() == "]":
        r.pos += 1
        return
    index = 0
    while True:
        yield key, index, r.value()
        index += 1
        if r.expect(",]", "',' delimiter") == "]":
            return
