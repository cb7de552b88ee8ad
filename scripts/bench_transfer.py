"""KV transfer bandwidth and disaggregated time to first token, side by side in one run.

(A) KV transfer, GB/s, one host. The shape is SmolLM2-135M's (30 layers, 3 KV heads, head dim
64, fp32: 46,080 bytes per token over all layers, K and V) with 16-token pages. For 1k / 4k / 8k
tokens a prefill-shaped pool in this process and a decode-shaped pool in a second process
(multiprocessing ``spawn``, ``UCX_TLS=sm,self``). Three page layouts:
*contiguous*, what a fresh pool's allocator hands out (consecutive pages on both sides, one piece
per layer and K|V), *scattered*, a random page permutation on both sides (the worst case: every
piece is one page, ``pages x 30 layers x 2 (K|V)`` ranges of 12 KiB), both in pools just big
enough, and *churned*: real reservations of a decode node after thousands of mixed requests at
80% occupancy (``python -m scripts.bench_churn --save-layouts``, saved in
docs/bench/churned_layouts.json; one reservation as the source, a later one as the destination,
in pools of the churned node's size). All five methods move the same bytes:

- NIXL path: the product code. ``NixlSender`` (common/transports/nixl/sender.py) opens a transfer, the
  pieces are posted per layer (one prepared NIXL WRITE of page indices per layer, from the sender
  thread) and ``finish`` waits for all; the decode process runs the decode node's
  ``NixlReceiver`` (pool registered once, progress thread polling as while a transfer is due).
  Also reported: the sender thread's CPU time posting one transfer (with UCX shared memory the
  copy itself happens inside the post).
- TCP: the same pieces through ``TcpSender`` / ``TcpTransfer`` into the decode node's
  ``TcpReceiver``, admitted to a window of the reservation's real segments.
- TCP socket: the limit of TCP, one connection per transfer sending the bytes as one contiguous
  buffer (``sendall``) into one contiguous buffer (``recv_into``) of the decode process.
- memcpy: ``torch`` ``copy_`` of one contiguous buffer of the same size, in this process: the limit.
- raw NIXL: one ``NixlInitiator.write`` of a contiguous range of the same size as a single
  descriptor, into the same decode process (no per-layer split, no sender thread).

Before timing, the NIXL path and TCP each move the KV once into a zeroed decode pool, and the
decode process checks (hash) that every destination slot holds its source slot's bytes. Each
number is the median of timed rounds after an untimed warm-up round; the methods alternate
within a round, so load from other processes hits them alike. Goals: NIXL path / raw NIXL at
least 0.8, NIXL path / memcpy at least 0.45 (contiguous), TCP / TCP socket at least 0.7.

(B) Time to first token of a 1,000-token prompt, client side (``Generate`` called to first
chunk, ``max_tokens=1``), with the real daemons on loopback (harness/local_daemons.py): a
prefill node plus a decode node with ``--prefill <it> --min-remote-prefill-tokens 1``
(disaggregated) against a decode node without ``--prefill`` (single node), all with default
settings otherwise. Prompts are random ids in [100, 40000), a different one for every call, so
no prefix cache ever hits. Median of timed calls after one warm-up call each, alternating the
two setups (9 calls each, 3 with --quick); per transport. The prefill node's own histograms give
the mean remote prefill and RemoteSend times. Goal: disaggregated at most 1.05x single node. A
third decode node, the same but ``--verify-kv off``, measures what checking the KV's checksums
costs (goal: at most 3%).

Goals are informational: the exit status is 0 either way.

`--dtype` (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX) sets the pools' and the
daemons' dtype; `--dtype float32` measures the 4-byte pools of earlier runs.

Usage: python -m scripts.bench_transfer [--quick] [--dtype auto|float32|bfloat16] [--json FILE]   (--quick: 1k and 4k tokens, fewer
repetitions, TTFT over NIXL only; about 2 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from common.kv.page_allocator import PageAllocator
from common.kv.segments import Placement, Segments
from common.kv.pool import KVPool
from common.serving.dtype_choice import resolve_dtype
from common.transports.pieces import Piece, plan_pieces
from common.transports import open_receiver, open_sender
from common.transports.connector import KvSender, WriteWindow
from common.transports.fences import WriteFences
from common.transports.nixl.initiator import NixlInitiator
from loadgen.text_table import text_table
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import Daemon, decode_node, prefill_node

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4  # 46,080 in fp32


def bytes_per_token(dtype: torch.dtype) -> int:
    """K and V of one position over all layers in pools of `dtype` (23,040 in bf16)."""
    return BYTES_PER_TOKEN // 4 * torch.empty(0, dtype=dtype).element_size()
TRANSFER_TIMEOUT_S = 60.0
PEER = "bench-decode"  # the senders' key for the decode process
RAW_GOAL, MEMCPY_GOAL, SOCKET_GOAL, TTFT_GOAL = 0.8, 0.45, 0.7, 1.05
CHURNED_LAYOUTS = Path(__file__).resolve().parent.parent / "docs" / "bench" / "churned_layouts.json"
_LENGTH = struct.Struct("<Q")
TTFT_PROMPT_TOKENS = 1000
VERIFY_GOAL = 0.03  # --verify-kv on is the default only if it costs at most this much TTFT


@dataclass
class KvRow:
    layout: str
    tokens: int
    megabytes: float
    descriptors: int  # in all writes of one NIXL-path transfer, pages adjacent on both sides merged
    nixl_path: float  # GB/s
    tcp: float
    tcp_socket: float
    memcpy: float
    raw_nixl: float
    nixl_post_cpu_ms: float  # the NIXL path's sender thread, per transfer
    path_vs_raw: float
    path_vs_memcpy: float
    tcp_vs_socket: float
    raw_verdict: str
    memcpy_verdict: str
    socket_verdict: str


@dataclass
class TtftRow:
    transport: str
    disaggregated_ms: float
    single_node_ms: float
    ratio: float
    verdict: str
    unverified_ms: float  # disaggregated with --verify-kv off
    verify_cost: float  # disaggregated / unverified - 1
    remote_prefill_ms: float  # mean, from the prefill node's histograms
    remote_send_ms: float  # RemoteSend start to confirmed transfer (prefill included)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ---------------------------------------------------------------------------------------------
# (A) the decode process (module level, so that spawn can import it)


def _decode_side(conn: Connection, num_pages: int, segments: list[tuple[int, int]], transports: tuple[str, ...],
                 dtype: torch.dtype, device: str) -> None:
    """Host a decode-shaped pool behind the decode node's receivers of `transports`; answer
    "clear" (zero the pool) and "digest" (hash of the reserved slots in position order)."""
    pool = KVPool(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, num_pages, PAGE_SIZE, dtype, device)
    slots = torch.tensor([s for start, n in segments for s in range(start, start + n)], device=device)

    allocator, lock = PageAllocator(num_pages), threading.RLock()
    window = WriteWindow("bench", 0, Placement(Segments(tuple(segments))), tuple(allocator.allocate(num_pages)),
                         lambda: True)
    fences = WriteFences(allocator, lock, quarantine_seconds=60.0)
    endpoints = [open_receiver(t, pool, fences, "127.0.0.1", "", name=f"{PEER}-{os.getpid()}",
                               transfers_pending=lambda: True) for t in transports]
    for e in endpoints:
        if e.transport == "tcp":  # the one transfer every round makes; NIXL writes unwatched
            e.admit(window)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_plain_receiver, args=(listener, bytearray(len(slots) * bytes_per_token(dtype))),
                     daemon=True).start()
    try:
        infos = [e.info() for e in endpoints]
        for info in infos:
            info.num_slots = pool.num_slots
        conn.send(([info.SerializeToString() for info in infos], listener.getsockname()[1]))
        while (cmd := conn.recv()) != "quit":
            if cmd == "clear":
                pool.data.zero_()
                if pool.data.is_cuda:  # done before the peer's CUDA IPC writes, which no stream orders
                    torch.cuda.synchronize(pool.data.device)
                conn.send(None)
            elif cmd == "digest":
                conn.send(digest(pool.data.index_select(2, slots)))
    except EOFError:
        pass
    finally:
        listener.close()
        for e in endpoints:
            e.close()


def _plain_receiver(listener: socket.socket, buffer: bytearray) -> None:
    """The plain-socket baseline's receiving end: per connection, a length, then that many
    bytes into one contiguous buffer, then a one-byte reply."""
    view = memoryview(buffer)
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            (n,) = _LENGTH.unpack(conn.recv(_LENGTH.size, socket.MSG_WAITALL))
            got = 0
            while got < n:
                got += conn.recv_into(view[got:n])
            conn.sendall(b"k")


def plain_socket_send(port: int, data: memoryview) -> None:
    """One transfer of the plain-socket baseline: connect, send `data`, wait for the reply."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_LENGTH.pack(data.nbytes))
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise RuntimeError("the plain-socket receiver did not confirm")


def digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bytes, whatever its dtype and device."""
    return hashlib.blake2b(t.contiguous().view(torch.uint8).cpu().numpy()).hexdigest()


@contextmanager
def decode_process(num_pages: int, segments: list[tuple[int, int]], transports: tuple[str, ...] = ("nixl", "tcp"),
                   dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> Iterator[tuple[Connection, list[pb.TransportInfo], int]]:
    """The decode process, the infos of its `transports` receivers (a pool of `dtype` on
    `device`) and the port of its plain-socket receiver; always stopped on exit."""
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_decode_side, daemon=True,
                                           args=(theirs, num_pages, segments, transports, dtype, device))
    proc.start()
    theirs.close()  # so that a crashed child reads as EOF here
    try:
        if not ours.poll(120):
            raise TimeoutError("the decode process did not publish its receivers within 120 s")
        infos, port = ours.recv()
        yield ours, [pb.TransportInfo.FromString(b) for b in infos], port
    finally:
        try:
            ours.send("quit")
        except OSError:
            pass
        proc.join(15)
        if proc.is_alive():
            proc.terminate()
            proc.join()


# ---------------------------------------------------------------------------------------------
# (A) this process: the layout, the four methods, the rounds


@dataclass
class Layout:
    src_slots: list[int]  # position order
    dst_segments: list[tuple[int, int]]
    pieces: list[Piece]
    num_pages: int  # of each pool


def scattered_layout(tokens: int, seed: int) -> Layout:
    """Random page permutations on both sides of pools holding exactly `tokens` positions."""
    rng = random.Random(seed)
    pages = list(range(tokens // PAGE_SIZE))
    src_pages, dst_pages = rng.sample(pages, len(pages)), rng.sample(pages, len(pages))
    src_slots, dst_slots = slots_of(src_pages), slots_of(dst_pages)
    dst_segments = list(Segments.of_slots(dst_slots).runs)
    return Layout(src_slots, dst_segments, plan_pieces(src_slots, Segments(tuple(dst_segments))), len(pages))


def contiguous_layout(tokens: int, seed: int) -> Layout:
    """Consecutive pages on both sides, as a fresh pool's allocator gives them."""
    slots = list(range(tokens))
    return Layout(slots, [(0, tokens)], plan_pieces(slots, Segments(((0, tokens),))), tokens // PAGE_SIZE)


def churned_layout(tokens: int, seed: int, path: Path = CHURNED_LAYOUTS) -> Layout | None:
    """Two real reservations of `tokens` positions from a churned decode node (source, then
    destination), in pools of its size; None when none of that size was saved."""
    saved = json.loads(path.read_text())
    pair = saved["layouts"].get(str(tokens))
    if pair is None:
        return None
    src_slots = [s for start, n in pair["src_segments"] for s in range(start, start + n)]
    dst_segments = [(start, n) for start, n in pair["dst_segments"]]
    return Layout(src_slots, dst_segments, plan_pieces(src_slots, Segments(tuple(dst_segments))), saved["num_pages"])


LAYOUTS = {"contiguous": contiguous_layout, "scattered": scattered_layout, "churned": churned_layout}


def slots_of(pages: list[int]) -> list[int]:
    return [p * PAGE_SIZE + o for p in pages for o in range(PAGE_SIZE)]


def push_all_layers(sender: KvSender, layout: Layout, sessions: list | None = None) -> None:
    """One transfer as RemoteSend makes it: open, post every layer's pieces, finish."""
    session = sender.open(PEER, "bench", 0, TRANSFER_TIMEOUT_S)
    for layer in range(NUM_LAYERS):
        session.post_layer(layer, layout.pieces)
    session.finish()
    if sessions is not None:
        sessions.append(session)


def timed_rounds(methods: dict[str, Callable[[], None]], warmup: int, reps: int) -> dict[str, float]:
    """Median seconds per method; the methods alternate within each round."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(warmup + reps):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def check_lands(conn: Connection, move: Callable[[], None], expected: str, what: str) -> None:
    """Zero the decode pool, run one transfer, and compare the reserved slots' hash."""
    conn.send("clear")
    conn.recv()
    move()
    conn.send("digest")
    if conn.recv() != expected:
        raise RuntimeError(f"{what}: the decode pool does not hold the source KV after a transfer")


@contextmanager
def transfer_methods(src: KVPool, layout: Layout, name: str,
                     nixl_sessions: list | None = None) -> Iterator[tuple[Connection, dict[str, Callable[[], None]]]]:
    """A decode process (its pool like `src`'s, both receivers open) and the ways to move `src`'s
    KV for `layout` into it: the NIXL path and TCP as RemoteSend uses them (the NIXL sessions
    appended to `nixl_sessions`), and one raw NIXL write of a contiguous range of the same size.
    Everything is closed on exit."""
    nbytes = len(layout.src_slots) * src.slot_bytes() * 2 * src.num_layers
    with ExitStack() as stack:
        conn, (nixl_info, tcp_info), socket_port = stack.enter_context(decode_process(
            layout.num_pages, layout.dst_segments, ("nixl", "tcp"), src.data.dtype, src.data.device.type))
        nixl = open_sender("nixl", src, f"{name}-prefill")
        stack.callback(nixl.close)
        nixl.connect(PEER, nixl_info)
        tcp = open_sender("tcp", src, "")
        stack.callback(tcp.close)
        tcp.connect(PEER, tcp_info)
        raw = stack.enter_context(NixlInitiator(f"{name}-raw", src.data))
        raw.connect(nixl_info.nixl_agent_name, nixl_info.nixl_agent_metadata)
        whole_src, whole_dst = [(src.data.data_ptr(), nbytes)], [(nixl_info.pool_base_address, nbytes)]
        methods = {
            "nixl_path": lambda: push_all_layers(nixl, layout, nixl_sessions),
            "tcp": lambda: push_all_layers(tcp, layout),
            "raw_nixl": lambda: raw.wait(raw.write(nixl_info.nixl_agent_name, whole_src, whole_dst),
                                         TRANSFER_TIMEOUT_S),
        }
        if not src.data.is_cuda:  # a socket reads host memory only
            contiguous = memoryview(src.data.view(-1).view(torch.uint8).numpy())[:nbytes]
            methods["tcp_socket"] = lambda: plain_socket_send(socket_port, contiguous)
        yield conn, methods


def bench_kv(layout_name: str, tokens: int, warmup: int, reps: int, dtype: torch.dtype = torch.float32) -> KvRow | None:
    """The five methods over the same `tokens` positions, each in its own fresh pools of `dtype`;
    None when the layout has no reservation of that size."""
    layout = LAYOUTS[layout_name](tokens, seed=tokens)
    if layout is None:
        return None
    src = KVPool(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, layout.num_pages, PAGE_SIZE, dtype)
    src.data.uniform_()
    expected = digest(src.data.index_select(2, torch.tensor(layout.src_slots)))
    nbytes = tokens * bytes_per_token(dtype)
    contiguous = src.data.view(-1)[: nbytes // src.data.element_size()]
    copy_dst = torch.empty_like(contiguous)
    sessions: list = []

    with transfer_methods(src, layout, f"bench-{tokens}", sessions) as (conn, methods):
        methods["memcpy"] = lambda: copy_dst.copy_(contiguous)
        check_lands(conn, methods["nixl_path"], expected, "NIXL path")
        check_lands(conn, methods["tcp"], expected, "TCP")
        seconds = timed_rounds(methods, warmup, reps)

    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    vs_raw, vs_memcpy = gbps["nixl_path"] / gbps["raw_nixl"], gbps["nixl_path"] / gbps["memcpy"]
    vs_socket = gbps["tcp"] / gbps["tcp_socket"]
    post_cpu_ms = 1e3 * statistics.median(s.posting_cpu_s for s in sessions[-reps:])
    return KvRow(layout_name, tokens, nbytes / 1e6, NUM_LAYERS * 2 * len(layout.pieces), **gbps,
                 nixl_post_cpu_ms=post_cpu_ms, path_vs_raw=vs_raw, path_vs_memcpy=vs_memcpy, tcp_vs_socket=vs_socket,
                 raw_verdict=verdict(vs_raw >= RAW_GOAL),
                 memcpy_verdict=verdict(vs_memcpy >= MEMCPY_GOAL) if layout_name == "contiguous" else "-",
                 socket_verdict=verdict(vs_socket >= SOCKET_GOAL))


# ---------------------------------------------------------------------------------------------
# (B) TTFT with the real daemons


def random_prompt(rng: random.Random) -> list[int]:
    return rng.choices(range(100, 40000), k=TTFT_PROMPT_TOKENS)


def time_to_first_token(stub: duet_pb2_grpc.DecodeNodeStub, prompt: list[int]) -> float:
    """Seconds from calling Generate to the first chunk carrying a token (stream drained)."""
    sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    for chunk in stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=sampling), timeout=120):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("Generate returned no token")
    return first


def prefill_node_totals(pn: Daemon) -> tuple[float, float, float]:
    """(computed tokens, prefill seconds, RemoteSend seconds) so far, from /metrics."""
    m = pn.metrics()
    return (m["duet_prefill_computed_tokens_total"], m["duet_prefill_seconds_sum"],
            m["duet_remote_send_seconds_sum"])


def bench_ttft(transport: str, single: Daemon, tmp: Path, rng: random.Random, reps: int,
               dtype: str = "auto") -> TtftRow:
    hand_off = ("--dtype", dtype, "--transport", transport, "--min-remote-prefill-tokens", "1")
    with prefill_node(tmp, "--dtype", dtype, "--transport", transport) as pn, \
            decode_node(tmp, *hand_off, "--prefill", pn.address) as dn, \
            decode_node(tmp, *hand_off, "--prefill", pn.address, "--verify-kv", "off") as unverified:
        for stub in (dn.stub, unverified.stub, single.stub):  # warm-up: handshake, first forward
            time_to_first_token(stub, random_prompt(rng))
        before = prefill_node_totals(pn)
        disagg, bare, local = [], [], []
        for _ in range(reps):
            disagg.append(time_to_first_token(dn.stub, random_prompt(rng)))
            bare.append(time_to_first_token(unverified.stub, random_prompt(rng)))
            local.append(time_to_first_token(single.stub, random_prompt(rng)))
        tokens, prefill_s, send_s = (b - a for a, b in zip(before, prefill_node_totals(pn)))
    if tokens < 2 * reps * (TTFT_PROMPT_TOKENS - 1):
        raise RuntimeError(f"the prefill node computed {tokens:.0f} tokens, not the prompts: "
                           "Generate did not hand them over")
    a, b, c = (1e3 * statistics.median(x) for x in (disagg, local, bare))
    return TtftRow(transport, a, b, a / b, verdict(a / b <= TTFT_GOAL), c, a / c - 1,
                   1e3 * prefill_s / (2 * reps), 1e3 * send_s / (2 * reps))


# ---------------------------------------------------------------------------------------------
# Output


def format_table(kv: list[KvRow], ttft: list[TtftRow], kv_reps: int, ttft_reps: int) -> str:
    kv_table = text_table(
        [f"KV transfer, GB/s (median of {kv_reps})", "NIXL path", "raw NIXL", "memcpy", "TCP", "socket", "post CPU",
         f"path/raw (>={RAW_GOAL})", f"path/memcpy (>={MEMCPY_GOAL})", f"TCP/socket (>={SOCKET_GOAL})"],
        [[f"{r.layout[:6]} {r.tokens:>5} tok {r.megabytes:5.0f} MB {r.descriptors:>5} descr", f"{r.nixl_path:.2f}",
          f"{r.raw_nixl:.2f}", f"{r.memcpy:.2f}", f"{r.tcp:.2f}", f"{r.tcp_socket:.2f}", f"{r.nixl_post_cpu_ms:.1f} ms",
          f"{r.path_vs_raw:.2f}x {r.raw_verdict}", f"{r.path_vs_memcpy:.2f}x {r.memcpy_verdict}",
          f"{r.tcp_vs_socket:.2f}x {r.socket_verdict}"] for r in kv],
        "<" + ">" * 6 + "<" * 3)
    ttft_table = text_table(
        [f"TTFT, {TTFT_PROMPT_TOKENS}-tok prompt, ms (median of {ttft_reps})", "disagg", "single",
         f"ratio (<={TTFT_GOAL})", "prefill node: prefill / RemoteSend (mean ms)", "--verify-kv off",
         f"verify cost (<={VERIFY_GOAL:.0%})"],
        [[f"--transport {r.transport}", f"{r.disaggregated_ms:.0f}", f"{r.single_node_ms:.0f}",
          f"{r.ratio:.2f}x {r.verdict}", f"{r.remote_prefill_ms:.0f} / {r.remote_send_ms:.0f}",
          f"{r.unverified_ms:.0f}", f"{r.verify_cost:+.1%} {verdict(r.verify_cost <= VERIFY_GOAL)}"] for r in ttft],
        "<>><<><")
    kv_rule = kv_table[1]
    return "\n".join([*kv_table, kv_rule, *ttft_table])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions, nixl TTFT only")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="of the pools and the daemons; auto = what the daemons' --dtype auto picks here (default)")
    parser.add_argument("--churned-layouts", metavar="FILE", type=Path, default=CHURNED_LAYOUTS,
                        help="reservations saved by `scripts.bench_churn --save-layouts` (default %(default)s)")
    args = parser.parse_args()
    dtype_name = resolve_dtype("cpu", args.dtype)
    dtype = getattr(torch, dtype_name)
    LAYOUTS["churned"] = lambda tokens, seed: churned_layout(tokens, seed, args.churned_layouts)
    os.environ.setdefault("UCX_TLS", "sm,self")  # before any NIXL agent exists, inherited by children
    sizes = (1024, 4096) if args.quick else (1024, 4096, 8192)
    kv_warmup, kv_reps = 1, (3 if args.quick else 7)
    ttft_reps = 3 if args.quick else 9  # a shared VM's speed drifts by a quarter within minutes
    transports = ("nixl",) if args.quick else ("nixl", "tcp")

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype_name} pools, "
          f"UCX_TLS={os.environ['UCX_TLS']}; "
          "measuring...", flush=True)
    kv = []
    for layout_name, tokens in ((name, tokens) for name in LAYOUTS for tokens in sizes):
        if (row := bench_kv(layout_name, tokens, kv_warmup, kv_reps, dtype)) is None:
            continue
        kv.append(row)
        print(f"  KV {layout_name} {tokens:5d} tok: NIXL path {row.nixl_path:.2f}, raw NIXL {row.raw_nixl:.2f}, "
              f"memcpy {row.memcpy:.2f}, TCP {row.tcp:.2f}, TCP socket {row.tcp_socket:.2f} GB/s", flush=True)
    ttft = []
    rng = random.Random(20240601)
    with tempfile.TemporaryDirectory(prefix="bench_transfer_") as tmp:
        with decode_node(Path(tmp), "--dtype", dtype_name) as single:
            for transport in transports:
                ttft.append(row := bench_ttft(transport, single, Path(tmp), rng, ttft_reps, dtype_name))
                print(f"  TTFT {transport}: disaggregated {row.disaggregated_ms:.0f} ms "
                      f"(--verify-kv off {row.unverified_ms:.0f} ms), single node {row.single_node_ms:.0f} ms",
                      flush=True)
    load_after = os.getloadavg()[0]

    print()
    print(format_table(kv, ttft, kv_reps, ttft_reps))
    print(f"\ntotal {time.perf_counter() - started:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{load_after:.1f} after")
    if max(load_before, load_after) > (os.cpu_count() or 1) + 0.5:
        print("warning: other processes were busy on this machine; absolute numbers are noisy "
              "(the methods alternate, so ratios are less affected)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "ucx_tls": os.environ["UCX_TLS"],
                       "dtype": dtype_name, "bytes_per_token": bytes_per_token(dtype), "page_size": PAGE_SIZE,
                       "kv": [asdict(r) for r in kv], "ttft": [asdict(r) for r in ttft]}, f, indent=2)


if __name__ == "__main__":
    main()
