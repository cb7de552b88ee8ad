"""Live migration's pause against re-prefilling the context, side by side in one run.

Two decode nodes started alike on loopback (harness/local_daemons.py): source A and target B.
For each context length L and each repeat, with a fresh random L-token prompt (so neither node's
prefix cache holds it):

1. reference: a greedy Generate of the prompt on A, `--max-tokens` tokens, never migrated;
2. migration: the same Generate on A (its prompt now cached on A: only the source's prefill is
   skipped), read on a thread; after `--migrate-after` tokens, A.Migrate(request_id, B). Measured:
   the pause the client sees (the gap between the arrivals of the last token A streamed and the
   first one B did, both on A's stream), `MigrateResponse.pause_seconds` (A's own view of the same
   gap), the Migrate call's latency, and the KV moved (`tokens_moved`, which must be the whole
   context but its last token: `prefix_matched_length` 0). The stream must equal the reference;
3. re-prefill: on B, the time to first token of a Generate of a fresh random context of the same
   length (prompt + the tokens generated before the migration); B's prefix-hit counter must not move.

Medians over `--repeats`. Goal: at a 4k-token context the pause is at most 0.3x the re-prefill.
Each migration's timeline (A's and B's trace events, GetTrace, on the client's clock: one host)
gives where its pause goes; the medians of its steps are printed under each table.
Goals are informational: the exit status is 0 either way (1 if a stream was not exact).

Usage: python -m scripts.bench_migration [--transport nixl|tcp|both] [--contexts 1000,4000]
       [--repeats N] [--dtype auto|float32|bfloat16] [--quick] [--output-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from common.serving.dtype_choice import resolve_dtype
from loadgen.text_table import aligned_rows
from protos.duet.v1 import duet_pb2 as pb
from scripts.bench_transfer import bytes_per_token, time_to_first_token
from harness.local_daemons import Daemon, decode_node
from harness.helpers import greedy, random_ids

PAUSE_GOAL, GOAL_CONTEXT = 0.3, 4000
HITS = "duet_prefix_cache_hit_tokens_total"
# The migration's timeline: (label, node, event name, the "received" event's rpc).
TIMELINE = (("B: PrepareReceive received", "B", "received", "PrepareReceive"),
            ("B: transfer_started", "B", "transfer_started", None),
            ("B: transfer_complete", "B", "transfer_complete", None),
            ("B: StartGeneration received", "B", "received", "StartGeneration"),
            ("B: generation_start", "B", "generation_start", None),
            ("A: migrated (B's first chunk in)", "A", "migrated", None))


class Stream(threading.Thread):
    """A greedy Generate read to its end on a thread: the tokens, and when (time.time()) the chunk
    carrying each arrived."""

    def __init__(self, node: Daemon, prompt: list[int], request_id: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.call = node.stub.Generate(pb.GenerateRequest(request_id=request_id, token_ids=prompt,
                                                          sampling=greedy(max_tokens)), timeout=600)
        self.tokens: list[int] = []
        self.arrivals: list[float] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.call:
                now = time.time()
                self.tokens += chunk.token_ids
                self.arrivals += [now] * len(chunk.token_ids)
        except grpc.RpcError as exc:
            self.error = exc

    def result(self) -> list[int]:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"Generate failed: {self.error.code().name}: {self.error.details()}")
        return self.tokens


@dataclass
class Measurement:
    pause_ms: float  # client-seen
    pause_seconds_ms: float  # MigrateResponse.pause_seconds
    migrate_call_ms: float
    itl_ms: float  # median gap between the stream's other tokens
    generated: int  # tokens A generated before the migration
    tokens_moved: int
    reprefill_ms: float
    exact: bool
    steps_ms: dict[str, float]  # where the pause went, one step of TIMELINE each


@dataclass
class Row:
    transport: str
    context: int
    repeats: int
    tokens_moved: int
    kv_mb: float
    pause_ms: float
    pause_seconds_ms: float
    migrate_call_ms: float
    itl_ms: float
    reprefill_ms: float
    ratio: float
    exact: str  # "3/3"
    steps_ms: dict[str, float]
    measurements: list[Measurement]


def trace(node: Daemon, request_id: str) -> list[pb.TraceEvent]:
    return list(node.stub.GetTrace(pb.GetTraceRequest(request_ids=[request_id]), timeout=10).events)


def pause_steps(a: Daemon, b: Daemon, request_id: str, last_a: float, first_b: float) -> dict[str, float]:
    """The client-seen pause cut at each TIMELINE event found: ms from the previous point."""
    events = {"A": trace(a, request_id), "B": trace(b, request_id)}
    points = [("client: A's last token", last_a)]
    for label, node, name, rpc in TIMELINE:
        for e in events[node]:
            if e.name == name and (rpc is None or json.loads(e.args_json or "{}").get("rpc") == rpc):
                points.append((label, e.start_unix))
                break
    points.append(("client: B's first token", first_b))
    return {label: 1e3 * (t - prev) for (_, prev), (label, t) in zip(points, points[1:])}


def measure(a: Daemon, b: Daemon, context: int, seed: int, request_id: str, max_tokens: int,
            migrate_after: int) -> Measurement:
    prompt = random_ids(context, seed)
    reference = Stream(a, prompt, f"{request_id}-ref", max_tokens).result()
    stream = Stream(a, prompt, request_id, max_tokens)
    while len(stream.tokens) < migrate_after:
        if not stream.is_alive():
            raise RuntimeError(f"the stream ended after {len(stream.tokens)} tokens, before its migration")
        time.sleep(0.002)
    started = time.perf_counter()
    moved = a.stub.Migrate(pb.MigrateRequest(request_id=request_id, target_address=b.address), timeout=120)
    migrate_call = time.perf_counter() - started
    tokens = stream.result()
    generated = moved.tokens_moved + moved.prefix_matched_length + 1 - context
    if moved.prefix_matched_length or not migrate_after <= generated < max_tokens:
        raise RuntimeError(f"{request_id}: {moved.prefix_matched_length} tokens of B's prefix cache matched, "
                           f"{moved.tokens_moved} moved for a {context}-token prompt: not the whole context")
    t = stream.arrivals
    gaps = [t[i] - t[i - 1] for i in range(1, len(t)) if i != generated]
    pause = t[generated] - t[generated - 1]
    if pause < max(gaps):
        print(f"  warning: {request_id}: a gap of {1e3 * max(gaps):.0f} ms beside the pause of {1e3 * pause:.0f} ms "
              "(another process took the cores?)", flush=True)
    steps = pause_steps(a, b, request_id, t[generated - 1], t[generated])
    hits = b.metrics()[HITS]
    reprefill = time_to_first_token(b.stub, random_ids(context + generated, seed + 1))
    if b.metrics()[HITS] != hits:
        raise RuntimeError(f"{request_id}: the re-prefill hit B's prefix cache: use fresh seeds")
    return Measurement(1e3 * pause, 1e3 * moved.pause_seconds, 1e3 * migrate_call, 1e3 * statistics.median(gaps),
                       generated, moved.tokens_moved, 1e3 * reprefill, tokens == reference, steps)


def bench(transport: str, contexts: list[int], repeats: int, dtype: str, tmp: Path, max_tokens: int,
          migrate_after: int) -> list[Row]:
    flags = ("--transport", transport, "--dtype", dtype, "--kv-pages", "1024")  # 16k positions: 4k with room to spare
    rows, seed = [], 1000 * len(transport)
    with decode_node(tmp, *flags) as a, decode_node(tmp, *flags) as b:
        # Warm-up, not counted: the channels, the transport handshake, both nodes' first forwards.
        measure(a, b, 64, seed, f"warmup-{transport}", max_tokens, migrate_after)
        for context in contexts:
            done = []
            for i in range(repeats):
                seed += 2
                m = measure(a, b, context, seed, f"{transport}-{context}-{i}", max_tokens, migrate_after)
                done.append(m)
                print(f"  {transport} {context:5d} tok #{i}: pause {m.pause_ms:.0f} ms "
                      f"(node: {m.pause_seconds_ms:.0f}), Migrate {m.migrate_call_ms:.0f} ms, "
                      f"{m.tokens_moved} positions moved after {m.generated} "
                      f"tokens, re-prefill {m.reprefill_ms:.0f} ms, ITL {m.itl_ms:.0f} ms, "
                      f"{'exact' if m.exact else 'NOT EXACT'}", flush=True)
            med = lambda f: statistics.median(f(m) for m in done)  # noqa: E731
            moved = round(med(lambda m: m.tokens_moved))
            pause, reprefill = med(lambda m: m.pause_ms), med(lambda m: m.reprefill_ms)
            rows.append(Row(transport, context, repeats, moved, moved * bytes_per_token(getattr(torch, dtype)) / 1e6,
                            pause, med(lambda m: m.pause_seconds_ms), med(lambda m: m.migrate_call_ms),
                            med(lambda m: m.itl_ms), reprefill, pause / reprefill,
                            f"{sum(m.exact for m in done)}/{repeats}",
                            {k: med(lambda m: m.steps_ms.get(k, float("nan"))) for k in done[0].steps_ms}, done))
    return rows


def format_rows(rows: list[Row], dtype: str) -> str:
    lines = []
    for transport in dict.fromkeys(r.transport for r in rows):
        lines.append(f"--transport {transport}, {dtype}, medians of {rows[0].repeats}   pause: client-seen / "
                     f"MigrateResponse.pause_seconds; goal at {GOAL_CONTEXT} tokens: pause / re-prefill "
                     f"<= {PAUSE_GOAL}")
        header = ["context", "pause ms", "node ms", "Migrate ms", "KV MB", "moved", "re-prefill ms", "pause/re-prefill",
                  "ITL ms", "exact", ""]
        table = [[str(r.context), f"{r.pause_ms:.0f}", f"{r.pause_seconds_ms:.0f}", f"{r.migrate_call_ms:.0f}",
                  f"{r.kv_mb:.1f}", str(r.tokens_moved), f"{r.reprefill_ms:.0f}", f"{r.ratio:.2f}x", f"{r.itl_ms:.0f}",
                  r.exact, ("PASS" if r.ratio <= PAUSE_GOAL else "MISS") if r.context == GOAL_CONTEXT else ""]
                 for r in rows if r.transport == transport]
        lines += aligned_rows([header, *table], ">" * (len(header) - 1) + "<")
        lines.append("  where the client-seen pause goes, ms (medians; each step from the previous point):")
        for r in (r for r in rows if r.transport == transport):
            lines.append(f"  {r.context:>5}: " + ", ".join(f"{k} {v:+.0f}" for k, v in r.steps_ms.items()))
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=["nixl", "tcp", "both"], default="both")
    p.add_argument("--contexts", default="1000,4000", help="prompt lengths, comma-separated (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="per context and transport; medians (default 3)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the daemons' --dtype (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX)")
    p.add_argument("--max-tokens", type=int, default=32, help="of each stream (default %(default)s)")
    p.add_argument("--migrate-after", type=int, default=8, help="tokens streamed before Migrate (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="one repeat, 16-token streams migrated after 4")
    p.add_argument("--output-dir", type=Path, help="also write migration.json (every row) there")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.max_tokens, args.migrate_after = 1, 16, 4
    dtype = resolve_dtype("cpu", args.dtype)
    transports = ("nixl", "tcp") if args.transport == "both" else (args.transport,)
    contexts = [int(c) for c in args.contexts.split(",")]
    load_before, started = os.getloadavg()[0], time.perf_counter()
    print(f"two decode nodes, {dtype}, contexts {contexts}, {args.repeats} repeat(s), {args.max_tokens}-token streams "
          f"migrated after {args.migrate_after}; measuring...", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_migration_") as tmp:
        for transport in transports:
            rows += bench(transport, contexts, args.repeats, dtype, Path(tmp), args.max_tokens, args.migrate_after)
    print()
    print(format_rows(rows, dtype))
    load_after = os.getloadavg()[0]
    print(f"total {time.perf_counter() - started:.0f} s; 1-min load average {load_before:.1f} before, {load_after:.1f} "
          "after" + ("; other processes were busy: absolute numbers are noisy"
                     if max(load_before, load_after) > (os.cpu_count() or 1) + 0.5 else ""))
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "migration.json").write_text(json.dumps(
            {"dtype": dtype, "max_tokens": args.max_tokens, "migrate_after": args.migrate_after,
             "rows": [asdict(r) for r in rows]}, indent=2))
    exact = all(r.exact.split("/")[0] == r.exact.split("/")[1] for r in rows)
    if not exact:
        print("a migrated stream differed from its unmigrated reference")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
