"""The domain knows no transport: importing the engine, the KV cache, the model, the errors or
the traces loads neither gRPC nor the generated duet.v1 messages, and the transports do not load
gRPC (docs/architecture.md). Checked in a fresh interpreter, so what other tests imported does
not count."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(*packages: str) -> list[str]:
    """Every module of the packages (their files, nothing imported)."""
    names = []
    for package in packages:
        for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _loaded_after_importing(modules: list[str]) -> set[str]:
    """The top-level packages loaded by importing `modules` (grpc, protos, ...)."""
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_engine_kv_cache_and_model_load_neither_grpc_nor_protos():
    domain = _modules("common.engine", "common.kv", "common.model") + ["common.errors", "common.tracing"]
    assert len(domain) > 30
    assert _loaded_after_importing(domain) & {"grpc", "protos"} == set()


def test_the_transports_do_not_load_grpc():
    assert "grpc" not in _loaded_after_importing(_modules("common.transports"))


def test_the_kv_cache_imports_only_itself():
    for path in (ROOT / "common" / "kv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("common", "decode_node",
                                                                                           "prefill_node", "router"):
                assert node.module.startswith("common.kv"), f"{path.name} imports {node.module}"


def test_the_node_classes_import_neither_grpc_nor_protos():
    """The daemons' request logic takes and returns common/node_messages.py dataclasses; the
    servicers convert (their parts that call other nodes speak gRPC, and are imported)."""
    modules = [ROOT / "decode_node" / "node.py", ROOT / "prefill_node" / "node.py", ROOT / "common" / "node_messages.py"]
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in ("grpc", "protos")], f"{path.name} imports {names}"
    assert _loaded_after_importing(["common.node_messages"]) & {"grpc", "protos", "torch"} == set()
