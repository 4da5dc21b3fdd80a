"""Columnar records: strings in one buffer, ragged rows, row selection and the flat form the cache stores."""
import numpy as np
import pytest

from mmvl.data.records import Ragged, RaggedBuilder, Strings, Table


def _table() -> Table:
    ragged = RaggedBuilder("answer", "count")
    for answers in ([3, 1], [], [7], [2, 5, 9]):
        ragged.add(answer=answers, count=[len(answers)] * len(answers))
    return Table({"id": np.array([10, 11, 12, 13]), "text": Strings.build(["é?", "", "two words", "x"]),
                  "answers": ragged.build({"answer": np.int32})})


def test_strings_ragged_and_rows():
    t = _table()
    assert len(t) == 4 and t.column("text")[0] == "é?" and t.column("text")[1] == ""
    assert t.column("text").tolist() == ["é?", "", "two words", "x"]
    assert t[2] == {"id": 12, "text": "two words", "answers": {"answer": [7], "count": [1]}}
    assert t[-1]["id"] == 13 and list(t)[3] == t[3]
    assert t.column("answers").row(3)["answer"].tolist() == [2, 5, 9]
    with pytest.raises(IndexError):
        t[4]


def test_take_and_head_keep_rows_aligned():
    t = _table()
    picked = t.take([3, 1, 0])
    assert [r["id"] for r in picked] == [13, 11, 10]
    assert picked.column("text").tolist() == ["x", "", "é?"]
    assert [r["answers"]["answer"] for r in picked] == [[2, 5, 9], [], [3, 1]]
    assert t.head(10) is t and [r["id"] for r in t.head(2)] == [10, 11]
    assert len(t.take(np.zeros(0, dtype=np.int64))) == 0


def test_flat_form_round_trip_and_checks():
    t = _table()
    arrays, schema = t.to_arrays()
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    back = Table.from_arrays(arrays, schema)
    assert list(back) == list(t)
    bad = dict(arrays, **{"text.offsets": arrays["text.offsets"][:-1]})  # a truncated offsets file
    with pytest.raises(ValueError):
        Table.from_arrays(bad, schema)
    with pytest.raises(ValueError):
        Table.from_arrays(dict(arrays, **{"answers.v_count": arrays["answers.v_count"][:2]}), schema)
    with pytest.raises(ValueError):
        Table({"a": np.zeros(2), "b": Strings.build(["x"])})


def test_from_rows():
    t = Table.from_rows([{"id": 1, "q": "a"}, {"id": 2, "q": "bb"}])
    assert isinstance(t.column("q"), Strings) and t.column("id").tolist() == [1, 2]
    assert list(t) == [{"id": 1, "q": "a"}, {"id": 2, "q": "bb"}]
    assert isinstance(Ragged(np.array([0, 2]), v=np.array([1, 2])).take(np.array([0])), Ragged)
