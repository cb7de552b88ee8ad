"""A daemon's OpenAI-compatible HTTP front as the tests call it, and the flags and chat they use."""
from __future__ import annotations

import ssl

import openai

from harness.reference import FP32

API_KEYS = ("first-key", "second-key")  # a keyed daemon's --api-key and DUET_API_KEY
DAEMON_FLAGS = (*FP32, "--transport", "tcp", "--threads", "1", "--kv-pages", "160")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]


class Front:
    """A daemon's HTTP front: its base URL and an `openai` client for it."""

    def __init__(self, port: int, scheme: str = "http", ssl_context: ssl.SSLContext | None = None,
                 api_key: str = "x") -> None:
        self.url = f"{scheme}://127.0.0.1:{port}"
        http_client = openai.DefaultHttpxClient(verify=ssl_context) if ssl_context is not None else None
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120,
                                    http_client=http_client)
