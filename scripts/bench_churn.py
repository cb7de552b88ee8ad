"""How fragmented a long-running decode node's reservations are: segments per reservation and pages
per segment after thousands of mixed requests, against the real decode node daemon.

The client keeps the node's pool about `--occupancy` full of live reservations (PrepareReceive)
and, one request at a time, creates more or ends a random live one: an Abort (`--abort-rate`) or
the writer's BeginTransfer / CompleteTransfer followed by StartGeneration with one output token,
after which the node caches the prompt's pages. The prefix cache fills the rest of the pool, so
most reservations evict cached pages. Prompts are log-uniform in length up to `--max-prompt`;
some start with one of a few shared "system prompts", some extend an earlier prompt (both hit
the prefix cache). No KV is actually sent: only where the decode node places it matters here.

Reported: the distribution of segments per reservation (`kv_append_metadata[0]`) and of pages
per segment, and PrepareReceive's latency in the churned pool (evictions included).

With `--save-layouts FILE`, at the end (the pool still churned and as full) it reserves a fresh
prompt of each of `--layout-tokens` sizes, churns on, reserves another, and saves their slot
runs for `scripts/bench_transfer.py`'s `churned` layout (as source and destination).

Usage: python -m scripts.bench_churn [--requests N] [--kv-pages P] [--save-layouts FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from loadgen.percentiles import percentiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import decode_node

PAGE_SIZE = 16
VOCAB = (100, 40000)


@dataclass
class Live:
    request_id: str
    tokens: list[int]
    pages: int
    nonce: int
    end: int
    metadata: list[int]


class Churn:
    def __init__(self, stub: duet_pb2_grpc.DecodeNodeStub, args: argparse.Namespace) -> None:
        self.stub, self.args = stub, args
        self.rng = random.Random(args.seed)
        self.system_prompts = [self._random(self.rng.randint(32, 1024)) for _ in range(8)]
        self.finished: list[list[int]] = []
        self.live: list[Live] = []
        self.serial = 0
        self.segments: list[int] = []  # per reservation with at least one slot
        self.reserved_tokens: list[int] = []  # of the same reservations
        self.pages_per_segment: list[int] = []
        self.prepare_ms: list[float] = []  # PrepareReceive latency, client side
        self.counts = Counter()

    def _random(self, n: int) -> list[int]:
        return [self.rng.randrange(*VOCAB) for _ in range(n)]

    def prompt(self) -> list[int]:
        n = int(math.exp(self.rng.uniform(math.log(16), math.log(self.args.max_prompt))))
        kind = self.rng.random()
        if kind < 0.3:
            head = self.rng.choice(self.system_prompts)[:n]
        elif kind < 0.45 and self.finished:
            head = self.rng.choice(self.finished)[:n]
        else:
            head = []
        return head + self._random(n - len(head))

    def live_pages(self) -> int:
        return sum(r.pages for r in self.live)

    def prepare(self, tokens: list[int], record: bool = True) -> Live | None:
        self.serial += 1
        rid = f"churn-{self.serial}"
        try:
            started = time.perf_counter()
            r = self.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=tokens), timeout=30)
            if record:
                self.prepare_ms.append(1e3 * (time.perf_counter() - started))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self.counts["refused"] += 1
            return None
        md = list(r.kv_append_metadata)
        if record and md[0]:
            self.segments.append(md[0])
            self.reserved_tokens.append(r.kv_window_end - r.kv_window_begin)
            for i in range(md[0]):
                start, length = md[1 + 2 * i], md[2 + 2 * i]
                self.pages_per_segment.append((start + length - 1) // PAGE_SIZE - start // PAGE_SIZE + 1)
        self.counts["prefix_hits"] += r.prefix_matched_length > 0
        live = Live(rid, tokens, -(-len(tokens) // PAGE_SIZE), r.transfer_nonce, r.kv_window_end, md)
        self.live.append(live)
        return live

    def end(self, live: Live, abort: bool) -> None:
        self.live.remove(live)
        if abort:
            self.stub.Abort(pb.AbortRequest(request_id=live.request_id), timeout=30)
            self.counts["aborted"] += 1
            return
        if live.metadata[0]:
            self.stub.BeginTransfer(pb.BeginTransferRequest(request_id=live.request_id, transfer_nonce=live.nonce,
                                                            kv_append_metadata=live.metadata), timeout=30)
            self.stub.CompleteTransfer(pb.CompleteTransferRequest(request_id=live.request_id,
                                                                  transfer_nonce=live.nonce), timeout=30)
        sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for _ in self.stub.StartGeneration(pb.StartGenerationRequest(
                request_id=live.request_id, kv_window_begin=live.end, sampling=sampling), timeout=120):
            pass
        self.finished.append(live.tokens)
        self.counts["finished"] += 1

    def run(self, requests: int, record: bool = True) -> None:
        target = self.args.occupancy * self.args.kv_pages
        made = 0
        while made < requests:
            if self.live_pages() < target:
                if self.prepare(self.prompt(), record=record) is None and self.live:
                    self.end(self.rng.choice(self.live), abort=False)
                else:
                    made += 1
            else:
                self.end(self.rng.choice(self.live), abort=self.rng.random() < self.args.abort_rate)

    def probe(self, size: int) -> list[list[int]]:
        """The slot runs of a fresh `size`-token reservation in the churned pool (then aborted)."""
        while self.live and self.live_pages() + -(-size // PAGE_SIZE) > self.args.occupancy * self.args.kv_pages:
            self.end(self.rng.choice(self.live), abort=False)  # the probe counts toward the occupancy
        r = self.prepare(self._random(size + 1), record=False)
        if r is None:
            raise RuntimeError(f"the churned pool cannot hold a {size}-token reservation; use a larger --kv-pages")
        self.end(r, abort=True)
        return [[r.metadata[1 + 2 * i], r.metadata[2 + 2 * i]] for i in range(r.metadata[0])]

    def layouts(self, sizes: list[int]) -> dict[str, dict[str, list[list[int]]]]:
        """For each size, the runs of two reservations some churn apart: (source, destination)."""
        out = {}
        for size in sizes:
            src = self.probe(size)
            self.run(50, record=False)
            out[str(size)] = {"src_segments": src, "dst_segments": self.probe(size)}
        return out


def distribution(values: list[int]) -> str:
    p10, median, p90 = percentiles(values, [10, 50, 90])
    return (f"median {median:g}, mean {statistics.fmean(values):.2f}, "
            f"p10 {p10:g}, p90 {p90:g}, max {max(values)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="reservations to make (default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=2048, help="the decode node's pool (default %(default)s)")
    p.add_argument("--occupancy", type=float, default=0.8, help="pool fraction held by live reservations")
    p.add_argument("--abort-rate", type=float, default=0.2, help="fraction of ended requests that are aborted")
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-layouts", metavar="FILE", help="save churned reservations for bench_transfer")
    p.add_argument("--layout-tokens", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--json", metavar="FILE", help="also write the distributions to FILE")
    args = p.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_churn_") as tmp, \
            decode_node(Path(tmp), "--transport", "tcp", "--verify-kv", "off", "--kv-pages", str(args.kv_pages), "--page-size",
                        str(PAGE_SIZE), "--lease-seconds", "600", "--max-requests", "1024") as dn:
        churn = Churn(dn.stub, args)
        churn.run(args.requests)
        load = dn.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        report(churn, load, args, time.perf_counter() - started)
        if args.save_layouts:
            Path(args.save_layouts).write_text(json.dumps({
                "page_size": PAGE_SIZE, "num_pages": args.kv_pages, "layouts": churn.layouts(args.layout_tokens)}))


def report(churn: Churn, load: pb.NodeLoad, args: argparse.Namespace, seconds: float) -> None:
    seg, pps = churn.segments, churn.pages_per_segment
    print(f"{len(seg)} reservations on a {args.kv_pages}-page pool held {args.occupancy:.0%} full, prompts up to "
          f"{args.max_prompt} tokens; {dict(churn.counts)}; at the end {load.kv_pages_cached} pages cached, "
          f"{load.kv_pages_free} free ({seconds:.0f} s)")
    print(f"segments per reservation: {distribution(seg)}")
    print(f"pages per segment:        {distribution(pps)}")
    lo = 0
    for hi in (256, 1024, 4096):
        sized = [n for n, t in zip(seg, churn.reserved_tokens) if lo < t <= hi]
        if sized:
            print(f"  reservations of {lo + 1}-{hi} tokens ({len(sized)}): segments {distribution(sized)}")
        lo = hi
    p50, p99 = percentiles(churn.prepare_ms, [50, 99])
    print(f"PrepareReceive (gRPC, client side): p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    share_one = sum(1 for s in seg if s == 1) / len(seg)
    print(f"reservations in one segment: {share_one:.0%}; goal median segments <= 2: "
          f"{'PASS' if statistics.median(seg) <= 2 else 'MISS'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"segments_per_reservation": seg, "pages_per_segment": pps,
                                               "reserved_tokens": churn.reserved_tokens,
                                               "counts": dict(churn.counts)}))


if __name__ == "__main__":
    main()
