"""The two workloads of the speculative-decoding benchmarks (scripts/bench_spec.py and
`make bench-peer`), as user messages:
- copy: asks to repeat a piece of this repository's code (the answer quotes the prompt, which is
  what prompt-lookup drafts are for);
- free: asks for short stories (the answer copies nothing from the prompt)."""
from __future__ import annotations

import json
from pathlib import Path

import loadgen

CODE_DIR = Path(loadgen.__file__).parent  # modules whose last lines are plain code
TOPICS = ("a lighthouse keeper", "a lost robot", "a village baker", "a mountain storm", "a chess champion",
          "a river journey", "an old library", "a desert caravan")


def copy_messages(n: int, max_lines: int = 24) -> list[str]:
    """n requests to repeat the last `max_lines` lines of a module (past its docstring), cycling
    through the modules of CODE_DIR."""
    files = sorted(p for p in CODE_DIR.glob("*.py") if len(p.read_text().splitlines()) > 2 * max_lines)
    out = []
    for i in range(n):
        code = "\n".join(files[i % len(files)].read_text().splitlines()[-max_lines:])
        out.append(f"Repeat this Python code exactly, with no comment:\n```python\n{code}\n```")
    return out


def free_messages(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def write_jsonl(path: Path, messages: list[str]) -> Path:
    """A loadgen dataset (one {"prompt": ...} per line); with the chat endpoint each becomes a
    user message."""
    path.write_text("".join(json.dumps({"prompt": m}) + "\n" for m in messages))
    return path
