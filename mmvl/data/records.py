"""Columnar records: a split as a few numpy arrays instead of one Python object per sample.

A list of per-sample dicts costs ~1 KB per sample in Python objects, and every
DataLoader worker slowly copies it: reading a record writes its reference counts
(and the garbage collector its headers), so the pages holding it are copied into the
worker, one by one (the "memory grows with num_workers" effect). A :class:`Table`
holds the same data as a handful of numpy arrays (ids, offsets into one UTF-8 text
buffer, ragged integer rows), so reading sample ``i`` touches array memory only, which
the workers share with the main process (or with the page cache, when the arrays are
memory-mapped from the preprocessing cache, see :mod:`mmvl.data.cache`).

Column kinds: a plain 1-D array (one value per row), :class:`Strings` (one string per
row) and :class:`Ragged` (a variable-length group of integer arrays per row, e.g. a
question's answers and their counts). ``table[i]`` gives row ``i`` as a dict, and
iterating a table gives those dicts: convenient for small-scale code and tests, not
for readers in DataLoader workers, which should read :meth:`Table.column` arrays.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np



class Strings:
    """Many strings as one UTF-8 byte buffer plus ``offsets`` (``len + 1`` int64 positions)."""

    kind = "strings"

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    @classmethod
    def build(cls, items: Iterable[str]) -> "Strings":
        encoded = [str(s).encode("utf-8") for s in items]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets)

    @classmethod
    def from_buffer(cls, data: bytes | bytearray, offsets: Sequence[int]) -> "Strings":
        return cls(np.frombuffer(bytes(data), dtype=np.uint8).copy(), np.asarray(offsets, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.data[start:end].tobytes().decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        data = self.data.tobytes()
        offsets = self.offsets.tolist()
        for start, end in zip(offsets[:-1], offsets[1:]):
            yield data[start:end].decode("utf-8")

    def tolist(self) -> list[str]:
        return list(self)

    def take(self, rows: np.ndarray) -> "Strings":
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        return Strings(self.data[_ranges(starts, ends)], _offsets_of(ends - starts))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"data": self.data, "offsets": self.offsets}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], fields: Sequence[str] = ()) -> "Strings":
        return cls(arrays["data"], arrays["offsets"])

    def check(self, name: str) -> None:
        o = self.offsets
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or o[-1] != len(self.data):
            raise ValueError(f"column {name!r}: offsets do not cover the text buffer")


class Ragged:
    """A variable-length group per row: ``offsets`` (``len + 1``) into equally long value arrays."""

    kind = "ragged"

    def __init__(self, offsets: np.ndarray, **values: np.ndarray):
        self.offsets, self.values = offsets, values

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> dict[str, np.ndarray]:
        start, end = self.offsets[i], self.offsets[i + 1]
        return {k: v[start:end] for k, v in self.values.items()}

    def __getitem__(self, i: int) -> dict[str, list[Any]]:
        return {k: v.tolist() for k, v in self.row(i).items()}

    def take(self, rows: np.ndarray) -> "Ragged":
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        picked = _ranges(starts, ends)
        return Ragged(_offsets_of(ends - starts), **{k: v[picked] for k, v in self.values.items()})

    def arrays(self) -> dict[str, np.ndarray]:
        return {"offsets": self.offsets, **{f"v_{k}": v for k, v in self.values.items()}}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], fields: Sequence[str] = ()) -> "Ragged":
        return cls(arrays["offsets"], **{f: arrays[f"v_{f}"] for f in fields})

    def check(self, name: str) -> None:
        o = self.offsets
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or any(len(v) != o[-1] for v in self.values.values()):
            raise ValueError(f"column {name!r}: offsets do not match its values")


Column = Any  # np.ndarray | Strings | Ragged
_KINDS = {"strings": Strings, "ragged": Ragged}


class Table:
    """Named columns of equal length: 1-D arrays, :class:`Strings` or :class:`Ragged`."""

    def __init__(self, columns: Mapping[str, Column]):
        self.columns = dict(columns)
        lengths = {name: len(c) for name, c in self.columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Table columns differ in length: {lengths}")
        self.rows = next(iter(lengths.values())) if lengths else 0

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> "Table":
        """A table of plain values from a list of dicts with the same keys (strings become :class:`Strings`)."""
        if not rows:
            return cls({})
        columns: dict[str, Column] = {}
        for key in rows[0]:
            values = [r[key] for r in rows]
            columns[key] = Strings.build(values) if isinstance(values[0], str) else np.asarray(values)
        return cls(columns)

    def __len__(self) -> int:
        return self.rows

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def column(self, name: str) -> Column:
        return self.columns[name]

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Row ``i`` as plain Python values (allocates; readers in workers use :meth:`column`)."""
        if not -self.rows <= i < self.rows:
            raise IndexError(f"row {i} of a table with {self.rows} rows")
        i = i % self.rows if self.rows else i
        out = {}
        for name, c in self.columns.items():
            out[name] = c[i] if isinstance(c, (Strings, Ragged)) else c[i].item()
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        names = list(self.columns)
        values = [c.tolist() if not isinstance(c, Ragged) else (c[i] for i in range(len(c)))
                  for c in self.columns.values()]
        for row in zip(*values):
            yield dict(zip(names, row))

    def take(self, rows: Sequence[int] | np.ndarray) -> "Table":
        """A new in-memory table of the given rows (e.g. the first ``max_samples``, or readable images)."""
        rows = np.asarray(rows, dtype=np.int64)
        return Table({name: c.take(rows) if isinstance(c, (Strings, Ragged)) else np.asarray(c)[rows]
                      for name, c in self.columns.items()})

    def head(self, n: int) -> "Table":
        return self if n >= self.rows else self.take(np.arange(n))

    # -- flat form for the cache -------------------------------------------------------------
    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``({file-safe name: array}, schema)``: what :meth:`from_arrays` rebuilds the table from."""
        arrays: dict[str, np.ndarray] = {}
        schema: dict[str, Any] = {"rows": self.rows, "columns": {}}
        for name, c in self.columns.items():
            if isinstance(c, (Strings, Ragged)):
                for part, a in c.arrays().items():
                    arrays[f"{name}.{part}"] = a
                fields = sorted(c.values) if isinstance(c, Ragged) else []
                schema["columns"][name] = {"kind": c.kind, "fields": fields}
            else:
                arrays[name] = np.asarray(c)
                schema["columns"][name] = {"kind": "array"}
        return arrays, schema

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], schema: Mapping[str, Any]) -> "Table":
        """The inverse of :meth:`to_arrays`; raises ``ValueError`` when the arrays are inconsistent."""
        columns: dict[str, Column] = {}
        for name, spec in schema["columns"].items():
            kind = spec["kind"]
            if kind == "array":
                columns[name] = arrays[name]
                if arrays[name].ndim != 1:
                    raise ValueError(f"column {name!r} is not 1-D")
                continue
            parts = {k[len(name) + 1:]: v for k, v in arrays.items() if k.startswith(name + ".")}
            col = _KINDS[kind].from_arrays(parts, spec.get("fields") or [])
            col.check(name)
            columns[name] = col
        table = cls(columns)
        if table.rows != int(schema["rows"]):
            raise ValueError(f"table has {table.rows} rows, its schema says {schema['rows']}")
        return table


def _offsets_of(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, e)`` for every pair, without a Python loop."""
    lengths = (ends - starts).astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts.astype(np.int64) - _offsets_of(lengths)[:-1], lengths)
    return shift + np.arange(total, dtype=np.int64)


class RaggedBuilder:
    """Collects variable-length integer groups row by row (a parser's side of :class:`Ragged`)."""

    def __init__(self, *fields: str, dtype: Any = np.int64):
        import array

        self.fields = fields
        self.values = {f: array.array("q") for f in fields}
        self.lengths = array.array("q")
        self.dtype = dtype

    def add(self, **values: Sequence[int]) -> None:
        n = None
        for f in self.fields:
            v = values[f]
            self.values[f].extend(v)
            n = len(v) if n is None else n
        self.lengths.append(n or 0)

    def build(self, dtypes: Mapping[str, Any] | None = None) -> Ragged:
        dtypes = dtypes or {}
        return Ragged(_offsets_of(np.array(self.lengths, dtype=np.int64)),
                      **{f: np.array(v, dtype=np.int64).astype(dtypes.get(f, self.dtype))
                         for f, v in self.values.items()})

