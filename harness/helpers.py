"""Small utilities several test files share: random prompts, greedy sampling, the status of a
gRPC call, the check that a daemon holds no KV page or request any more, the slots of
kv_append_metadata, and daemons started side by side."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from common.kv.segments import Segments
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import Daemon, free_port


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


def three_calls(dn: Daemon, pn: Daemon, request_id: str, prompt: list[int], max_tokens: int = 8, end: int = -1):
    """PrepareReceive, RemoteSend (when the decode node lacks part of the window) and
    StartGeneration, called by hand: the tokens, the reservation, RemoteSend's answer (None when
    nothing was sent) and the last chunk."""
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=request_id, token_ids=prompt, kv_window_end=end))
    sent = None
    if r.kv_window_end > r.prefix_matched_length:
        sent = pn.stub.RemoteSend(pb.RemoteSendRequest(
            request_id=request_id, token_ids=prompt, kv_window_begin=r.prefix_matched_length,
            kv_window_end=r.kv_window_end, kv_append_metadata=r.kv_append_metadata,
            decode_address=dn.address, transfer_nonce=r.transfer_nonce))
    tokens, last = drain(dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id=request_id, kv_window_begin=r.kv_window_end, sampling=greedy(max_tokens))))
    return tokens, r, sent, last


def no_leak(d: Daemon) -> bool:
    """Every KV page of `d` free or cached, none reserved, and of a sliding group's pages none
    held but for a cached page (by its metrics alone)."""
    m = d.metrics()
    cached = m.get("duet_kv_pages_cached", 0)
    sliding_held = m.get("duet_kv_sliding_pages_total", 0) - m.get("duet_kv_sliding_pages_free", 0)
    return m["duet_kv_pages_free"] + cached == m["duet_kv_pages_total"] and \
        m.get("duet_kv_pages_reserved", 0) == 0 and sliding_held <= cached


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


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


_STUBS = {"decode_node": duet_pb2_grpc.DecodeNodeStub, "prefill_node": duet_pb2_grpc.PrefillNodeStub,
          "router": duet_pb2_grpc.DecodeNodeStub}


class Started:
    """Daemons started side by side: every process starts before any is waited for, so that their
    model loads overlap (what harness/local_daemons.py's context managers, one after the other,
    do in sequence). A prefill node's address is known before it serves, so a decode node naming
    it with --prefill starts at once too:

        with Started(tmp) as s:
            pn = s.spawn("prefill_node", *flags)
            dn = s.spawn("decode_node", *flags, "--prefill", pn.address)
            s.wait()  # both healthy, each with its `stub`

    Leaving the `with` stops every daemon spawned, the last one first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._spawned: list[tuple[str, Daemon, list[str]]] = []

    def spawn(self, module: str, *args: str, env: dict[str, str] | None = None, tls: TlsFiles = TlsFiles(),
              port: int | None = None) -> Daemon:
        d = Daemon(module, list(args), self.tmp / f"{module}_{free_port()}.log", env, tls=tls, port=port)
        self._spawned.append((module, d, list(args)))
        return d

    def wait(self) -> None:
        """Every daemon healthy, with its `stub`; and every decode node's prefill pool has seen the
        prefill nodes its --prefill names (one that was not serving yet when the decode node
        started is only seen at the pool's next poll; until then Generate would prefill locally)."""
        for module, d, _ in self._spawned:
            if getattr(d, "stub", None) is None:
                d.wait_healthy()
                d.stub = _STUBS[module](d.channel)
        for module, d, args in self._spawned:
            if module == "decode_node":
                for address in (args[i + 1] for i, a in enumerate(args[:-1]) if a == "--prefill"):
                    _wait_for_log(d, '"msg": "node healthy"', f'"address": "{address}"')

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        while self._spawned:
            self._spawned.pop()[1].stop()


def _wait_for_log(d: Daemon, *fragments: str, timeout: float = 30.0) -> None:
    """Wait until one line of `d`'s log holds every fragment."""
    deadline = time.monotonic() + timeout
    while not any(all(f in line for f in fragments) for line in d.log_path.read_text().splitlines()):
        assert d.proc.poll() is None, f"{d.log_path.name} exited:\n{d.log_path.read_text()}"
        assert time.monotonic() < deadline, f"{d.log_path.name} never logged {fragments}"
        time.sleep(0.05)


@contextmanager
def started_side_by_side(tmp: Path, *daemons: tuple[str, Sequence[str]]) -> Iterator[tuple[Daemon, ...]]:
    """Daemons given as (module, args), started side by side (`Started`) and yielded healthy, in
    that order; all stopped on leaving."""
    with Started(tmp) as s:
        spawned = tuple(s.spawn(module, *args) for module, args in daemons)
        s.wait()
        yield spawned


@contextmanager
def started_pair(tmp: Path, prefill_args: Sequence[str], decode_args: Sequence[str], *,
                 prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None,
                 tls: TlsFiles = TlsFiles()) -> Iterator[tuple[Daemon, Daemon]]:
    """(decode node, prefill node), started side by side (`Started`), the decode node handing
    prompts to the prefill node (`--prefill` is added to `decode_args`); both stopped on leaving."""
    with Started(tmp) as s:
        pn = s.spawn("prefill_node", *prefill_args, env=prefill_env, tls=tls)
        dn = s.spawn("decode_node", *decode_args, "--prefill", pn.address, env=decode_env, tls=tls)
        s.wait()
        yield dn, pn
