"""The TCP transport's wire format and socket plumbing, shared by its receiver and sender.

One connection per transfer, one frame per layer. The sender sends a layer's K and V runs with
gather I/O (`sendmsg` of the pool's slot views: no staging copy); the receiver checks every run
of the frame against the reservation it was told about, then receives the payload with scatter
I/O (`recvmsg_into` straight into the slots' views). Short runs (a page or two each, below
STAGE_BELOW bytes on average) cost more per view than they carry, so such a frame is gathered
into one buffer where the layer is posted (one indexed copy, like a GPU pool's) and received
into one staging buffer that one indexed copy scatters into the slots, on a helper thread while
the next frame arrives. Wire format (little-endian):

    BEGIN  b"DKV2" | u16 id_len | u64 nonce | request_id
    LAYER  u8 3 | u16 layer | u32 num_runs | num_runs * (u64 dst_slot, u32 num_slots)
           | the K rows of every run, in run order | then their V rows
    END    u8 2
    reply  u8 gRPC status code (0 ok) | u32 msg_len | msg   (sent once, after END or on error)

A pool in GPU memory goes through host memory. The sender gathers a layer's pieces on the
device into one buffer (cuda/paged_kv.py: one kernel, not a copy per piece), copies it to pinned
host memory without blocking the forward thread, and its sender thread waits for that copy
before sending the layer. The receiver lands each frame's payload in pinned host memory and
scatters it into the slots with one indexed copy.
"""
from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import numpy as np
import torch

from common.errors import ErrorCode
from common.kv.pool import KVPool
from common.transports.pieces import Piece
from cuda.paged_kv import gather_from_slots

MAGIC = b"DKV2"
BEGIN = struct.Struct("<4sHQ")
OP = struct.Struct("<B")
LAYER = struct.Struct("<HI")
RUNS = np.dtype([("slot", "<u8"), ("n", "<u4")])  # a LAYER frame's runs
REPLY = struct.Struct("<BI")
OP_END, OP_LAYER = 2, 3
# Buffers per sendmsg / recvmsg_into call (Linux allows 1024): a call moves at most what the
# socket buffer holds, and passing many more views than that costs Python time on every call.
IOV_BATCH = 64
# A frame whose runs average fewer bytes than this lands in one staging buffer and is then
# scattered with one indexed copy: cheaper than receiving into many small slot views.
STAGE_BELOW = 64 * 1024


def recv_exact(sock: socket.socket, buf: memoryview, alive: Callable[[], bool] | None = None) -> None:
    """Fill `buf`. With `alive`, a socket timeout is a chance to give up on a stalled writer
    whose reservation is gone; without it, a timeout is an error."""
    while buf.nbytes:
        try:
            n = sock.recv_into(buf)
        except TimeoutError:
            if alive is not None and alive():
                continue
            raise ConnectionError("the writer stalled and its reservation is gone") from None
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        buf = buf[n:]


def recv_into_all(sock: socket.socket, views: list[memoryview], alive: Callable[[], bool]) -> None:
    """Fill `views` in order with scatter I/O (a stall is handled as in `recv_exact`)."""
    i = 0
    while i < len(views):
        try:
            n = sock.recvmsg_into(views[i : i + IOV_BATCH])[0]
        except TimeoutError:
            if alive():
                continue
            raise ConnectionError("the writer stalled and its reservation is gone") from None
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        i = _advance(views, i, n)


def send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send `views` in order with gather I/O."""
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_BATCH]))


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Consume `n` bytes from `views[i:]`; the index of the first view not yet complete."""
    while n and i < len(views):
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i], n = views[i][n:], 0
    while i < len(views) and not views[i].nbytes:
        i += 1
    return i


def slot_views(layer_kv: memoryview, slot_bytes: int, runs: list[tuple[int, int]]) -> list[memoryview]:
    """Views of the (start, num_slots) runs of one (layer, K|V), given as bytes."""
    return [layer_kv[start * slot_bytes : (start + n) * slot_bytes] for start, n in runs]


def recv_struct(sock: socket.socket, st: struct.Struct, alive: Callable[[], bool] | None = None) -> tuple:
    raw = bytearray(st.size)
    recv_exact(sock, memoryview(raw), alive)
    return st.unpack(raw)


def writable_bytes(t: torch.Tensor) -> memoryview:
    # Through uint8: numpy has no bfloat16, and a socket moves bytes anyway.
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def through_host(pool: KVPool) -> bool:
    """Whether the pool's bytes are staged in host memory: a socket cannot reach GPU memory."""
    return pool.storage.is_cuda


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """Host memory for `like`'s bytes; pinned for a GPU tensor, so copies to and from it are DMA."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


def gather_rows(pool: KVPool, layer: int, pieces: list[Piece]) -> torch.Tensor:
    """`[2, rows, heads, head_dim]`: the layer's K and V at the pieces' source slots, in order."""
    slots = torch.cat([torch.arange(p.src_slot, p.src_slot + p.num_slots) for p in pieces])
    return gather_from_slots(pool.layer_kv(layer), slots)


def at_least(buffer: torch.Tensor | None, like: torch.Tensor, numel: int) -> torch.Tensor:
    """`buffer` if it holds `numel` elements, else a new flat one of `like`'s dtype that does."""
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    return like.new_empty(numel)


def stage_on_host(pool: KVPool, layer: int, pieces: list[Piece]) -> tuple[torch.Tensor, Callable[[], None]]:
    """`[2, rows, heads, head_dim]` host copy of the layer's K/V at the pieces' source slots (in
    piece order), and a function that waits until the copy has landed. Called on the forward
    thread, so the gather is queued after the layer's compute on the same stream."""
    gathered = gather_rows(pool, layer, pieces)
    host = host_buffer(gathered)
    host.copy_(gathered, non_blocking=gathered.is_cuda)
    if not gathered.is_cuda:
        return host, lambda: None
    copied = torch.cuda.Event()
    copied.record()
    return host, copied.synchronize


def reply(conn: socket.socket, code: ErrorCode, message: str) -> None:
    body = message.encode()
    try:
        conn.sendall(REPLY.pack(code.value, len(body)) + body)
    except OSError:
        pass
