"""Streaming the big arrays of a JSON file: same values as json.load, at any chunk size, and the same
line/column in errors."""
import json

import pytest

from mmvl.data.jsonstream import JSONStreamError, NotAnArray, iter_arrays

DOC = {"info": {"year": 2017, "nested": [1, 2, {"a": "]}"}]}, "questions": [
    {"image_id": 1, "question": "What is \"this\"?\n", "question_id": 10},
    {"image_id": 123456789, "question": "Ünïcode ✓", "question_id": 11},
    {"image_id": 3, "question": "", "question_id": 12345678901234}],
    "count": 1234567, "annotations": [], "tail": [0.5, -1e-3]}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_elements_equal_json_load(tmp_path, chunk, indent):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(DOC, indent=indent, ensure_ascii=False), encoding="utf-8")
    got = list(iter_arrays(path, ("questions", "annotations", "tail"), chunk=chunk))
    assert [e for k, _, e in got if k == "questions"] == DOC["questions"]
    assert [(k, i) for k, i, _ in got if k == "tail"] == [("tail", 0), ("tail", 1)]
    assert [e for k, _, e in got if k == "tail"] == DOC["tail"]  # numbers cut by a chunk end stay whole


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_errors_name_the_line_and_column_like_json(tmp_path, chunk):
    path = tmp_path / "bad.json"
    text = json.dumps({"questions": [{"a": 1}, {"a": 2}]}, indent=1)
    broken = text.replace('"a": 2', '"a" 2')
    path.write_text(broken)
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(broken)
    with pytest.raises(JSONStreamError) as got:
        list(iter_arrays(path, ("questions",), chunk=chunk))
    assert (got.value.lineno, got.value.colno) == (expected.value.lineno, expected.value.colno)
    path.write_text('{"questions": [{"image_id": 1}, {"image_')  # truncated download
    with pytest.raises(JSONStreamError, match="line 1"):
        list(iter_arrays(path, ("questions",), chunk=chunk))


def test_layout_errors(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text('{"questions": {"not": "a list"}}')
    with pytest.raises(NotAnArray):
        list(iter_arrays(path, ("questions",)))
    path.write_text('{"qs": []}')
    with pytest.raises(KeyError) as e:
        list(iter_arrays(path, ("questions",)))
    assert e.value.args == ("questions", ["qs"])
    path.write_text("[1, 2]")
    with pytest.raises(JSONStreamError, match="JSON object"):
        list(iter_arrays(path, ("questions",)))
    path.write_text('{"questions": []} extra')
    with pytest.raises(JSONStreamError, match="Extra data"):
        list(iter_arrays(path, ("questions",)))
