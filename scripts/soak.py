"""Soak (`make soak`, not part of `make test`): the daemons under a mixed load for a long time,
sampled every `--sample-seconds`, with a verdict on whether anything grows.

Topology (fp32, every daemon with one compute thread): a prefill node, two decode nodes handing
prompts to it (`--prefill`), each with a small pool (`--kv-pages`) and a disk tier
(`--kv-offload-dir`, bounded so it evicts too) and `--admission queue`, and a router over both
with its OpenAI front. Load, one client thread per kind, each sending its next request as soon as
the last one ended, until `--minutes` have passed:

- `chat`: streamed chat completions over HTTP through the router's OpenAI front;
- `long`: 1200-token prompts through the router's Generate, drawn from a fixed set larger than both
  pools, so prompts leave the pools, go to the disk tier and are read back;
- `abort`: a Generate through the router cancelled after a few streamed tokens;
- `migrate`: a Generate on one decode node moved to the other by Migrate mid-stream;
- `prefix_fetch`: a prompt generated on one decode node, then its longer next turn on the other
  naming the first as its `prefix_holder` (SendPrefix writes the prefix over).

Tokens of `long`, `migrate` and `prefix_fetch` are spot-checked against the in-process engine as
fast as one checker thread can (harness/reference.py `greedy_gaps`: each token the greedy choice
given the prompt and the tokens before it, within a logit gap of `TIE`). Sampled per daemon (its
process and the processes it started): resident memory, open file descriptors, threads and
sockets (its gRPC channels and HTTP connections); per decode node: pages out of service (reserved
or quarantined), pages cached and disk-tier files. The verdict: each daemon's memory, descriptors
and threads grow less than `GROWTH_LIMIT` over the second half of the run (the median of the last
tenth of samples against the median of the tenth before the midpoint), every page is back once the
load stops (harness/helpers.py `wait_clean`), no wrong token and no request failed other than as
its kind expects. Writes the samples and the verdict as JSON and a plot (one panel per series).

Usage: python -m scripts.soak [--minutes 120] [--json docs/bench/soak.json] [--plot docs/bench/soak.png]
       python -m scripts.soak --report docs/bench/soak.json > docs/bench/soak.md
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from common.model.default_model import default_model_path
from harness.helpers import greedy, random_ids, wait_clean
from harness.local_daemons import Daemon, decode_node, free_port, prefill_node, router
from harness.reference import FP32, greedy_gaps
from protos.duet.v1 import duet_pb2 as pb
from scripts import run_record

TIE = 1e-3  # a logit this close to the best is as greedy a choice as the best
GROWTH_LIMIT = 0.05
LONG_PROMPTS = [random_ids(1200, seed) for seed in range(24)]  # 24 x 75 pages: more than both pools
CHAT_TOPICS = ["tea", "rivers", "prime numbers", "the moon", "bicycles", "owls", "rain", "bread"]
COUNTED = ("rss_mib", "fds", "threads")  # the series the verdict holds to GROWTH_LIMIT
LABELS = {"rss_mib": "resident memory (MiB)", "fds": "open descriptors", "threads": "threads"}


class ShortAnswer(Exception):
    """A stream that ended OK with fewer tokens than asked for (EOS is ignored)."""


@dataclass
class Tally:
    """What the load did, by kind: requests ended well, failures by status, tokens checked."""
    ok: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    checked: int = 0
    wrong: list[str] = field(default_factory=list)
    unchecked: int = 0  # answers the checker had no time for
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, outcome: str) -> None:
        with self.lock:
            (self.ok if outcome == "ok" else self.failed)[f"{kind}:{outcome}"] += 1


class Soak:
    """The daemons, the load's threads, the checker and the sampler."""

    def __init__(self, tmp: Path, stack: ExitStack) -> None:
        common = (*FP32, "--threads", "1")
        self.pn = stack.enter_context(prefill_node(tmp, *common))
        self.tiers = [tmp / "tier-a", tmp / "tier-b"]
        self.decoders = [stack.enter_context(decode_node(
            tmp, *common, "--prefill", self.pn.address, "--kv-pages", "256", "--kv-offload-dir", str(tier),
            "--kv-offload-gib", "0.2", "--admission", "queue")) for tier in self.tiers]
        self.http_port = free_port()
        self.router = stack.enter_context(router(
            tmp, *[a for d in self.decoders for a in ("--decode", d.address)], "--prefill", self.pn.address,
            "--openai-port", str(self.http_port), "--served-model-name", "duet"))
        self.daemons = {"prefill": self.pn, "decode-a": self.decoders[0], "decode-b": self.decoders[1],
                        "router": self.router}
        self.tally = Tally()
        self.stop = threading.Event()
        self.to_check: queue.Queue[tuple[str, list[int], list[int]]] = queue.Queue(maxsize=4)
        self.model = DecoderModel(load_checkpoint(default_model_path()))

    # -- the load ---------------------------------------------------------------------------------

    def run_load(self, seconds: float, sample_seconds: float) -> list[dict]:
        """Every kind's client and the checker until `seconds` pass; the samples taken meanwhile."""
        loops: dict[str, Callable[[random.Random], None]] = {
            "chat": self._chat, "long": self._long, "abort": self._abort, "migrate": self._migrate,
            "prefix_fetch": self._prefix_fetch}
        threads = [threading.Thread(target=self._loop, args=(kind, one), name=kind, daemon=True)
                   for kind, one in loops.items()]
        threads.append(threading.Thread(target=self._check, name="checker", daemon=True))
        for t in threads:
            t.start()
        samples, start = [], time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            samples.append({"t": round(elapsed, 1), **self.sample()})
            print(f"{elapsed / 60:6.1f} min  ok {sum(self.tally.ok.values())}  failed {dict(self.tally.failed)}  "
                  f"checked {self.tally.checked}  wrong {len(self.tally.wrong)}", flush=True)
            self.stop.wait(min(sample_seconds, seconds - elapsed))
        self.stop.set()
        for t in threads:
            t.join(timeout=120)
        samples.append({"t": round(time.monotonic() - start, 1), **self.sample()})
        return samples

    def _loop(self, kind: str, one: Callable[[random.Random], None]) -> None:
        rng = random.Random(kind)
        while not self.stop.is_set():
            try:
                one(rng)
                self.tally.note(kind, "ok")
            except grpc.RpcError as exc:
                self.tally.note(kind, exc.code().name)
            except (OSError, ShortAnswer) as exc:  # the HTTP client's failures, or an answer cut short
                self.tally.note(kind, type(exc).__name__)

    def _chat(self, rng: random.Random) -> None:
        body = {"model": "duet", "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me about {rng.choice(CHAT_TOPICS)} "
                                                         f"in {rng.randint(2, 9)} words."}]}
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/v1/chat/completions",
                                         json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            if not any(line.strip() == b"data: [DONE]" for line in answer):
                raise OSError("the stream ended without [DONE]")

    def _long(self, rng: random.Random) -> None:
        prompt = rng.choice(LONG_PROMPTS)
        self._generate(self.router, "long", prompt, 8)

    def _abort(self, rng: random.Random) -> None:
        stream = self.router.stub.Generate(pb.GenerateRequest(
            token_ids=random_ids(rng.randint(50, 400), rng.random()), sampling=greedy(64)), timeout=120)
        for i, _ in enumerate(stream):
            if i == 2:
                stream.cancel()
                break

    def _migrate(self, rng: random.Random) -> None:
        source, target = rng.sample(self.decoders, 2)
        prompt, rid = random_ids(rng.randint(100, 500), rng.random()), f"soak-migrate-{rng.random()}"
        stream = source.stub.Generate(pb.GenerateRequest(request_id=rid, token_ids=prompt, sampling=greedy(40)),
                                      timeout=120)
        tokens = []
        for chunk in stream:
            tokens += chunk.token_ids
            if len(tokens) >= 4 and len(tokens) - len(chunk.token_ids) < 4:
                source.stub.Migrate(pb.MigrateRequest(request_id=rid, target_address=target.address), timeout=60)
        self._to_check("migrate", prompt, tokens)

    def _prefix_fetch(self, rng: random.Random) -> None:
        holder, fetcher = rng.sample(self.decoders, 2)
        first = random_ids(rng.randint(300, 600), rng.random())
        self._generate(holder, "prefix_fetch", first, 4, check=False)
        second = first + random_ids(rng.randint(20, 100), rng.random())
        self._generate(fetcher, "prefix_fetch", second, 8,
                       prefix_holder=pb.PrefixHolder(address=holder.address, cached_tokens=len(first)))

    def _generate(self, daemon: Daemon, kind: str, prompt: list[int], n: int, check: bool = True,
                  prefix_holder: pb.PrefixHolder | None = None) -> None:
        tokens = [t for chunk in daemon.stub.Generate(pb.GenerateRequest(
            token_ids=prompt, sampling=greedy(n), prefix_holder=prefix_holder), timeout=300) for t in chunk.token_ids]
        if len(tokens) != n:
            raise ShortAnswer(f"{kind}: {len(tokens)} tokens of {n}")
        if check:
            self._to_check(kind, prompt, tokens)

    def _to_check(self, kind: str, prompt: list[int], tokens: list[int]) -> None:
        try:
            self.to_check.put_nowait((kind, prompt, tokens))
        except queue.Full:
            with self.tally.lock:
                self.tally.unchecked += 1

    def _check(self) -> None:
        torch.set_num_threads(1)
        while not (self.stop.is_set() and self.to_check.empty()):
            try:
                kind, prompt, tokens = self.to_check.get(timeout=1)
            except queue.Empty:
                continue
            gap = max(greedy_gaps(self.model, prompt, tokens))
            with self.tally.lock:
                self.tally.checked += 1
                if gap > TIE:
                    self.tally.wrong.append(f"{kind}: {len(prompt)}-token prompt, tokens {tokens}, gap {gap:.3g}")

    # -- the samples ------------------------------------------------------------------------------

    def sample(self) -> dict[str, dict[str, float]]:
        """Each daemon's processes, and each decode node's pool and tier."""
        out = {name: process_tree_stats(d.proc.pid) for name, d in self.daemons.items()}
        for name, d, tier in (("decode-a", self.decoders[0], self.tiers[0]), ("decode-b", self.decoders[1], self.tiers[1])):
            m = d.metrics()
            out[name] |= {"pages_out": m.get("duet_kv_pages_reserved", 0) + m.get("duet_kv_pages_quarantined", 0),
                          "pages_cached": m.get("duet_kv_pages_cached", 0),
                          "tier_files": sum(1 for _ in tier.rglob("*.kv"))}
        return out

    def sources(self) -> dict[str, dict[str, float]]:
        """Each decode node's prompt tokens by where their KV came from, and its migrations."""
        return {name: {**labelled(d.metrics_text(), "duet_prompt_tokens_total", "source"),
                       **{f"migrations {k}": v for k, v in labelled(d.metrics_text(), "duet_migrations_total", "outcome").items()}}
                for name, d in (("decode-a", self.decoders[0]), ("decode-b", self.decoders[1]))}


def process_tree_stats(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open descriptors, threads and sockets of `pid` and its descendants."""
    stats = Counter()
    for p in _tree(pid):
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
            fds = list(Path(f"/proc/{p}/fd").iterdir())
            sockets = sum(1 for fd in fds if _readlink(fd).startswith("socket:"))
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        stats["rss_mib"] += int(status["VmRSS"].split()[0]) / 1024
        stats["threads"] += int(status["Threads"])
        stats["fds"] += len(fds)
        stats["sockets"] += sockets
    return {k: round(v, 1) for k, v in stats.items()}


def _tree(pid: int) -> list[int]:
    pids, at = [pid], 0
    while at < len(pids):
        for task in Path(f"/proc/{pids[at]}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                pass
        at += 1
    return pids


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""


def labelled(text: str, name: str, label: str) -> dict[str, float]:
    """A Prometheus page's samples of `name`, summed by the value of `label`."""
    out: Counter = Counter()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            fields = dict(part.split("=", 1) for part in labels.split(","))
            out[fields.get(label, "").strip('"')] += float(value)
    return dict(out)


def growth(values: list[float]) -> float:
    """How much a series grew over the second half: the median of its last tenth against the median
    of the tenth before its midpoint (medians: a burst at one sample is not growth)."""
    tenth = max(1, len(values) // 10)
    middle = len(values) // 2
    before = statistics.median(values[max(0, middle - tenth):middle] or values[:1])
    return statistics.median(values[-tenth:]) / before - 1 if before else 0.0


def verdict(samples: list[dict], tally: Tally, leaked: str | None) -> list[str]:
    """What misses the soak's goals (empty: it passed)."""
    misses = [f"{name} {series} grew {g:+.1%} over the second half"
              for name in samples[0] if name != "t" for series in COUNTED
              if (g := growth([s[name][series] for s in samples])) >= GROWTH_LIMIT]
    misses += [f"{kind} failed {n}x" for kind, n in tally.failed.items() if kind != "abort:CANCELLED"]
    misses += [f"wrong tokens: {w}" for w in tally.wrong]
    if leaked:
        misses.append(f"pages not returned: {leaked}")
    return misses


def report(record: dict) -> str:
    """A record (the --json file) as the markdown of docs/bench/soak.md."""
    samples, m = record["samples"], record["machine"]
    daemons = [name for name in samples[0] if name != "t"]
    lines = [f"# Soak: {record['minutes']:g} minutes of mixed load", "",
             f"`{record['command']}` (`make soak`), {m['cpu']} ({', '.join(m['flags']) or 'no AVX2'}), "
             f"{m['cpus']} CPUs, commit {record['commit']}. Topology, load and verdict: scripts/soak.py.", "",
             "**Verdict: " + ("pass**" if not record["misses"] else "miss**: " + "; ".join(record["misses"])), "",
             "Each series first / last sample, and its growth over the second half:", "",
             "| daemon | " + " | ".join(LABELS[s] for s in COUNTED) + " |",
             "| --- |" + " --- |" * len(COUNTED)]
    for name in daemons:
        cells = [f"{samples[0][name][s]:g} / {samples[-1][name][s]:g} ({record['growth_second_half'][name][s]:+.1%})"
                 for s in COUNTED]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ok = ", ".join(f"{kind.removesuffix(':ok')} {n}" for kind, n in sorted(record["ok"].items()))
    failed = ", ".join(f"{kind} {n}" for kind, n in sorted(record["failed"].items())) or "none"
    lines += ["", f"Requests that ended well, by kind: {ok}; failed: {failed}. Tokens checked against "
              f"the in-process engine: {record['checked']} answers ({record['unchecked']} more the checker had no "
              f"time for), {len(record['wrong'])} wrong.", "",
              "Prompt tokens by where their KV came from, and migrations: " + "; ".join(
                  f"{name} " + ", ".join(f"{k} {v:g}" for k, v in sorted(sources.items()))
                  for name, sources in record["prompt_tokens"].items()) + ".", "",
              "Every page back once the load stopped: "
              + ("no" if any(m.startswith("pages not returned") for m in record["misses"]) else "yes") + ".", "",
              "![memory, descriptors, threads, sockets, pages and tier files of each daemon](soak.png)", ""]
    return "\n".join(lines)


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({k for s in samples for name, v in s.items() if name != "t" for k in v})
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 2.2 * len(series)), sharex=True)
    minutes = [s["t"] / 60 for s in samples]
    names = [name for name in samples[0] if name != "t"]
    for ax, key in zip(axes, series):
        for i, name in enumerate(names):
            if key in samples[0][name]:
                ax.plot(minutes, [s[name][key] for s in samples], label=name, color=f"C{i}")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(names), fontsize=8)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=120.0, help="how long the load runs (default %(default)s)")
    parser.add_argument("--sample-seconds", type=float, default=10.0, help="time between samples (default %(default)s)")
    parser.add_argument("--json", type=Path, default=Path("docs/bench/soak.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/bench/soak.png"))
    parser.add_argument("--report", type=Path, metavar="JSON", help="print a record as markdown, and run nothing")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return
    made_by = {"machine": run_record.machine(), "commit": run_record.git_commit()}  # before: HEAD may move
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        soak = Soak(Path(tmp), stack)
        samples = soak.run_load(args.minutes * 60, args.sample_seconds)
        try:
            wait_clean(*soak.decoders, timeout=60)
            leaked = None
        except AssertionError as exc:
            leaked = str(exc)
        sources = soak.sources()
    tally = soak.tally
    misses = verdict(samples, tally, leaked)
    growths = {name: {series: round(growth([s[name][series] for s in samples]), 4) for series in COUNTED}
               for name in samples[0] if name != "t"}
    record = {"command": " ".join(["python -m scripts.soak", *sys.argv[1:]]), **made_by, "minutes": args.minutes,
              "ok": dict(tally.ok), "failed": dict(tally.failed), "checked": tally.checked,
              "unchecked": tally.unchecked, "wrong": tally.wrong, "prompt_tokens": sources,
              "growth_second_half": growths, "misses": misses, "samples": samples}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    plot(samples, args.plot)
    print(json.dumps({k: v for k, v in record.items() if k != "samples"}, indent=1))
    print("PASS" if not misses else "FAIL:\n  " + "\n  ".join(misses))
    sys.exit(1 if misses else 0)


if __name__ == "__main__":
    main()
