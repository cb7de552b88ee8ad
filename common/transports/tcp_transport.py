"""KV over plain TCP, for machines where NIXL/UCX cannot load.

One connection per transfer, one frame per layer. The sender sends a layer's K and V runs with
gather I/O (`sendmsg` of the pool's slot views: no staging copy); the receiver checks every run
of the frame against the reservation it was told about, then receives the payload with scatter
I/O (`recvmsg_into` straight into the slots' views). Short runs (a page or two each, below
_STAGE_BELOW bytes on average) cost more per view than they carry, so such a frame is gathered
into one buffer where the layer is posted (one indexed copy, like a GPU pool's) and received
into one staging buffer that one indexed copy scatters into the slots, on a helper thread while
the next frame arrives. Wire format (little-endian):

    BEGIN  b"DKV2" | u16 id_len | u64 nonce | request_id
    LAYER  u8 3 | u16 layer | u32 num_runs | num_runs * (u64 dst_slot, u32 num_slots)
           | the K rows of every run, in run order | then their V rows
    END    u8 2
    reply  u8 gRPC status code (0 ok) | u32 msg_len | msg   (sent once, after END or on error)

While a connection writes into a reservation, the receiver holds an extra reference on its
pages (`pin`), so a lease that expires mid-transfer cannot hand those pages to another request
before the writer is done. A writer that goes silent keeps them only while the reservation is
alive: once it is gone, a stall of POLL_S drops the connection and the pin.

A pool in GPU memory goes through host memory. The sender gathers a layer's pieces on the
device into one buffer (cuda/paged_kv.py: one kernel, not a copy per piece), copies it to pinned
host memory without blocking the forward thread, and its sender thread waits for that copy
before sending the layer. The receiver lands each frame's payload in pinned host memory and
scatters it into the slots with one indexed copy.
"""
from __future__ import annotations

import logging
import math
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from common.errors import RequestError
from common.kv.kv_pool import KVPool
from common.transports import TransferError
from common.transports.kv_ranges import Piece
from cuda.paged_kv import gather_from_slots, scatter_to_slots

log = logging.getLogger(__name__)

_MAGIC = b"DKV2"
_BEGIN = struct.Struct("<4sHQ")
_OP = struct.Struct("<B")
_LAYER = struct.Struct("<HI")
_RUNS = np.dtype([("slot", "<u8"), ("n", "<u4")])  # a LAYER frame's runs
_REPLY = struct.Struct("<BI")
_OP_END, _OP_LAYER = 2, 3
# Buffers per sendmsg / recvmsg_into call (Linux allows 1024): a call moves at most what the
# socket buffer holds, and passing many more views than that costs Python time on every call.
_IOV_BATCH = 64
# A frame whose runs average fewer bytes than this lands in one staging buffer and is then
# scattered with one indexed copy: cheaper than receiving into many small slot views.
_STAGE_BELOW = 64 * 1024
MAX_REQUEST_ID_BYTES = 1024
BEGIN_TIMEOUT_S = 10.0  # a connection must say which reservation it writes within this
POLL_S = 1.0  # how often a receiver waiting for bytes checks its reservation is still alive
REFUSAL_WAIT_S = 1.0


@dataclass
class WriteGrant:
    """What the receiver may write for one request: the reservation's destination segments,
    and a callback that drops the pin taken on its pages."""

    segments: list[tuple[int, int]]
    unpin: Callable[[], None]
    alive: Callable[[], bool] = lambda: True  # whether the reservation still exists


# authorize(request_id, nonce) -> WriteGrant, or raises RequestError (its status reaches the sender).
Authorizer = Callable[[str, int], WriteGrant]


def _recv_exact(sock: socket.socket, buf: memoryview, alive: Callable[[], bool] | None = None) -> None:
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


def _recv_into_all(sock: socket.socket, views: list[memoryview], alive: Callable[[], bool]) -> None:
    """Fill `views` in order with scatter I/O (a stall is handled as in `_recv_exact`)."""
    i = 0
    while i < len(views):
        try:
            n = sock.recvmsg_into(views[i : i + _IOV_BATCH])[0]
        except TimeoutError:
            if alive():
                continue
            raise ConnectionError("the writer stalled and its reservation is gone") from None
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        i = _advance(views, i, n)


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send `views` in order with gather I/O."""
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + _IOV_BATCH]))


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


def _slot_views(layer_kv: memoryview, slot_bytes: int, runs: list[tuple[int, int]]) -> list[memoryview]:
    """Views of the (start, num_slots) runs of one (layer, K|V), given as bytes."""
    return [layer_kv[start * slot_bytes : (start + n) * slot_bytes] for start, n in runs]


def _recv_struct(sock: socket.socket, st: struct.Struct, alive: Callable[[], bool] | None = None) -> tuple:
    raw = bytearray(st.size)
    _recv_exact(sock, memoryview(raw), alive)
    return st.unpack(raw)


def _writable_bytes(t: torch.Tensor) -> memoryview:
    # Through uint8: numpy has no bfloat16, and a socket moves bytes anyway.
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _through_host(pool: KVPool) -> bool:
    """Whether the pool's bytes are staged in host memory: a socket cannot reach GPU memory."""
    return pool.data.is_cuda


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """Host memory for `like`'s bytes; pinned for a GPU tensor, so copies to and from it are DMA."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


def _gathered(pool: KVPool, layer: int, pieces: list[Piece]) -> torch.Tensor:
    """`[2, rows, heads, head_dim]`: the layer's K and V at the pieces' source slots, in order."""
    slots = torch.cat([torch.arange(p.src_slot, p.src_slot + p.num_slots) for p in pieces])
    return gather_from_slots(pool.data[layer], slots)


def _at_least(buffer: torch.Tensor | None, like: torch.Tensor, numel: int) -> torch.Tensor:
    """`buffer` if it holds `numel` elements, else a new flat one of `like`'s dtype that does."""
    if buffer is not None and buffer.numel() >= numel:
        return buffer
    return like.new_empty(numel)


def _stage_on_host(pool: KVPool, layer: int, pieces: list[Piece]) -> tuple[torch.Tensor, Callable[[], None]]:
    """`[2, rows, heads, head_dim]` host copy of the layer's K/V at the pieces' source slots (in
    piece order), and a function that waits until the copy has landed. Called on the forward
    thread, so the gather is queued after the layer's compute on the same stream."""
    gathered = _gathered(pool, layer, pieces)
    host = _host_buffer(gathered)
    host.copy_(gathered, non_blocking=gathered.is_cuda)
    if not gathered.is_cuda:
        return host, lambda: None
    copied = torch.cuda.Event()
    copied.record()
    return host, copied.synchronize


class TcpKvReceiver:
    """Decode side: accepts transfers into `pool` for reservations `authorize` vouches for."""

    def __init__(self, pool: KVPool, authorize: Authorizer, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = 64) -> None:
        self.pool = pool
        self._authorize = authorize
        self._listener = socket.create_server((host, port), backlog=max_connections)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False
        threading.Thread(target=self._accept_loop, name="tcp-kv-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _reply(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, "receiver busy: too many concurrent transfers")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tcp-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        grant = None
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(BEGIN_TIMEOUT_S)
                magic, id_len, nonce = _recv_struct(conn, _BEGIN)
                if magic != _MAGIC or id_len > MAX_REQUEST_ID_BYTES:
                    raise ValueError("not a duet KV transfer")
                request_id = bytearray(id_len)
                _recv_exact(conn, memoryview(request_id))
                try:
                    grant = self._authorize(request_id.decode(), nonce)
                except RequestError as exc:
                    _reply(conn, exc.code, str(exc))
                    return
                conn.settimeout(POLL_S)
                self._receive_writes(conn, grant)
                _reply(conn, grpc.StatusCode.OK, "")
        except Exception as exc:  # a broken sender must not take the receiver down
            log.warning("KV transfer failed", extra={"fields": {"error": str(exc)}})
        finally:
            if grant is not None:
                grant.unpin()
            self._slots.release()

    def _receive_writes(self, conn: socket.socket, grant: WriteGrant) -> None:
        """Receive frames until END. A host pool's staged frames are scattered on a helper thread
        (torch's copy runs without the GIL) while the next frame arrives; all are done on return."""
        on_host = not self.pool.data.is_cuda
        scatters = ThreadPoolExecutor(1, thread_name_prefix="tcp-kv-scatter") if on_host else None
        pending: Future | None = None
        buffers: list[torch.Tensor | None] = [None, None]
        try:
            for layer, slot, n in self._frames(conn, grant):
                if not (_through_host(self.pool) or int(n.sum()) * self.pool.slot_bytes() < _STAGE_BELOW * len(n)):
                    sb, pairs = self.pool.slot_bytes(), list(zip(slot.tolist(), n.tolist()))
                    views = [view for kv in (0, 1)
                             for view in _slot_views(_writable_bytes(self.pool.data[layer, kv]), sb, pairs)]
                    _recv_into_all(conn, views, grant.alive)
                    continue
                rows = torch.from_numpy(np.repeat(slot - np.cumsum(n) + n, n) + np.arange(int(n.sum())))
                shape = (2, len(rows), *self.pool.data.shape[3:])
                if on_host:  # two buffers, reused: one is received into while the other is scattered
                    buffers[0], buffers[1] = buffers[1], _at_least(buffers[0], self.pool.data, math.prod(shape))
                    staged = buffers[1][: math.prod(shape)].view(shape)
                else:
                    staged = _host_buffer(self.pool.data[layer, :, : len(rows)])
                _recv_exact(conn, _writable_bytes(staged), grant.alive)
                if pending is not None:
                    pending.result()
                if scatters is None:
                    self._scatter(layer, staged, rows)
                else:
                    pending = scatters.submit(self._scatter, layer, staged, rows)
            if pending is not None:
                pending.result()
        finally:
            if scatters is not None:
                scatters.shutdown(wait=True)

    def _frames(self, conn: socket.socket, grant: WriteGrant) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each LAYER frame's layer and runs (first slots, lengths), checked against the grant,
        until END; its payload must be read before the next one is asked for."""
        pool, alive = self.pool, grant.alive
        segments = np.array(sorted(grant.segments), dtype=np.int64).reshape(-1, 2)
        starts, ends = segments[:, 0], segments[:, 0] + segments[:, 1]
        while True:
            (op,) = _recv_struct(conn, _OP, alive)
            if op == _OP_END:
                return
            if op != _OP_LAYER:
                raise ValueError(f"unknown frame type {op}")
            layer, num_runs = _recv_struct(conn, _LAYER, alive)
            if not (layer < pool.num_layers and 0 < num_runs <= pool.num_slots):
                self._refuse(conn, f"a frame for layer {layer} with {num_runs} runs")
            raw = bytearray(num_runs * _RUNS.itemsize)
            _recv_exact(conn, memoryview(raw), alive)
            runs = np.frombuffer(raw, dtype=_RUNS)
            slot, n = runs["slot"].astype(np.int64), runs["n"].astype(np.int64)
            seg = np.searchsorted(starts, slot, side="right") - 1
            granted = (seg >= 0) & (n > 0) & (slot + n <= ends[np.maximum(seg, 0)])
            if not granted.all():
                bad = int(np.flatnonzero(~granted)[0])
                self._refuse(conn, f"layer {layer} slots [{slot[bad]}, {slot[bad] + n[bad]})")
            yield layer, slot, n

    def _scatter(self, layer: int, staged: torch.Tensor, rows: torch.Tensor) -> None:
        """A staged frame into its slots with one indexed copy."""
        scatter_to_slots(self.pool.data[layer], staged.to(self.pool.data.device, non_blocking=True), rows)

    @staticmethod
    def _refuse(conn: socket.socket, what: str) -> None:
        _reply(conn, grpc.StatusCode.PERMISSION_DENIED, f"write outside the reservation: {what}")
        raise ValueError("write outside the reservation")


def _reply(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    body = message.encode()
    try:
        conn.sendall(_REPLY.pack(code.value[0], len(body)) + body)
    except OSError:
        pass


class TcpKvSession:
    """Prefill side: one transfer. `post_layer` may be called from the forward thread as each
    layer finishes; a sender thread ships the frames so compute and transfer overlap."""

    def __init__(self, address: str, pool: KVPool, request_id: str, nonce: int, timeout_s: float = 30.0,
                 on_layer_done: Callable[[int], None] = lambda layer: None) -> None:
        host, port = address.rsplit(":", 1)
        self._pool = pool
        self._on_layer_done = on_layer_done
        self._deadline = time.monotonic() + timeout_s
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot reach the decode node's KV receiver at {address}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rid = request_id.encode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._queue.put([memoryview(_BEGIN.pack(_MAGIC, len(rid), nonce) + rid)])
        self._thread = threading.Thread(target=self._send_loop, name="tcp-kv-send", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        """A send already failed: the transfer cannot succeed any more."""
        return self._error is not None

    def post_layer(self, layer: int, pieces: list[Piece]) -> None:
        """Queue the layer's frame: its header, then the K and V rows of the pieces."""
        if not pieces:
            return
        runs = np.array([(p.dst_slot, p.num_slots) for p in pieces], dtype=_RUNS)
        header = [memoryview(_OP.pack(_OP_LAYER) + _LAYER.pack(layer, len(pieces)) + runs.tobytes())]
        pool, sb = self._pool, self._pool.slot_bytes()
        if _through_host(pool):
            staged, wait_copied = _stage_on_host(pool, layer, pieces)
            self._queue.put(wait_copied)  # the sender thread waits here, not the forward
            self._queue.put(header + [_writable_bytes(staged)])
        elif sum(p.num_slots for p in pieces) * sb < _STAGE_BELOW * len(pieces):  # short runs: one buffer,
            self._queue.put(header + [_writable_bytes(_gathered(pool, layer, pieces))])  # gathered here
        else:
            src = [(p.src_slot, p.num_slots) for p in pieces]
            self._queue.put(header + [view for kv in (0, 1)
                                      for view in _slot_views(_writable_bytes(pool.data[layer, kv]), sb, src)])
        self._queue.put(layer)  # the sender reports the layer sent when it gets here

    def finish(self) -> None:
        """Send END and wait for the receiver's verdict; raises TransferError."""
        self._queue.put([memoryview(_OP.pack(_OP_END))])
        self._queue.put(None)
        self._thread.join()
        try:
            # After a failed send only a refusal already on its way is worth reading.
            self._sock.settimeout(REFUSAL_WAIT_S if self._error else self._remaining())
            status, length = _recv_struct(self._sock, _REPLY)
            message = bytearray(length)
            _recv_exact(self._sock, memoryview(message))
        except TimeoutError:
            raise TransferError(f"the KV transfer missed its deadline: {self._error or 'no confirmation'}",
                                grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"the KV receiver did not confirm the transfer: {self._error or exc}") from None
        finally:
            self._sock.close()
        if status != grpc.StatusCode.OK.value[0]:
            code = next((c for c in grpc.StatusCode if c.value[0] == status), grpc.StatusCode.UNKNOWN)
            raise TransferError(f"the decode node refused the transfer: {message.decode()}", code)

    def cancel(self) -> bool:
        """Close the connection. True: the receiver, which does the writing, pins the pages
        until it has seen the connection end."""
        self._queue.put(None)
        self._sock.close()
        return True

    def _remaining(self) -> float:
        """Seconds left before the transfer's deadline (a sliver at least, so a timeout fires)."""
        return max(0.001, self._deadline - time.monotonic())

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            if isinstance(item, int):
                self._on_layer_done(item)
                continue
            try:
                if callable(item):  # a staged layer: wait for its device-to-host copy
                    item()
                    continue
                self._sock.settimeout(self._remaining())
                _send_all(self._sock, item)
            except Exception as exc:  # not only OSError: a sender thread must never die silently
                self._error = exc  # keep draining; finish() reports it (after reading any reply)
