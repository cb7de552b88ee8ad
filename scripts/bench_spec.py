"""Speculative decoding (prompt-lookup drafts) against plain decoding, side by side in one run.

Two workloads (scripts/spec_prompts.py: copy = repeat a piece of this repository's code, free =
short stories), each run by two in-process decode schedulers on the default model (CPU, fp32),
one plain and one with `--speculative ngram`, taking turns round by round so both see the
same machine load. `make bench-peer` runs the same prompts against vLLM's n-gram method.
Every round submits `--concurrency` requests at once (greedy, EOS ends them, so both sides
produce the same tokens) and waits for all of them.

Reported per workload and side: output tokens/s (all tokens over the round's wall time,
summed over rounds), ITL (median over requests of (last token time - first token time) /
(tokens - 1): a speculative step delivers several tokens at once), and the acceptance rate
(accepted / drafted tokens) and mean tokens per verify step. Goals: copy >= 1.5x plain
output tokens/s, free >= 0.95x.

Usage: python -m scripts.bench_spec [--rounds N] [--concurrency C] [--max-tokens T] [--json FILE]
(wrap it in `flock /tmp/duet-bench.lock` on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.engine.core import Engine
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.speculative import SpeculativeConfig
from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.model.tokenizer import Tokenizer, load_tokenizer
from scripts.spec_prompts import copy_messages, free_messages

COPY_GOAL, FREE_GOAL = 1.5, 0.95


def chat_prompts(tokenizer: Tokenizer, messages: list[str]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": m}])) for m in messages]


@dataclass
class Side:
    tokens: int = 0
    seconds: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1

    def summary(self) -> dict:
        return {"output_tok_s": self.tokens / self.seconds, "itl_ms_median": statistics.median(self.itl_ms),
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_verify_step": (self.accepted + self.verify_steps) / self.verify_steps
                if self.verify_steps else None, "tokens": self.tokens, "seconds": self.seconds}


def run_round(s: Scheduler, prompts: list[list[int]], params: SamplingParams, side: Side, tag: str) -> None:
    start = time.perf_counter()
    handles = [s.submit(f"{tag}-{i}", s.engine.new_sequence(f"{tag}-{i}", p), params) for i, p in enumerate(prompts)]
    for h in handles:
        times, n = [], 0
        while True:
            chunk = h.next_chunk(timeout=600)
            assert chunk is not None and chunk.finish_reason != "error", "generation failed"
            if chunk.token_ids:
                times.append(time.perf_counter())
                n += len(chunk.token_ids)
            if chunk.final:
                break
        side.tokens += n
        if n > 1:
            side.itl_ms.append((times[-1] - times[0]) / (n - 1) * 1000)
    side.seconds += time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6,
                    help="rounds of --concurrency requests (6 x 2 = the 12 prompts of bench-peer)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = default_model_path()
    model, tokenizer = DecoderModel(load_checkpoint(path)), load_tokenizer(path)
    config = SpeculativeConfig("ngram", args.num_speculative_tokens, args.ngram_min, args.ngram_max)
    schedulers = {"plain": Scheduler(Engine(model, 1024, 16), tokenizer),
                  "spec": Scheduler(Engine(model, 1024, 16), tokenizer, speculative=config)}
    for s in schedulers.values():
        s.start()
    params = SamplingParams(max_tokens=args.max_tokens)
    n = args.concurrency
    workloads = {"copy": chat_prompts(tokenizer, copy_messages(n * args.rounds)),
                 "free": chat_prompts(tokenizer, free_messages(n * args.rounds))}
    results: dict[str, dict[str, Side]] = {w: {m: Side() for m in schedulers} for w in workloads}
    try:
        for name, prompts in workloads.items():
            schedulers["spec"].speculator.observers[:] = [results[name]["spec"].observe]
            run_round(schedulers["plain"], prompts[:1], params, Side(), f"warm-{name}")  # untimed warm-up
            for r in range(args.rounds):
                batch = prompts[r * n : (r + 1) * n]
                order = ["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]
                for mode in order:
                    run_round(schedulers[mode], batch, params, results[name][mode], f"{name}-{r}")
    finally:
        for s in schedulers.values():
            s.stop()
    report = {}
    print(f"{'workload':8} {'side':6} {'out tok/s':>10} {'ITL ms':>8} {'accept':>7} {'tok/step':>9}")
    for name, sides in results.items():
        report[name] = {m: side.summary() for m, side in sides.items()}
        for m, summary in report[name].items():
            rate, per_step = summary["acceptance_rate"], summary["tokens_per_verify_step"]
            print(f"{name:8} {m:6} {summary['output_tok_s']:10.1f} {summary['itl_ms_median']:8.1f} "
                  f"{'' if rate is None else f'{rate:.0%}':>7} {'' if per_step is None else f'{per_step:.2f}':>9}")
        ratio = report[name]["spec"]["output_tok_s"] / report[name]["plain"]["output_tok_s"]
        goal = COPY_GOAL if name == "copy" else FREE_GOAL
        report[name]["speedup"] = ratio
        print(f"{name:8} speculative / plain output tok/s = {ratio:.2f}x (goal >= {goal}x): "
              f"{'met' if ratio >= goal else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": report}, indent=1))


if __name__ == "__main__":
    main()
