"""The writing half of NIXL: an agent that posts one-sided WRITEs from its registered tensor into
connected targets' pools, by byte ranges or by prepared blocks."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.errors import ErrorCode
from common.transports import TransferError
from common.transports.nixl.agent import (
    PeerDisconnectedError,
    agent_name,
    as_ranges,
    check_tensor,
    descriptors,
    load_nixl,
    make_agent,
    memory_of,
    register,
)

log = logging.getLogger(__name__)

_MAX_PROBED_GPUS = 64  # device indices tried when finding which GPU a remote pool is on


@dataclass(eq=False)
class WriteHandle:
    """One posted transfer; pass it to :meth:`NixlInitiator.wait` exactly once."""

    peer: str
    num_descriptors: int
    nbytes: int
    posted_at: float
    _xfer: Any = field(repr=False)
    _generation: int = field(repr=False)  # which connect() of `peer` it was posted under
    _done: bool = field(default=False, repr=False)


class NixlInitiator:
    """The prefill side: an agent that writes byte ranges of its registered tensor into the
    registered pools of connected targets."""

    def __init__(self, name: str, local_tensor: torch.Tensor) -> None:
        check_tensor(local_tensor, "local_tensor")
        self.name = name
        self._tensor = local_tensor
        self._lo = local_tensor.data_ptr()
        self._hi = self._lo + local_tensor.numel() * local_tensor.element_size()
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[bytes, int]] = {}  # name -> (metadata, generation)
        self._peer_memory: dict[str, tuple[str, int]] = {}  # name -> its pool's (memory type, device id)
        self._memory = memory_of(local_tensor)
        self._generation = 0
        self._pending: set[WriteHandle] = set()
        self._stuck: list[Any] = []  # handles NIXL could not cancel: never freed while we live
        self._local_blocks: Any = None  # prepared descriptor list of local blocks (prepare_local)
        self._remote_blocks: dict[str, Any] = {}  # peer -> its prepared descriptor list (prepare_remote)
        nx = load_nixl()
        self._disconnect_err = nx["disconnect"]
        self._not_found_err = nx["not_found"]
        self._invalid_err = nx["invalid"]
        self._nixl_errors = nx["errors"]
        self._agent = make_agent(name)
        self._reg = register(self._agent, local_tensor)

    # -- peers ----------------------------------------------------------------------------

    def connect(self, peer_name: str, metadata: bytes) -> None:
        """Load a target's metadata. A no-op if the same metadata is already loaded; different
        metadata for a known peer (it restarted) replaces the old entry. The UCX connection
        itself is made lazily by the first write."""
        with self._lock:
            agent = self._live()
            known = self._peers.get(peer_name)
            if known is not None and known[0] == metadata:
                return
            if known is not None:
                self._remove_locked(peer_name)
            try:
                loaded = agent_name(agent.add_remote_agent(metadata))
            except self._nixl_errors as exc:
                # NIXL_ERR_NOT_ALLOWED here means NIXL still holds this name, e.g. added earlier
                # by another NixlInitiator method; disconnect() first.
                raise TransferError(f"cannot load NIXL metadata of {peer_name!r}: {type(exc).__name__}: {exc}",
                                    ErrorCode.FAILED_PRECONDITION) from None
            if loaded != peer_name:
                agent.remove_remote_agent(loaded)
                raise TransferError(f"metadata names agent {loaded!r}, expected {peer_name!r}",
                                    ErrorCode.FAILED_PRECONDITION)
            self._generation += 1
            self._peers[peer_name] = (bytes(metadata), self._generation)

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer (and drop its UCX endpoints) so a restarted peer can be re-added.
        Unknown peers are ignored."""
        with self._lock:
            if self._agent is not None and peer_name in self._peers:
                self._remove_locked(peer_name)

    def connected(self, peer_name: str) -> bool:
        return peer_name in self._peers

    def _remove_locked(self, peer_name: str) -> None:
        self._peers.pop(peer_name, None)
        self._peer_memory.pop(peer_name, None)
        if (blocks := self._remote_blocks.pop(peer_name, None)) is not None:
            self._release_dlist(blocks)
        try:
            self._agent.remove_remote_agent(peer_name)
        except self._nixl_errors as exc:
            log.warning("NIXL remove_remote_agent(%s) failed: %s", peer_name, exc)

    # -- transfers ------------------------------------------------------------------------

    def write(self, peer_name: str, local_ranges: Sequence[tuple[int, int]],
              remote_ranges: Sequence[tuple[int, int]], notification: bytes | None = None) -> WriteHandle:
        """Post ONE transfer copying ``local_ranges[i]`` to ``remote_ranges[i]`` for every i.

        Ranges are ``(absolute address, nbytes)`` (lists of tuples or an ``(N, 2)`` integer
        array); local ones must lie inside the registered local tensor, remote ones inside the
        peer's registered pool, and ``nbytes`` must match pairwise. ``notification`` (if not
        None or empty: no notification) reaches the target's ``poll_notifications`` after all
        the data has landed; keep it small (it travels as a UCX active message).

        Raises ValueError for malformed ranges, :class:`TransferError` (``INVALID_ARGUMENT``)
        when a remote range is outside the peer's pool, ``FAILED_PRECONDITION`` when the peer is
        not connected, and :class:`PeerDisconnectedError` when the peer is gone.
        """
        local = as_ranges(local_ranges, "local_ranges")
        remote = as_ranges(remote_ranges, "remote_ranges")
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local ranges but {len(remote)} remote ranges")
        if len(local) == 0:
            raise ValueError("nothing to write: no ranges (send the notification another way)")
        if not np.array_equal(local[:, 1], remote[:, 1]):
            i = int(np.flatnonzero(local[:, 1] != remote[:, 1])[0])
            raise ValueError(f"range {i}: local has {local[i, 1]} bytes, remote {remote[i, 1]}")
        if int(local[:, 0].min()) < self._lo or int((local[:, 0] + local[:, 1]).max()) > self._hi:
            raise ValueError("a local range is outside the registered local tensor")
        notif = b"" if notification is None else bytes(notification)
        with self._lock:
            agent = self._live()
            if peer_name not in self._peers:
                raise TransferError(f"not connected to {peer_name!r}: call connect() with its metadata",
                                    ErrorCode.FAILED_PRECONDITION)
            generation = self._peers[peer_name][1]
            remote_memory = self._remote_memory_locked(peer_name, remote[0])
            if remote_memory is None:
                raise TransferError(f"a remote range is outside the memory {peer_name!r} registered",
                                    ErrorCode.INVALID_ARGUMENT)
            ldl = agent.get_xfer_descs(descriptors(local, self._memory[1]), self._memory[0])
            rdl = agent.get_xfer_descs(descriptors(remote, remote_memory[1]), remote_memory[0])
            try:
                xfer = agent.initialize_xfer("WRITE", ldl, rdl, peer_name, notif)
            except self._not_found_err:
                raise TransferError(f"a remote range is outside the memory {peer_name!r} registered",
                                    ErrorCode.INVALID_ARGUMENT) from None
            except self._nixl_errors as exc:
                raise self._error_locked(peer_name, generation, exc, "preparing") from None
            return self._post_locked(agent, peer_name, generation, xfer, len(local), int(local[:, 1].sum()), notif)

    def _post_locked(self, agent: Any, peer_name: str, generation: int, xfer: Any, num_descriptors: int,
                     nbytes: int, notif: bytes) -> WriteHandle:
        handle = WriteHandle(peer_name, num_descriptors, nbytes, time.monotonic(), xfer, generation)
        try:
            state = agent.transfer(xfer, notif)
        except self._nixl_errors as exc:
            state, err = "ERR", exc
        else:
            err = None
        if state == "ERR":
            self._release_locked(handle)
            raise self._error_locked(peer_name, generation, err, "posting") from None
        handle._done = state == "DONE"
        self._pending.add(handle)
        return handle

    def prepare_local(self, blocks: np.ndarray) -> None:
        """Describe the local tensor once as blocks (an ``(N, 2)`` array of absolute address and
        nbytes, each inside the tensor) for :meth:`write_blocks`, which then names them by index."""
        local = as_ranges(blocks, "blocks")
        if len(local) == 0 or int(local[:, 0].min()) < self._lo or int((local[:, 0] + local[:, 1]).max()) > self._hi:
            raise ValueError("a local block is outside the registered local tensor")
        with self._lock:
            agent = self._live()
            if self._local_blocks is not None:
                self._release_dlist(self._local_blocks)
            self._local_blocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descriptors(local, self._memory[1]),
                                                       self._memory[0])

    def prepare_remote(self, peer_name: str, blocks: np.ndarray) -> None:
        """Describe a connected peer's pool once as blocks (``(N, 2)``: address, nbytes), for
        :meth:`write_blocks`. Dropped with the peer (disconnect, or connect with new metadata).
        Raises :class:`TransferError` (``INVALID_ARGUMENT``) when a block is outside its pool."""
        remote = as_ranges(blocks, "blocks")
        if len(remote) == 0:
            raise ValueError("blocks: no blocks to prepare")
        with self._lock:
            agent = self._live()
            if peer_name not in self._peers:
                raise TransferError(f"not connected to {peer_name!r}: call connect() with its metadata",
                                    ErrorCode.FAILED_PRECONDITION)
            lo = int(remote[:, 0].min())
            span = np.array([[lo, int((remote[:, 0] + remote[:, 1]).max()) - lo]], dtype=np.int64)
            memory = self._remote_memory_locked(peer_name, span[0])
            if memory is None or not agent.check_remote_metadata(
                    peer_name, agent.get_xfer_descs(descriptors(span, memory[1]), memory[0])):
                raise TransferError(f"a block is outside the memory {peer_name!r} registered",
                                    ErrorCode.INVALID_ARGUMENT)
            try:
                prepared = agent.prep_xfer_dlist(peer_name, descriptors(remote, memory[1]), memory[0])
            except self._nixl_errors as exc:
                raise TransferError(f"cannot describe the pool of {peer_name!r}: {type(exc).__name__}: {exc}",
                                    ErrorCode.INVALID_ARGUMENT) from None
            if (old := self._remote_blocks.pop(peer_name, None)) is not None:
                self._release_dlist(old)
            self._remote_blocks[peer_name] = prepared

    def write_blocks(self, peer_name: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                     nbytes: int, notification: bytes | None = None) -> WriteHandle:
        """Post ONE transfer copying local block ``local_indices[i]`` to the peer's block
        ``remote_indices[i]`` (both prepared; equal sizes pairwise). Only the indices cross into
        NIXL, which merges blocks adjacent on both sides into one transfer. ``nbytes`` (the total)
        is for reporting. Errors as for :meth:`write`."""
        if len(local_indices) != len(remote_indices) or len(local_indices) == 0:
            raise ValueError(f"{len(local_indices)} local but {len(remote_indices)} remote block indices")
        notif = b"" if notification is None else bytes(notification)
        with self._lock:
            agent = self._live()
            if peer_name not in self._remote_blocks or self._local_blocks is None:
                raise TransferError(f"no prepared blocks for {peer_name!r}: connect() and prepare_remote() first",
                                    ErrorCode.FAILED_PRECONDITION)
            generation = self._peers[peer_name][1]
            try:
                xfer = agent.make_prepped_xfer("WRITE", self._local_blocks, local_indices.astype(np.int32, copy=False),
                                               self._remote_blocks[peer_name],
                                               remote_indices.astype(np.int32, copy=False), notif)
            except self._nixl_errors as exc:
                raise self._error_locked(peer_name, generation, exc, "preparing") from None
            return self._post_locked(agent, peer_name, generation, xfer, len(local_indices), nbytes, notif)

    def is_done(self, handle: WriteHandle) -> bool:
        """Whether the transfer is DONE, without waiting (an error shows in `wait`)."""
        with self._lock:
            if not handle._done and handle in self._pending and self._agent is not None:
                try:
                    handle._done = self._agent.check_xfer_state(handle._xfer) == "DONE"
                except self._nixl_errors:
                    pass
            return handle._done

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Poll until the transfer is DONE, then release it. On error or after ``timeout_s`` the
        transfer is cancelled and released and :class:`TransferError` raised (``in_flight`` is
        True after a timeout)."""
        deadline = time.monotonic() + timeout_s
        polls = 0
        while True:
            with self._lock:
                if handle not in self._pending:
                    raise ValueError("unknown or already waited-for WriteHandle")
                agent = self._live()
                err = None
                if handle._done:
                    state = "DONE"
                else:
                    try:
                        state = agent.check_xfer_state(handle._xfer)
                    except self._nixl_errors as exc:
                        state, err = "ERR", exc
                if state == "DONE":
                    self._pending.discard(handle)
                    self._release_locked(handle)
                    return
                if state == "ERR":
                    self._pending.discard(handle)
                    self._release_locked(handle)
                    raise self._error_locked(handle.peer, handle._generation, err, "transferring") from None
                if time.monotonic() >= deadline:
                    self._pending.discard(handle)
                    self._release_locked(handle)
                    raise TransferError(
                        f"write of {handle.nbytes} bytes to {handle.peer!r} not done after {timeout_s:.3g} s; "
                        "it was cancelled, but bytes already on their way may still land",
                        ErrorCode.DEADLINE_EXCEEDED, in_flight=True)
            # Spin briefly (sm transfers finish within the post; tcp needs frequent progress),
            # then back off so a 2-core machine keeps a core for the target and for compute.
            polls += 1
            time.sleep(0 if polls < 200 else 5e-5)

    def close(self) -> None:
        """Cancel/release outstanding transfers, drop peers, deregister, destroy the agent.
        Idempotent. Handles NIXL could not cancel keep the agent alive until interpreter exit."""
        with self._lock:
            if self._agent is None:
                return
            for handle in list(self._pending):
                self._release_locked(handle)
            self._pending.clear()
            for peer in list(self._peers):
                self._remove_locked(peer)
            if self._local_blocks is not None:
                self._release_dlist(self._local_blocks)
                self._local_blocks = None
            if not self._stuck:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception as exc:
                    log.warning("NIXL deregister failed on close: %s", exc)
            self._agent = None

    # -- helpers --------------------------------------------------------------------------

    def _live(self) -> Any:
        if self._agent is None:
            raise RuntimeError(f"NixlInitiator {self.name!r} is closed")
        return self._agent

    def _remote_memory_locked(self, peer: str, probe: np.ndarray) -> tuple[str, int] | None:
        """The (memory type, device id) under which `peer` registered the byte range `probe`
        (address, nbytes), read from its loaded metadata once per connect; None if no
        registration of it holds the range."""
        if peer not in self._peer_memory:
            candidates = [("DRAM", 0)] + [("VRAM", d) for d in range(_MAX_PROBED_GPUS)]
            for mem, dev in candidates:
                descs = self._agent.get_xfer_descs(np.array([[probe[0], probe[1], dev]], dtype=np.uint64), mem)
                if self._agent.check_remote_metadata(peer, descs):
                    self._peer_memory[peer] = (mem, dev)
                    break
            else:
                return None
        return self._peer_memory[peer]

    def _release_dlist(self, prepared: Any) -> None:
        try:
            self._agent.release_dlist_handle(prepared)
        except Exception as exc:  # the agent frees it with itself anyway
            log.warning("NIXL could not release a prepared descriptor list: %s", exc)

    def _release_locked(self, handle: WriteHandle) -> bool:
        """Release (cancelling if still active); False if NIXL refused (it keeps writing)."""
        try:
            handle._xfer.release()
            return True
        except Exception as exc:
            log.error("NIXL could not release a transfer to %s: %s", handle.peer, exc)
            self._stuck.append(handle._xfer)
            return False

    def _error_locked(self, peer: str, generation: int, exc: BaseException | None, when: str) -> TransferError:
        if exc is not None and isinstance(exc, self._disconnect_err):
            # The endpoint is dead for good: forget the peer so connect() re-adds it, unless the
            # caller already re-connected it (this error is from a write to the old incarnation).
            if self._peers.get(peer, (b"", -1))[1] == generation:
                self._remove_locked(peer)
            return PeerDisconnectedError(f"{peer!r} disconnected ({when} a write): the peer died or "
                                         "restarted; re-handshake and connect() again")
        if exc is not None and isinstance(exc, self._not_found_err) and when == "transferring":
            return TransferError(f"the connection to {peer!r} was dropped or replaced (disconnect() or "
                                 "connect() with new metadata) while this write was in flight")
        if exc is not None and isinstance(exc, self._invalid_err):
            return TransferError(f"NIXL rejected the write to {peer!r}: {exc}", ErrorCode.INVALID_ARGUMENT)
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "transfer state ERR"
        return TransferError(f"write to {peer!r} failed while {when}: {what}")

    def __enter__(self) -> NixlInitiator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
