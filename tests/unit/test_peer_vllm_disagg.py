"""scripts/peer_vllm_disagg.py without vLLM: the proxy's request rewriting and relaying (to stand-in
servers), and the sitecustomize that stops vLLM's NIXL worker from re-pinning (checked against a
stand-in vllm.platforms.cpu)."""
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.peer_vllm_disagg import PREFILL_KV_PARAMS, REPIN_PATCH, decode_body, disaggregation_proxy, prefill_body

STREAMED = {"model": "m", "prompt": "hi", "max_tokens": 16, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def test_prefill_body_asks_for_one_unstreamed_token_and_remote_decode():
    body = prefill_body(STREAMED)
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0.0, "stream": False,
                    "kv_transfer_params": PREFILL_KV_PARAMS}
    assert PREFILL_KV_PARAMS["do_remote_decode"] is True and PREFILL_KV_PARAMS["do_remote_prefill"] is False
    assert STREAMED["max_tokens"] == 16 and "stream_options" in STREAMED  # the client's body is untouched


def test_prefill_body_caps_max_completion_tokens_only_when_present():
    assert "max_completion_tokens" not in prefill_body(STREAMED)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    assert prefill_body(chat)["max_completion_tokens"] == 1


def test_decode_body_is_the_clients_with_the_prefillers_kv_transfer_params():
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h",
          "remote_port": 5600, "remote_request_id": "r"}
    assert decode_body(STREAMED, {"id": "x", "choices": [], "kv_transfer_params": kv}) == {
        **STREAMED, "kv_transfer_params": kv}


def test_sitecustomize_makes_the_cpu_platform_find_no_numa_cores(tmp_path):
    package = tmp_path / "vllm" / "platforms"
    package.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cpu.py").write_text(
        "class CpuPlatform:\n    @classmethod\n    def discover_numa_topology(cls):\n        return [[0, 1]]\n")
    (tmp_path / "sitecustomize.py").write_text(REPIN_PATCH)
    check = "from vllm.platforms.cpu import CpuPlatform; print(CpuPlatform.discover_numa_topology())"
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path)}, check=True)
    assert done.stdout.strip() == "[]"


SSE = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
KV = {"remote_engine_id": "e", "remote_block_ids": [3]}


@contextmanager
def upstream(answer: tuple[int, str, bytes]):
    """A stand-in vLLM server that records the JSON bodies posted to it and gives every request `answer`."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.do_GET()

        def do_GET(self) -> None:
            status, content_type, body = answer
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_proxy_prefills_then_streams_the_decoders_answer_unchanged():
    prefill_answer = (200, "application/json", json.dumps({"kv_transfer_params": KV}).encode())
    with upstream(prefill_answer) as (prefiller, prefilled), upstream((200, "text/event-stream", SSE)) as (
            decoder, decoded), disaggregation_proxy(prefiller, decoder) as url:
        request = urllib.request.Request(url + "/v1/completions", json.dumps(STREAMED).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            assert response.headers["Content-Type"] == "text/event-stream" and response.read() == SSE
        with urllib.request.urlopen(url + "/v1/models") as response:
            assert response.read() == SSE  # GETs go to the decoder
    assert prefilled == [prefill_body(STREAMED)]
    assert decoded == [{**STREAMED, "kv_transfer_params": KV}]


def test_proxy_passes_an_upstream_error_back_with_its_status():
    with upstream((400, "application/json", b'{"error":"bad"}')) as (prefiller, _), \
            upstream((200, "text/event-stream", SSE)) as (decoder, decoded), \
            disaggregation_proxy(prefiller, decoder) as url:
        request = urllib.request.Request(url + "/v1/completions", json.dumps(STREAMED).encode())
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request)
        assert error.value.code == 400 and error.value.read() == b'{"error":"bad"}'
    assert decoded == []
