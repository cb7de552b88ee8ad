"""Small utilities several test files share: random prompts, greedy sampling, the status of a
gRPC call, the check that a daemon holds no KV page or request any more, and the slots of
kv_append_metadata."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from common.kv.segments import Segments
from protos.duet.v1 import duet_pb2 as pb

if TYPE_CHECKING:
    from scripts.local_daemons import Daemon


def random_ids(n: int, seed: int, low: int = 100, high: int = 40000) -> list[int]:
    """`n` token ids drawn uniformly from [low, high), the same ones for the same seed. The default
    range stays clear of SmolLM2's special tokens and inside its vocabulary."""
    return random.Random(seed).choices(range(low, high), k=n)


def greedy(n: int, ignore_eos: bool = True) -> pb.SamplingParams:
    """Greedy sampling of up to `n` tokens; by default past EOS, so exactly `n` come back."""
    return pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)


def call_status(call: Callable[[], Any],
                allowed: Collection[grpc.StatusCode] | None = None) -> tuple[grpc.StatusCode, Any]:
    """Run `call`: a unary call, or one returning a stream, which is then read to its end.
    Returns (OK, the response or the list of chunks) or (the failure's status, the RpcError).
    With `allowed`, a failure must have one of those statuses and a message."""
    try:
        result = call()
        if not hasattr(result, "ListFields"):  # not a message: a response stream
            result = list(result)
        return grpc.StatusCode.OK, result
    except grpc.RpcError as exc:
        if allowed is not None:
            assert exc.code() in allowed, f"undocumented status {exc.code()}: {exc.details()}"
            assert exc.details(), f"{exc.code()} without a message"
        return exc.code(), exc


def status_of(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status of a unary call or of a fully read stream (OK when it did not fail)."""
    return call_status(call)[0]


def leaks(d: Daemon) -> str | None:
    """None when every KV page of `d` is free or in its prefix cache, none is reserved or
    quarantined, and no request is running; otherwise what it still holds. `d.stub` must be set."""
    m = d.metrics()
    total, free, cached = m["duet_kv_pages_total"], m["duet_kv_pages_free"], m.get("duet_kv_pages_cached", 0)
    reserved, quarantined = m.get("duet_kv_pages_reserved", 0), m.get("duet_kv_pages_quarantined", 0)
    running = d.stub.GetLoad(pb.GetLoadRequest(), timeout=5).running_requests
    if free + cached != total or reserved or quarantined or running:
        return (f"{d.address}: total={total} free={free} cached={cached} reserved={reserved} "
                f"quarantined={quarantined} running={running}")
    return None


def wait_clean(*daemons: Daemon, timeout: float = 20.0, hold: float = 0.3) -> None:
    """Wait until no daemon `leaks` anything, and that stays so for `hold` seconds (a request
    between two stages is not mistaken for none). The default timeout outlasts a 2 s lease
    and a 12 s quarantine."""
    deadline = time.monotonic() + timeout
    clean_since = None
    while True:
        problems = [p for d in daemons if (p := leaks(d)) is not None]
        now = time.monotonic()
        if problems:
            clean_since = None
        else:
            clean_since = clean_since or now
            if now - clean_since >= hold:
                return
        assert now < deadline, f"KV pages leaked or requests left running: {problems}"
        time.sleep(0.1)


def wire_slots(metadata: Sequence[int]) -> list[int]:
    """Every slot kv_append_metadata names, in position order (checked as a daemon checks it)."""
    return Segments.from_wire(list(metadata), sum(metadata[2::2]), num_slots=2**62).slots().tolist()


def drain(stream) -> tuple[list[int], pb.GenerationChunk | None]:
    """The tokens of a generation stream, read to its end, and its last chunk."""
    tokens, last = [], None
    for chunk in stream:
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


class Background:
    """Run a blocking gRPC call on a thread; `result()` is (status, response, seconds taken)."""

    def __init__(self, call) -> None:
        self._call, self._out = call, None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            response, code = self._call(), grpc.StatusCode.OK
        except grpc.RpcError as exc:
            response, code = exc, exc.code()
        self._out = (code, response, time.monotonic() - self.started)

    def result(self, timeout: float = 65.0):
        self._thread.join(timeout)
        assert self._out is not None, f"the call did not return within {timeout}s"
        return self._out
