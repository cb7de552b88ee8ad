"""The committed gRPC stubs are what protoc makes from the committed .proto files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protos.generate import ROOT


def test_committed_stubs_are_fresh(tmp_path: Path):
    # In a fresh process: protoc's extension must not share a process with NIXL (see protos/generate.py).
    subprocess.run([sys.executable, "-m", "protos.generate", str(tmp_path)], cwd=ROOT, check=True)
    generated = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert generated
    for fresh in generated:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `python -m protos.generate`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `python -m protos.generate`"
