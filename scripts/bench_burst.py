"""A burst of streamed chat requests, all sent at once, against one decode node's OpenAI HTTP front:
what the front does with more clients than it serves at a time, and what that costs in memory.

One decode node at its default flags (the embedded default model, no prefill node) serves
`--openai-port`. A reference request alone first: a streamed chat completion of a fixed short user
message, temperature 0, `--max-tokens` output tokens with EOS ignored. Then, per burst size of
`--counts`, that many copies of the same request at once, each on its own TCP connection (asyncio
and aiohttp), and after each burst one more request alone.

Per burst it prints: responses by status (200, 429, 503, other codes, and reset/no status: the
connection ended before a status line came, by the exception's class); refusals (a status other
than 200) carrying Retry-After; time to refusal (send to status line) p50/p99/max; the served
(200) requests' TTFT and total time p50/p99 and how many streamed exactly the reference's text and
ended with `data: [DONE]` (the others: incomplete, or complete with another text); the resident
memory of the daemon and all its descendant processes just before the burst and at its peak
(sampled every 0.2 s); the request after the burst. Also the CPU model and the git commit;
--output writes the same as JSON.

Usage: python -m scripts.bench_burst [--counts 300,1500] [--max-tokens 64] [--dtype auto] [--output docs/bench/burst.json]
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from common.openai_http.api_server import raise_fd_limit
from harness.local_daemons import decode_node, free_port
from loadgen.percentiles import percentile
from loadgen.text_table import text_table
from scripts import run_record

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=900)  # slow but served requests count as served
SAMPLE_EVERY_S = 0.2
RESET = "reset/no status"
MIB = 1024 * 1024


@dataclass
class Outcome:
    """One request as its client saw it."""
    status: int | None = None  # None: the connection ended before a status line
    error: str | None = None  # the class of the exception that ended the request, if one did
    detail: str | None = None  # that exception's message
    retry_after: str | None = None
    status_s: float | None = None  # send -> status line
    ttft_s: float | None = None  # send -> first content delta
    total_s: float = 0.0  # send -> end of the response (or of the connection)
    text: str = ""
    done: bool = False  # the stream ended with `data: [DONE]`

    def complete(self) -> bool:
        """Served to the end: 200, no error, `data: [DONE]`."""
        return self.status == 200 and self.error is None and self.done

    def exact(self, reference: str) -> bool:
        return self.complete() and self.text == reference


def request_body(max_tokens: int) -> bytes:
    return json.dumps({"messages": MESSAGES, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()


def wait_http_ready(base_url: str, timeout: float = 60.0) -> None:
    """Wait until the HTTP front answers /health with 200."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health not 200 after {timeout}s")
        time.sleep(0.2)


async def read_stream(resp: aiohttp.ClientResponse, out: Outcome, began: float) -> None:
    """The content deltas of a server-sent event stream into `out`, until `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line.removeprefix("data:").strip()
        if payload == "[DONE]":
            out.done = True
            return
        for choice in json.loads(payload).get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - began
                out.text += piece


def error_name(exc: BaseException) -> str:
    """The exception's class, and its errno's name where it has one: "ClientOSError ECONNRESET"."""
    code = getattr(exc, "errno", None)
    return f"{type(exc).__name__} {errno.errorcode[code]}" if code in errno.errorcode else type(exc).__name__


async def send(session: aiohttp.ClientSession, url: str, body: bytes) -> Outcome:
    out = Outcome()
    began = time.monotonic()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            out.status, out.status_s = resp.status, time.monotonic() - began
            out.retry_after = resp.headers.get("Retry-After")
            if resp.status == 200:
                await read_stream(resp, out, began)
            else:
                await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        out.error, out.detail = error_name(exc), str(exc)
    out.total_s = time.monotonic() - began
    return out


async def send_all(url: str, body: bytes, count: int) -> list[Outcome]:
    """`count` copies of the request at once, one TCP connection each."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=CLIENT_TIMEOUT) as session:
        return await asyncio.gather(*(send(session, url, body) for _ in range(count)))


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants (children are listed per thread that forked them)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(map(int, children.read_text().split()))
            except OSError:  # the thread ended
                pass
    return pids


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process ended
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    return sum(rss_bytes(p) for p in tree_pids(pid))


class PeakRss:
    """The peak of `tree_rss_bytes(pid)`, sampled on a thread of its own while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss_bytes(self.pid))


def quantiles(values: list[float], qs: tuple[float, ...], scale: float = 1.0) -> dict[str, float] | None:
    """{"p50": ..., "max": ...} of `values` times `scale`; None without values."""
    if not values:
        return None
    return {"max" if q == 100 else f"p{q:g}": percentile(values, q) * scale for q in qs}


def alone(url: str, body: bytes, reference: str) -> dict:
    """One request by itself: its status, latency and whether its text is the reference's."""
    out = asyncio.run(send_all(url, body, 1))[0]
    return {"status": out.status or out.error, "s": out.total_s, "exact": out.exact(reference)}


def summarize(count: int, outcomes: list[Outcome], reference: str, burst_s: float, idle_rss: int,
              peak_rss: int, after: dict) -> dict:
    codes = Counter(o.status for o in outcomes if o.status is not None)
    refused = [o for o in outcomes if o.status not in (None, 200)]
    served = [o for o in outcomes if o.status == 200]
    complete = [o for o in served if o.complete()]
    with_retry_after = sum(o.retry_after is not None for o in refused)
    return {
        "count": count, "burst_s": burst_s,
        "statuses": {"200": codes[200], "429": codes[429], "503": codes[503],
                     "other": {str(c): n for c, n in sorted(codes.items()) if c not in (200, 429, 503)},
                     RESET: sum(o.status is None for o in outcomes)},
        "errors": dict(Counter(o.error for o in outcomes if o.error is not None).most_common()),
        "error_examples": {o.error: o.detail for o in outcomes if o.error is not None},
        "refusals": len(refused), "refusals_with_retry_after": with_retry_after,
        "retry_after_fraction": with_retry_after / len(refused) if refused else None,
        "retry_after_values": dict(Counter(o.retry_after for o in refused if o.retry_after is not None)),
        "refusal_ms": quantiles([o.status_s for o in refused], (50, 99, 100), 1000),
        "reset_ms": quantiles([o.total_s for o in outcomes if o.status is None], (50, 99, 100), 1000),
        "served": len(served), "served_exact": sum(o.exact(reference) for o in served),
        "served_incomplete": len(served) - len(complete),  # an error or no [DONE]
        "served_other_texts": dict(Counter(o.text for o in complete if o.text != reference).most_common()),
        "served_ttft_s": quantiles([o.ttft_s for o in served if o.ttft_s is not None], (50, 99)),
        "served_total_s": quantiles([o.total_s for o in served], (50, 99)),
        "idle_rss_mib": idle_rss / MIB, "peak_rss_mib": peak_rss / MIB,
        "peak_over_idle": peak_rss / idle_rss if idle_rss else None,
        "after": after,
    }


def run_burst(url: str, body: bytes, count: int, pid: int, reference: str) -> dict:
    idle_rss = tree_rss_bytes(pid)
    print(f"burst of {count} ...", flush=True)
    began = time.monotonic()
    with PeakRss(pid) as rss:
        outcomes = asyncio.run(send_all(url, body, count))
    burst_s = time.monotonic() - began
    return summarize(count, outcomes, reference, burst_s, idle_rss, rss.peak, alone(url, body, reference))


def ms(q: dict[str, float] | None, keys: tuple[str, ...], unit: str, digits: int) -> str:
    return "n/a" if q is None else " / ".join(f"{q[k]:.{digits}f}" for k in keys) + f" {unit}"


def format_burst(r: dict) -> str:
    s, n = r["statuses"], r["count"]
    other = ", ".join(f"{c}: {k}" for c, k in s["other"].items()) or "0"
    errors = ", ".join(f"{e} {k}" for e, k in r["errors"].items())
    fraction = "n/a" if r["retry_after_fraction"] is None else f"{r['retry_after_fraction']:.0%}"
    after = r["after"]
    rows = [
        ["200", str(s["200"])], ["429", str(s["429"])], ["503", str(s["503"])], ["other codes", other],
        [RESET, str(s[RESET])],
        ["errors (by class)", errors or "none"],
        ["refusals with Retry-After", f"{r['refusals_with_retry_after']} of {r['refusals']} ({fraction})"],
        ["time to refusal p50/p99/max", ms(r["refusal_ms"], ("p50", "p99", "max"), "ms", 1)],
        ["time to reset p50/p99/max", ms(r["reset_ms"], ("p50", "p99", "max"), "ms", 1)],
        ["served TTFT p50/p99", ms(r["served_ttft_s"], ("p50", "p99"), "s", 2)],
        ["served total p50/p99", ms(r["served_total_s"], ("p50", "p99"), "s", 2)],
        ["served exact", f"{r['served_exact']} of {r['served']} ({r['served_incomplete']} incomplete, "
                         f"{sum(r['served_other_texts'].values())} other text)"],
        ["idle RSS", f"{r['idle_rss_mib']:.0f} MiB"],
        ["peak RSS", f"{r['peak_rss_mib']:.0f} MiB ({r['peak_over_idle']:.2f}x idle)"],
        ["burst wall time", f"{r['burst_s']:.1f} s"],
        ["request after the burst", f"{after['status']}, {after['s']:.2f} s, exact: {after['exact']}"],
    ]
    return "\n".join(text_table([f"burst of {n}", ""], rows, "<>"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="300,1500", help="comma-separated burst sizes (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default %(default)s)")
    p.add_argument("--dtype", default="auto", help="the node's --dtype (default %(default)s; float32: served answers "
                   "equal the reference token for token, where bf16 may turn a near-tie the other way in another batch)")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    a = p.parse_args(argv)
    counts = [int(c) for c in a.counts.split(",") if c]
    if not counts or min(counts) < 1 or a.max_tokens < 1:
        p.error("--counts: positive integers; --max-tokens >= 1")
    raise_fd_limit()  # every client of a burst holds a socket
    body = request_body(a.max_tokens)
    machine = {"cpu": run_record.machine()["cpu"], "commit": run_record.git_commit()}  # before the run: HEAD may move meanwhile
    with tempfile.TemporaryDirectory(prefix="bench_burst_") as tmp:
        port = free_port()
        with decode_node(Path(tmp), "--openai-port", str(port), "--dtype", a.dtype) as dn:
            base_url = f"http://127.0.0.1:{port}"
            wait_http_ready(base_url)
            url = f"{base_url}/v1/chat/completions"
            ref = asyncio.run(send_all(url, body, 1))[0]
            if not (ref.complete() and ref.text):
                print(f"bench_burst: the reference request failed: {ref}", file=sys.stderr)
                return 1
            bursts = [run_burst(url, body, count, dn.proc.pid, ref.text) for count in counts]
    results = {**machine, "dtype": a.dtype, "max_tokens": a.max_tokens, "messages": MESSAGES,
               "reference": {"text": ref.text, "ttft_s": ref.ttft_s, "total_s": ref.total_s}, "bursts": bursts}
    print(f"cpu: {results['cpu']}; commit {results['commit']}; --dtype {a.dtype}; {a.max_tokens} output tokens per request; "
          f"reference alone: TTFT {ref.ttft_s:.2f} s, total {ref.total_s:.2f} s")
    for burst in bursts:
        print(format_burst(burst))
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
