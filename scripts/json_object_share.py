"""How often `response_format: {"type": "json_object"}` answers end by `stop` within a token
budget, and whether those answers parse: `python -m scripts.json_object_share [--vllm | --url URL]`.

Greedy chat requests over harness/reference.py's prompts (the reference prompts, and requests that
ask for JSON in words). duet runs as one decode node on the embedded model, in float32 as vLLM
does; `--vllm` also runs `vllm serve` on the same weights (installed into .venv-peer on first
use, as `make bench-peer` does), `--url` asks any other OpenAI-compatible server instead. A
grammar that forbids JSON's whitespace makes the embedded model loop on one key until the budget
runs out; the share that ends by `stop` shows it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai

from common.model.default_model import default_model_path
from common.openai_http import served_model_name
from harness.local_daemons import decode_node, free_port
from harness.reference import FP32, JSON_PROMPTS, REFERENCE_PROMPTS

MAX_TOKENS = 96
PROMPTS = REFERENCE_PROMPTS + JSON_PROMPTS


@dataclass(frozen=True)
class Answer:
    prompt: str
    text: str
    finish_reason: str

    @property
    def parses(self) -> bool:
        try:
            return isinstance(json.loads(self.text), dict)
        except ValueError:
            return False


def json_object_answers(client: openai.OpenAI, model: str, prompts: list[str] = PROMPTS,
                        max_tokens: int = MAX_TOKENS) -> list[Answer]:
    """One greedy json_object chat answer per prompt, the requests running side by side."""
    def ask(prompt: str) -> Answer:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           response_format={"type": "json_object"}, temperature=0,
                                           max_tokens=max_tokens)
        return Answer(prompt, r.choices[0].message.content or "", r.choices[0].finish_reason)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def summary(answers: list[Answer]) -> str:
    stopped = [a for a in answers if a.finish_reason == "stop"]
    parsing = sum(a.parses for a in stopped)
    return (f"{len(stopped)}/{len(answers)} end by stop within {MAX_TOKENS} tokens "
            f"({100 * len(stopped) / len(answers):.0f}%), {parsing}/{len(stopped)} of those parse")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


def _report(system: str, answers: list[Answer]) -> None:
    print(f"{system}: {summary(answers)}")
    for a in answers:
        print(f"  [{a.finish_reason}] {a.prompt!r} -> {a.text[:100]!r}")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.json_object_share", description=__doc__.split("\n\n")[0])
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--vllm", action="store_true",
                      help="also run vLLM (.venv-peer, installed when missing) on the same weights")
    peer.add_argument("--url", help="also ask this OpenAI-compatible server (its first /v1/models name)")
    args = p.parse_args()
    model = served_model_name(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        with decode_node(Path(tmp), *FP32, "--transport", "tcp", "--openai-port", str(port)):  # as vLLM runs
            _report("duet", json_object_answers(_client(f"http://127.0.0.1:{port}"), model))
        if args.url:
            client = _client(args.url)
            _report(args.url, json_object_answers(client, client.models.list().data[0].id))
        elif args.vllm:
            from scripts.export_hf_model import export_hf_model
            from scripts.peer_vllm import ensure_installed, vllm_server
            ensure_installed()
            model_dir = export_hf_model(Path(tmp) / model)
            with vllm_server(model_dir, Path(tmp) / "vllm.log") as url:
                _report("vllm", json_object_answers(_client(url), model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
