"""Chaos matrix (`make chaos`, not part of `make test`): fault points x transports with the real
daemons, one decode node and one prefill node per transport (harness/local_daemons.py), fp32.

Every cell runs one faulted request, waits until the decode node's pool has nothing out of service
(no reserved and no quarantined pages), restarts the node it killed (the prefill node on the same
port, so the decode node's `--prefill` address still names it; the decode node on the same port
too), then runs one more request, which must give exact tokens, and finally checks that neither
pool leaked a page (free + cached == total, nothing reserved, quarantined or running, for 0.3 s).
Expected tokens are the in-process engine's greedy continuation (harness/reference.py
`engine_greedy`); a GetLoad poller (every 50 ms) records the decode node's pages out of service.

Cells, and how each fault is timed (GetTrace on the prefill node is polled every 10 ms for the
faulted request; 300-token prompts, prefilled in 32-token chunks, 30 layers each, so the
prefill node posts 300 per-layer writes per request):

- `kill-pn-at-hand-off`: Generate; SIGKILL the prefill node as soon as the decode node's GetLoad
  (polled every 2 ms) shows the hand-off's reservation, i.e. as PrepareReceive answers and
  RemoteSend is sent (killing it before Generate is no hand-off at all: the decode node notices
  a dead prefill node at once and prefills locally). Generate must fall back to local prefill.
- `kill-pn-mid-layer`: Generate; SIGKILL once 40 `transfer_layer_done` events are in the prefill
  node's trace (partway through the second chunk's layers).
- `kill-pn-before-complete`: Generate; SIGKILL as soon as `prefilled` is traced, i.e. between the
  last chunk and CompleteTransfer (the cell reports whether the decode node then lacked
  `transfer_complete`: that is where the kill landed).
- `kill-pn-after-complete`: Generate; SIGKILL as soon as `completion_sent` is traced.
- `abort-after-prepare`, `abort-mid-layer`, `abort-before-complete`, `abort-after-complete`: the
  decode node's Abort at the same four points, driven as a client of the three calls
  (PrepareReceive / RemoteSend / StartGeneration): right after PrepareReceive answered (before
  RemoteSend), at 40 `transfer_layer_done`, at `prefilled`, and after RemoteSend returned
  (CompleteTransfer done, before StartGeneration). The aborted request does not complete, by
  design; its StartGeneration must be NOT_FOUND.
- `kill-dn-mid-stream`: Generate with 64 tokens; SIGKILL the decode node after 4 streamed tokens.
  A client of the decode node itself sees its stream break with UNAVAILABLE; through the router
  (`--migration-limit`, tests/daemons/test_crash_continuation.py) it continues on another decode node.

Usage: python -m scripts.chaos [--transports nixl,tcp] [--cells a,b] [--json FILE] [--log-dir DIR]
       python -m scripts.chaos --load ...  (chaos under load: scripts/chaos_load.py)
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from loadgen.text_table import markdown_table
from harness.local_daemons import Daemon
from harness.reference import FP32, engine_greedy
from harness.helpers import Background, drain, greedy, status_of

TRANSPORTS = ("nixl", "tcp")
PROMPT_TOKENS = 300
NEW_TOKENS = 8
STREAM_TOKENS = 64  # kill-dn-mid-stream: long enough to be killed mid-stream
MID_LAYER_EVENTS = 40
LEASE_S, QUARANTINE_S, TRANSFER_TIMEOUT_S = 8, 60, 10
SETTLE_TIMEOUT_S = QUARANTINE_S + 15  # longer than a quarantine: a slow fence is told from a leak
RPC_TIMEOUT_S = 60.0


def prefill_args(transport: str) -> list[str]:
    return [*FP32, "--transport", transport, "--threads", "1", "--max-batch-tokens", "32",
            "--transfer-timeout-seconds", str(TRANSFER_TIMEOUT_S)]


def decode_args(transport: str, prefill_address: str) -> list[str]:
    return [*FP32, "--transport", transport, "--threads", "1", "--kv-pages", "64",
            "--lease-seconds", str(LEASE_S), "--quarantine-seconds", str(QUARANTINE_S),
            "--prefill", prefill_address, "--min-remote-prefill-tokens", "64"]


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(100, 40000), k=PROMPT_TOKENS)


# ---------------------------------------------------------------------------------------------
# Daemons


class Nodes:
    """The prefill node `pn` and decode node `dn` of one transport; a killed one is restarted on
    its port."""

    def __init__(self, transport: str, log_dir: Path) -> None:
        self.transport, self.log_dir = transport, log_dir
        self.pn = self._spawn("prefill_node", prefill_args(transport))
        self.dn = self._spawn("decode_node", decode_args(transport, self.pn.address))

    def _spawn(self, module: str, args: list[str], port: int | None = None) -> Daemon:
        name = f"{self.transport}_{module}_{len(list(self.log_dir.glob(f'{self.transport}_{module}_*')))}.log"
        return Daemon(module, args, self.log_dir / name, port=port)

    def ready(self) -> None:
        for d, stub_class in ((self.pn, duet_pb2_grpc.PrefillNodeStub), (self.dn, duet_pb2_grpc.DecodeNodeStub)):
            if getattr(d, "stub", None) is None:
                d.wait_healthy()
                d.stub = stub_class(d.channel)
        time.sleep(1.5)  # the decode node's prefill pool polls every second: let it see the prefill node

    def kill(self, d: Daemon) -> float:
        """SIGKILL `d`; the monotonic time it was sent."""
        d.proc.send_signal(signal.SIGKILL)
        at = time.monotonic()
        d.proc.wait(10)
        return at

    def restart_dead(self) -> list[str]:
        """Start whichever node is dead again, on its port; the names of the restarted."""
        restarted = []
        if self.pn.proc.poll() is not None:
            self.pn.stop()
            self.pn = self._spawn("prefill_node", prefill_args(self.transport), self.pn.port)
            restarted.append("prefill")
        if self.dn.proc.poll() is not None:
            self.dn.stop()
            self.dn = self._spawn("decode_node", decode_args(self.transport, self.pn.address), self.dn.port)
            restarted.append("decode")
        if restarted:
            self.ready()
        return restarted

    def close(self) -> None:
        for d in (self.dn, self.pn):
            d.stop()


# ---------------------------------------------------------------------------------------------
# Observing the pools and the traces


def pool_problem(d: Daemon) -> str | None:
    """None when every page of `d` is free or cached and nothing is reserved, fenced or running."""
    load = d.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    if (load.kv_pages_free + load.kv_pages_cached == load.kv_pages_total and not load.kv_pages_reserved
            and not load.kv_pages_quarantined and not load.running_requests):
        return None
    return (f"total={load.kv_pages_total} free={load.kv_pages_free} cached={load.kv_pages_cached} "
            f"reserved={load.kv_pages_reserved} quarantined={load.kv_pages_quarantined} "
            f"running={load.running_requests}")


def settle(*daemons: Daemon, timeout: float = SETTLE_TIMEOUT_S, hold: float = 0.3) -> str | None:
    """Wait until every pool is whole for `hold` seconds; what is still wrong after `timeout`."""
    deadline, whole_since = time.monotonic() + timeout, None
    while True:
        problems = [f"{d.address}: {p}" for d in daemons if (p := pool_problem(d)) is not None]
        now = time.monotonic()
        whole_since = None if problems else (whole_since or now)
        if whole_since is not None and now - whole_since >= hold:
            return None
        if now > deadline:
            return "; ".join(problems)
        time.sleep(0.05)


class PoolWatch:
    """Polls the decode node's GetLoad every 50 ms: (monotonic time, reserved, quarantined)."""

    def __init__(self, dn: Daemon) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stub, self._stop = dn.stub, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                load = self._stub.GetLoad(pb.GetLoadRequest(), timeout=1)
            except grpc.RpcError:
                continue  # the decode node is dead
            self.samples.append((time.monotonic(), load.kv_pages_reserved, load.kv_pages_quarantined))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> tuple[int, int]:
        """The most pages out of service (reserved + quarantined) and quarantined at once."""
        return (max((r + q for _, r, q in self.samples), default=0), max((q for _, _, q in self.samples), default=0))

    def seconds_until_whole(self, fault_at: float) -> float | None:
        """From the fault to the first sample after the last one with pages out of service."""
        after = [(t, r + q) for t, r, q in self.samples if t >= fault_at]
        if not after:
            return None
        busy = [i for i, (_, out) in enumerate(after) if out]
        if not busy:
            return 0.0
        return (after[busy[-1] + 1][0] if busy[-1] + 1 < len(after) else after[-1][0]) - fault_at


def events(d: Daemon, rid: str) -> list[pb.TraceEvent]:
    return list(d.stub.GetTrace(pb.GetTraceRequest(request_ids=[rid]), timeout=5).events)


def count(evs: list[pb.TraceEvent], name: str) -> int:
    return sum(e.name == name for e in evs)


def wait_for_event(d: Daemon, rid: str, name: str, times: int = 1, timeout: float = 30.0) -> bool:
    """Poll `d`'s trace of `rid` every 10 ms until `name` was recorded `times` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if count(events(d, rid), name) >= times:
            return True
        time.sleep(0.01)
    return False


def fence_log(log: Path, offset: int) -> str:
    """What the decode node logged after byte `offset` about fences coming down: lifted on proof
    (writers.py) or at the end of a quarantine (lease_sweeper.py)."""
    lifted, expired = 0, 0
    with open(log, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            if "write fences lifted" in line:
                lifted += json.loads(line).get("pages", 0)
            elif "leave quarantine" in line:
                expired += json.loads(line).get("fences", 0)
    return "".join(([f"; fences lifted on proof: {lifted} pages"] if lifted else [])
                   + ([f"; **quarantine expired: {expired} fences**"] if expired else []))


def handed_off(dn: Daemon, rid: str) -> str:
    """How Generate prefilled `rid`: 'remote', 'fallback' (the hand-off failed) or 'local'."""
    spans = [e for e in events(dn, rid) if e.name == "remote_prefill"]
    if not spans:
        return "local"
    return "remote" if json.loads(spans[-1].args_json or "{}").get("prefill") else "fallback"


# ---------------------------------------------------------------------------------------------
# Cells


@dataclass
class Outcome:
    """What a cell's faulted request did."""
    summary: str
    fault_at: float
    completed: bool = False
    exact: bool | None = None  # None: it produced no tokens to compare
    note: str = ""


@dataclass
class Cell:
    name: str
    fault: str
    driver: str  # "Generate --prefill" or "three calls"
    timing: str
    run: Callable[[Nodes, str, list[int], Callable[[int], list[int]]], Outcome]
    needs: str = ""


def _generate(dn: Daemon, rid: str, ids: list[int], n: int = NEW_TOKENS):
    return dn.stub.Generate(pb.GenerateRequest(request_id=rid, token_ids=ids, sampling=greedy(n)),
                            timeout=RPC_TIMEOUT_S)


def _generate_outcome(nodes: Nodes, rid: str, ids: list[int], want: list[int], call: Background,
                      fault_at: float, note: str = "") -> Outcome:
    code, result, _ = call.result()
    if code != grpc.StatusCode.OK:
        return Outcome(f"Generate {code.name}", fault_at, note=note)
    tokens, _ = result
    how = handed_off(nodes.dn, rid)
    return Outcome(f"Generate OK ({how} prefill)", fault_at, True, tokens == want, note)


def kill_pn_at_hand_off(nodes: Nodes, rid: str, ids: list[int], ref: Callable[[int], list[int]]) -> Outcome:
    call = Background(lambda: drain(_generate(nodes.dn, rid, ids)))
    deadline = time.monotonic() + 30
    while not nodes.dn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_pages_reserved and time.monotonic() < deadline:
        time.sleep(0.002)
    seen = [e.name for e in events(nodes.pn, rid)]
    fault_at = nodes.kill(nodes.pn)
    note = "prefill node had traced " + (", ".join(dict.fromkeys(seen)) or "nothing")
    return _generate_outcome(nodes, rid, ids, ref(NEW_TOKENS), call, fault_at, note)


def _kill_pn_on(event: str, times: int = 1):
    def run(nodes: Nodes, rid: str, ids: list[int], ref: Callable[[int], list[int]]) -> Outcome:
        call = Background(lambda: drain(_generate(nodes.dn, rid, ids)))
        reached = wait_for_event(nodes.pn, rid, event, times)
        seen = events(nodes.pn, rid)
        fault_at = nodes.kill(nodes.pn)
        note = (f"{count(seen, 'transfer_layer_done')} layers done" if reached
                else f"{event} never traced: killed late")
        out = _generate_outcome(nodes, rid, ids, ref(NEW_TOKENS), call, fault_at, note)
        decode_saw = count(events(nodes.dn, rid), "transfer_complete")
        out.note += ", decode node had " + ("transfer_complete" if decode_saw else "no transfer_complete")
        return out
    return run


def _abort(nodes: Nodes, rid: str) -> str:
    return status_of(lambda: nodes.dn.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)).name


def _remote_send(nodes: Nodes, rid: str, ids: list[int], r: pb.PrepareReceiveResponse):
    return nodes.pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id=rid, token_ids=ids, kv_window_begin=r.kv_window_begin, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=nodes.dn.address, transfer_nonce=r.transfer_nonce),
        timeout=RPC_TIMEOUT_S)


def _start_code(nodes: Nodes, rid: str, r: pb.PrepareReceiveResponse) -> str:
    return status_of(lambda: nodes.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id=rid, kv_window_begin=r.kv_window_end, sampling=greedy(NEW_TOKENS)), timeout=10)).name


def _abort_on(event: str | None, times: int = 1):
    """Abort after PrepareReceive (`event` "prepared"), at a traced prefill event, or after
    RemoteSend returned (`event` None)."""
    def run(nodes: Nodes, rid: str, ids: list[int], ref: Callable[[int], list[int]]) -> Outcome:
        r = nodes.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=ids), timeout=10)
        note = ""
        if event == "prepared":
            fault_at, abort = time.monotonic(), _abort(nodes, rid)
            send_code = status_of(lambda: _remote_send(nodes, rid, ids, r)).name
        elif event is None:
            send_code = status_of(lambda: _remote_send(nodes, rid, ids, r)).name
            fault_at, abort = time.monotonic(), _abort(nodes, rid)
        else:
            send = Background(lambda: _remote_send(nodes, rid, ids, r))
            reached = wait_for_event(nodes.pn, rid, event, times)
            note = f"{count(events(nodes.pn, rid), 'transfer_layer_done')} layers done" if reached \
                else f"{event} never traced: aborted late"
            fault_at, abort = time.monotonic(), _abort(nodes, rid)
            send_code = send.result()[0].name
        summary = f"Abort {abort}, RemoteSend {send_code}, StartGeneration {_start_code(nodes, rid, r)}"
        return Outcome(summary, fault_at, note=note)
    return run


def kill_dn_mid_stream(nodes: Nodes, rid: str, ids: list[int], ref: Callable[[int], list[int]]) -> Outcome:
    stream = _generate(nodes.dn, rid, ids, STREAM_TOKENS)
    tokens: list[int] = []
    fault_at = 0.0
    try:
        for chunk in stream:
            tokens += chunk.token_ids
            if len(tokens) >= 4 and not fault_at:
                fault_at = nodes.kill(nodes.dn)
        summary = "stream ended without an error"
    except grpc.RpcError as exc:
        summary = f"stream broke: {exc.code().name}"
    exact = tokens == ref(STREAM_TOKENS)[:len(tokens)] if tokens else None
    return Outcome(summary, fault_at, len(tokens) == STREAM_TOKENS, exact,
                   f"{len(tokens)} of {STREAM_TOKENS} tokens before the break, exact prefix: {exact}")


GEN, CALLS = "Generate --prefill", "three calls"
CELLS = [
    Cell("kill-pn-at-hand-off", "SIGKILL prefill node before PrepareReceive answers", GEN,
         "when the reservation shows in GetLoad", kill_pn_at_hand_off),
    Cell("kill-pn-mid-layer", "SIGKILL prefill node mid-layer", GEN,
         f"at {MID_LAYER_EVENTS} transfer_layer_done", _kill_pn_on("transfer_layer_done", MID_LAYER_EVENTS)),
    Cell("kill-pn-before-complete", "SIGKILL prefill node before CompleteTransfer", GEN,
         "at `prefilled` (approx.)", _kill_pn_on("prefilled")),
    Cell("kill-pn-after-complete", "SIGKILL prefill node after CompleteTransfer", GEN,
         "at `completion_sent`", _kill_pn_on("completion_sent")),
    Cell("abort-after-prepare", "Abort before RemoteSend", CALLS,
         "after PrepareReceive answered", _abort_on("prepared")),
    Cell("abort-mid-layer", "Abort mid-layer", CALLS,
         f"at {MID_LAYER_EVENTS} transfer_layer_done", _abort_on("transfer_layer_done", MID_LAYER_EVENTS)),
    Cell("abort-before-complete", "Abort before CompleteTransfer", CALLS,
         "at `prefilled` (approx.)", _abort_on("prefilled")),
    Cell("abort-after-complete", "Abort after CompleteTransfer", CALLS,
         "after RemoteSend returned", _abort_on(None)),
    Cell("kill-dn-mid-stream", "SIGKILL decode node mid-stream", GEN,
         "after 4 streamed tokens", kill_dn_mid_stream, needs="a router continues it"),
]


@dataclass
class Result:
    cell: str
    transport: str
    fault: str
    driver: str
    timing: str
    outcome: str  # of the faulted request
    note: str
    completed: int  # requests completed, of `requests` (the faulted one and the next one)
    requests: int
    exact: bool | None  # every completed request's tokens equal the reference (None: none completed)
    restarted: list[str]
    next_request: str  # after the restart
    leaked: str | None  # None: both pools whole at the end
    peak_out_of_service: int  # decode node: reserved + quarantined pages, most at once
    peak_quarantined: int
    seconds_until_whole: float | None  # fault to nothing out of service on the decode node
    needs: str = ""


def next_request(nodes: Nodes, rid: str, ids: list[int], want: list[int]) -> tuple[str, bool | None]:
    try:
        tokens, _ = drain(_generate(nodes.dn, rid, ids))
    except grpc.RpcError as exc:
        return f"Generate {exc.code().name}", None
    return f"OK ({handed_off(nodes.dn, rid)} prefill)", tokens == want


def run_cell(nodes: Nodes, cell: Cell, index: int, ref: Callable[[list[int], int], list[int]]) -> Result:
    rid, ids = f"{cell.name}-{nodes.transport}", prompt(100 + index)
    dn_log, log_offset = nodes.dn.log_path, nodes.dn.log_path.stat().st_size
    watch = PoolWatch(nodes.dn)
    out = cell.run(nodes, rid, ids, lambda n: ref(ids, n))
    unsettled = settle(nodes.dn) if nodes.dn.proc.poll() is None else None
    watch.stop()
    restarted = nodes.restart_dead()
    next_ids = prompt(200 + index)
    next_summary, next_exact = next_request(nodes, f"{rid}-next", next_ids, ref(next_ids, NEW_TOKENS))
    settling = time.monotonic()
    leaked = settle(nodes.dn, nodes.pn)
    next_summary += f", whole {time.monotonic() - settling:.1f} s after it"
    fences = fence_log(dn_log, log_offset) + (fence_log(nodes.dn.log_path, 0) if "decode" in restarted else "")
    out.note = (out.note + fences).removeprefix("; ")
    if unsettled is not None:
        leaked = f"after the fault: {unsettled}" + (f"; at the end: {leaked}" if leaked else "")
    peak, peak_quarantined = watch.peaks()
    exacts = [e for e in (out.exact if out.completed else None, next_exact) if e is not None]
    return Result(cell.name, nodes.transport, cell.fault, cell.driver, cell.timing, out.summary, out.note,
                  int(out.completed) + int(next_exact is not None), 2, all(exacts) if exacts else None,
                  restarted, next_summary, leaked, peak, peak_quarantined,
                  None if unsettled or not out.fault_at else watch.seconds_until_whole(out.fault_at), cell.needs)


# ---------------------------------------------------------------------------------------------
# Report


def _yes_no(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "**NO**")


def table(results: list[Result]) -> str:
    header = ["cell", "transport", "driven by", "fault timed", "faulted request", "completed", "tokens exact",
              "next request (after restart)", "leaked pages", "peak out of service (quarantined)", "s until whole"]
    rows = []
    for r in results:
        outcome = r.outcome + (f" ({r.note})" if r.note else "") + (f"; {r.needs}" if r.needs else "")
        restarted = f"restarted {', '.join(r.restarted)}; " if r.restarted else ""
        whole = "n/a" if r.seconds_until_whole is None else f"{r.seconds_until_whole:.2f}"
        rows.append([r.cell, r.transport, r.driver, r.timing, outcome, f"{r.completed}/{r.requests}", _yes_no(r.exact),
                     f"{restarted}{r.next_request}", r.leaked or "none",
                     f"{r.peak_out_of_service} ({r.peak_quarantined})", whole])
    return "\n".join(markdown_table(header, rows, "<" * len(header)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--load" in argv:  # the same faults, random, under load: scripts/chaos_load.py
        from scripts.chaos_load import main as chaos_under_load
        return chaos_under_load([a for a in argv if a != "--load"])
    p = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--cells", default=",".join(c.name for c in CELLS), help="comma-separated cell names")
    p.add_argument("--json", type=Path, help="write every cell's result here")
    p.add_argument("--log-dir", type=Path, help="the daemons' logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    cells = [c for c in CELLS if c.name in args.cells.split(",")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="duet-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the daemons need the cores more
    model: DecoderModel | None = None
    references: dict[tuple[int, ...], list[int]] = {}

    def ref(ids: list[int], n: int) -> list[int]:
        key = tuple(ids)
        if len(references.get(key, ())) < n:
            references[key] = engine_greedy(model, ids, max(n, NEW_TOKENS))
        return references[key][:n]

    results, started = [], time.monotonic()
    for transport in args.transports.split(","):
        nodes = Nodes(transport, log_dir)
        try:
            if model is None:  # loads while the daemons do
                model = DecoderModel(load_checkpoint(default_model_path()))
            nodes.ready()
            for i, cell in enumerate(cells):
                index = CELLS.index(cell)
                r = run_cell(nodes, cell, index, ref)
                results.append(r)
                print(f"[{time.monotonic() - started:6.1f}s] {transport} {cell.name}: {r.outcome}; "
                      f"completed {r.completed}/{r.requests}, exact {_yes_no(r.exact)}, leaked {r.leaked or 'none'}, "
                      f"whole after {r.seconds_until_whole}", flush=True)
        finally:
            nodes.close()
    print()
    print(table(results))
    print(f"\n{len(results)} cells in {time.monotonic() - started:.0f} s; daemon logs in {log_dir}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    bad = [r for r in results if r.leaked or r.exact is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
