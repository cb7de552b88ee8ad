"""The receiving half of the TCP transport: a listener on the KV owner's pool that lets each
connection write only the window admitted for its (request id, nonce).

A connection's window is fenced (fences.py) from its first frame until the connection ends, so a
lease that expires mid-transfer cannot hand those pages to another request before the writer is
done, and nothing needs a quarantine: the receiver does the writing, so a closed connection is
proof that nothing more lands. A writer that goes silent keeps the fence only while the
reservation is alive: once it is gone, a stall of POLL_S drops the connection and the fence.
"""
from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from common.errors import ErrorCode, NotFound, PermissionDenied, RequestError
from common.kv.pool import KVPool
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences
from common.transports.tcp import wire
from cuda.paged_kv import scatter_to_slots
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)

MAX_REQUEST_ID_BYTES = 1024
BEGIN_TIMEOUT_S = 10.0  # a connection must say which window it writes within this
POLL_S = 1.0  # how often a receiver waiting for bytes checks its reservation is still alive


class TcpReceiver:
    """Accepts transfers into `pool` for the windows admitted with `admit`."""

    transport = "tcp"

    def __init__(self, pool: KVPool, fences: WriteFences, host: str = "127.0.0.1", advertise_host: str = "",
                 port: int = 0, max_connections: int = 64) -> None:
        self.pool = pool
        self.fences = fences
        self._windows: dict[tuple[str, int], WriteWindow] = {}
        self._windows_lock = threading.Lock()
        self._listener = socket.create_server((host, port), backlog=max_connections)
        self.address = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False
        threading.Thread(target=self._accept_loop, name="tcp-kv-accept", daemon=True).start()

    def info(self) -> pb.TransportInfo:
        return pb.TransportInfo(transport=self.transport, tcp_address=self.address)

    def admit(self, window: WriteWindow) -> None:
        with self._windows_lock:  # windows of gone reservations go on the way
            self._windows = {k: w for k, w in self._windows.items() if w.alive()}
            self._windows[(window.request_id, window.nonce)] = window

    def complete(self, request_id: str, nonce: int) -> bool:
        """No fence outlives its connection here, so there is never one to lift."""
        with self._windows_lock:
            self._windows.pop((request_id, nonce), None)
        return False

    def _window(self, request_id: str, nonce: int) -> WriteWindow:
        with self._windows_lock:
            window = self._windows.get((request_id, nonce))
            if window is not None and window.alive():
                return window
            if any(rid == request_id and w.alive() for (rid, _), w in self._windows.items()):
                raise PermissionDenied(f"transfer_nonce does not match the one issued for {request_id!r}")
        raise NotFound(f"no transfer into {request_id!r} is admitted: it never began (BeginTransfer), "
                       "already completed, or its reservation expired or was aborted")

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
                wire.reply(conn, ErrorCode.RESOURCE_EXHAUSTED, "receiver busy: too many concurrent transfers")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tcp-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._transfer(conn)
        except Exception as exc:  # a broken sender must not take the receiver down
            log.warning("KV transfer failed", extra={"fields": {"error": str(exc)}})
        finally:
            self._slots.release()

    def _transfer(self, conn: socket.socket) -> None:
        """One connection's transfer, BEGIN to END, then the reply. A malformed stream raises
        ValueError (a write outside the window is replied PERMISSION_DENIED first), a stream cut
        short ConnectionError; an unknown or mismatched window is replied, not raised."""
        conn.settimeout(BEGIN_TIMEOUT_S)
        magic, id_len, nonce = wire.recv_struct(conn, wire.BEGIN)
        if magic != wire.MAGIC or id_len > MAX_REQUEST_ID_BYTES:
            raise ValueError("not a duet KV transfer")
        request_id = bytearray(id_len)
        wire.recv_exact(conn, memoryview(request_id))
        try:
            window = self._window(request_id.decode(), nonce)
        except RequestError as exc:
            wire.reply(conn, exc.code, str(exc))
            return
        fence = self.fences.raise_fence(window, quarantine=False)
        try:
            conn.settimeout(POLL_S)
            self._receive_writes(conn, window)
            wire.reply(conn, ErrorCode.OK, "")
        finally:
            self.fences.lift(fence)

    def _receive_writes(self, conn: socket.socket, window: WriteWindow) -> None:
        """Receive frames until END. A host pool's staged frames are scattered on a helper thread
        (torch's copy runs without the GIL) while the next frame arrives; all are done on return."""
        on_host = not self.pool.storage.is_cuda
        scatters = ThreadPoolExecutor(1, thread_name_prefix="tcp-kv-scatter") if on_host else None
        pending: Future | None = None
        buffers: list[torch.Tensor | None] = [None, None]
        try:
            for layer, slot, n in self._frames(conn, window):
                if not (wire.through_host(self.pool) or int(n.sum()) * self.pool.slot_bytes() < wire.STAGE_BELOW * len(n)):
                    sb, pairs = self.pool.slot_bytes(), list(zip(slot.tolist(), n.tolist()))
                    views = [view for kv in (0, 1)
                             for view in wire.slot_views(wire.writable_bytes(self.pool.layer_kv(layer)[kv]), sb, pairs)]
                    wire.recv_into_all(conn, views, window.alive)
                    continue
                rows = torch.from_numpy(np.repeat(slot - np.cumsum(n) + n, n) + np.arange(int(n.sum())))
                shape = (2, len(rows), *self.pool.layer_kv(layer).shape[2:])
                if on_host:  # two buffers, reused: one is received into while the other is scattered
                    buffers[0], buffers[1] = buffers[1], wire.at_least(buffers[0], self.pool.storage, math.prod(shape))
                    staged = buffers[1][: math.prod(shape)].view(shape)
                else:
                    staged = wire.host_buffer(self.pool.layer_kv(layer)[:, : len(rows)])
                wire.recv_exact(conn, wire.writable_bytes(staged), window.alive)
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

    def _frames(self, conn: socket.socket, window: WriteWindow) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each wire.LAYER frame's layer and runs (first slots, lengths), checked against the window,
        until END; its payload must be read before the next one is asked for."""
        pool, alive = self.pool, window.alive
        bounds = {}  # by granted Segments (one per layer group): run starts and ends, by start
        for layer in range(pool.num_layers):
            granted = window.granted(pool, layer)
            if id(granted) not in bounds:
                runs = np.array(sorted(granted), dtype=np.int64).reshape(-1, 2)
                bounds[id(granted)] = runs[:, 0], runs[:, 0] + runs[:, 1]
        while True:
            (op,) = wire.recv_struct(conn, wire.OP, alive)
            if op == wire.OP_END:
                return
            if op != wire.OP_LAYER:
                raise ValueError(f"unknown frame type {op}")
            layer, num_runs = wire.recv_struct(conn, wire.LAYER, alive)
            if not (layer < pool.num_layers and 0 < num_runs <= pool.slots_of(layer)):
                self._refuse(conn, f"a frame for layer {layer} with {num_runs} runs")
            starts, ends = bounds[id(window.granted(pool, layer))]
            raw = bytearray(num_runs * wire.RUNS.itemsize)
            wire.recv_exact(conn, memoryview(raw), alive)
            runs = np.frombuffer(raw, dtype=wire.RUNS)
            slot, n = runs["slot"].astype(np.int64), runs["n"].astype(np.int64)
            seg = np.searchsorted(starts, slot, side="right") - 1
            inside = (seg >= 0) & (n > 0) & (slot + n <= ends[np.maximum(seg, 0)])
            if not inside.all():
                bad = int(np.flatnonzero(~inside)[0])
                self._refuse(conn, f"layer {layer} slots [{slot[bad]}, {slot[bad] + n[bad]})")
            yield layer, slot, n

    def _scatter(self, layer: int, staged: torch.Tensor, rows: torch.Tensor) -> None:
        """A staged frame into its slots with one indexed copy."""
        scatter_to_slots(self.pool.layer_kv(layer), staged.to(self.pool.device, non_blocking=True), rows)

    @staticmethod
    def _refuse(conn: socket.socket, what: str) -> None:
        wire.reply(conn, ErrorCode.PERMISSION_DENIED, f"write outside the reservation: {what}")
        raise ValueError("write outside the reservation")
