"""The committed gRPC stubs are what protoc makes from the committed .proto files."""
from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_committed_stubs_are_fresh(tmp_path: Path):
    generate(tmp_path)
    generated = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert generated
    for fresh in generated:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `python -m protos.generate`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `python -m protos.generate`"
