"""The distributed package reads its typed config sections (mmvl/distributed/sections.py), never the
whole config through dotted ``config_value(`` look-ups; a null field reads as its declared default."""
from __future__ import annotations

from pathlib import Path

from mmvl.config.schema import typed_section

ROOT = Path(__file__).resolve().parents[2]


def test_no_config_value_in_distributed():
    calls = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "mmvl" / "distributed").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if "config_value(" in line]
    assert calls == [], "read the typed section instead: " + ", ".join(calls)


def test_typed_section_defaults_for_null_absent_and_interpolated():
    d = typed_section({"distributed": {"broadcast_buffers": None, "port": 29511}}, "distributed")
    assert d.broadcast_buffers is True and d.port == 29511
    assert d.world_size is None  # the schema's ${device_count:} default is unresolved here: unset
    assert typed_section(None, "distributed").strategy == "auto"
    assert typed_section({"distributed": {"world_size": 3}}, "distributed").world_size == 3
