"""What `--anthropic-billing-header` does to an agent's turns: a Claude-Code-shaped conversation
(a long system prompt opened by a billing line that changes every request, each turn the
previous one plus a question) against a decode node with `strip` and with `keep`, through the
`anthropic` client. Prints each turn's prompt, the part read from the prefix cache, and its
time, side by side.

    .venv/bin/python -m scripts.agent_prefix_cache [--turns 4]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anthropic

from harness.local_daemons import decode_node, free_port
from loadgen.text_table import text_table

RULES = " ".join(f"Rule {i}: keep every answer short, exact and polite, and cite the file you read." for i in range(60))
QUESTIONS = ["List three colours.", "And three more.", "Which of them is the warmest?", "Name a fruit of that colour.",
             "Spell it backwards.", "Thank you."]


def conversation(client: anthropic.Anthropic, model: str, turns: int) -> list[tuple[int, int, float]]:
    """(prompt tokens, of them read from the cache, seconds) of each turn."""
    messages: list[dict] = []
    out = []
    for turn in range(turns):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}; cc_entrypoint=cli; "
                                           f"cch={turn:05x};"},
                  {"type": "text", "text": f"You are a coding agent. {RULES}"}]
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        started = time.perf_counter()
        answer = client.messages.create(model=model, system=system, messages=messages, max_tokens=16,
                                        extra_body={"temperature": 0})
        seconds = time.perf_counter() - started
        usage = answer.usage
        out.append((usage.input_tokens + usage.cache_read_input_tokens, usage.cache_read_input_tokens, seconds))
        messages.append({"role": "assistant", "content": answer.content[0].text if answer.content else "."})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("strip", "keep"):
            port = free_port()
            with decode_node(Path(tmp), "--openai-port", str(port), "--dtype", args.dtype,
                             "--anthropic-billing-header", mode):
                client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x", max_retries=0,
                                             timeout=300)
                model = client.models.list().data[0].id
                results[mode] = conversation(client, model, args.turns)
    rows = [[str(turn + 1), str(strip[0]), f"{strip[1]} ({strip[1] / strip[0]:.0%})", f"{strip[2]:.2f}",
             f"{keep[1]} ({keep[1] / keep[0]:.0%})", f"{keep[2]:.2f}"]
            for turn, (strip, keep) in enumerate(zip(results["strip"], results["keep"], strict=True))]
    header = ["turn", "prompt tokens (strip)", "cached: strip", "seconds: strip", "cached: keep", "seconds: keep"]
    print("\n".join(text_table(header, rows, ">" * len(header))))


if __name__ == "__main__":
    main()
