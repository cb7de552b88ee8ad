"""Regenerate the committed Python stubs from the .proto files: `python -m protos.generate [OUT_DIR]`.

Stubs are committed so installing needs no protoc step; tests/unit/test_protos.py fails when they
are stale. Run it as its own process: grpc_tools' protoc extension crashes when loaded into a
process that already loaded NIXL (their bundled libraries clash).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under `out_dir`."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + PROTOS) != 0:
        raise RuntimeError("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
