"""KV over NIXL's UCX backend: one-sided WRITEs from the prefill pool into the decode pool.

The decode node owns a :class:`NixlTarget`: it registers its whole KV pool tensor once and hands
out ``metadata()`` (NIXL agent metadata: connection info plus the registration) together with
``base_address`` and ``size_bytes`` over the control plane. The prefill node owns a
:class:`NixlInitiator`: it registers its own pool, ``connect``s to each decode node with that
metadata and posts ``write``s: one NIXL transfer per call, one descriptor per (address, nbytes)
range, optionally carrying a notification. For the hot path both sides are described once as
blocks (``prepare_local``, ``prepare_remote``: NIXL's prepared descriptor lists), and
``write_blocks`` passes only block indices (NIXL's prepared transfers). The decode node learns
about completed transfers by polling :meth:`NixlTarget.poll_notifications`; a notification is
delivered only after the data of its transfer is in place.

Environment (read by UCX when an agent's backend is created, i.e. set it before constructing
either class, in every process):

* ``UCX_TLS=sm,self`` on one host (puts go through CMA, ``process_vm_writev``), ``UCX_TLS=tcp``
  across hosts (``UCX_NET_DEVICES=lo`` for loopback tests). Unset means "all", which also works.
* With ``tcp`` the data only moves while *both* sides make UCX progress: the initiator does so in
  :meth:`NixlInitiator.wait`, the target in :meth:`NixlTarget.poll_notifications`. NIXL's
  progress thread is off (small machines), so the decode node must keep polling (every
  millisecond or so) while transfers are expected. With ``sm`` the initiator does the copy.
* Start worker processes with the ``spawn`` start method, never ``fork`` after UCX is up.
* Pools on a CUDA device are registered as ``VRAM`` (with the device index), host pools as
  ``DRAM``. For VRAM pools UCX needs its CUDA transports: ``UCX_TLS=cuda_ipc,cuda_copy,sm,self``
  on one host (GPU to GPU over NVLink/PCIe peer access), ``UCX_TLS=rc,ud,cuda_copy,cuda_ipc`` (or
  ``all``) across hosts, which writes GPU memory directly over RDMA when GPUDirect RDMA is set up
  (docs/gpu.md). An initiator learns each target's memory type and device from the target's
  metadata (:meth:`NixlInitiator.write` probes it), so the two sides need not match.

Error handling mode is ``none``: ``peer`` rejects every shared-memory transport ("no peer failure
handler") and backend creation fails under ``UCX_TLS=sm,self``. Peer death is still reported:
a write to (or in flight towards) a dead target fails with :class:`PeerDisconnectedError` within
milliseconds, with both ``sm`` and ``tcp``.

A timed-out write may still land partly (``TransferError.in_flight``). NIXL does no access
control: any agent holding a target's metadata can write anywhere in its pool, so the metadata
is as sensitive as the pool itself (hand it out only to authorised prefill nodes).

NIXL's import is lazy; :func:`nixl_available` says whether it loads here, so a daemon can fall
back to the TCP transport (``common/transports/tcp_transport.py``). Neither class is meant to be
shared between processes; within a process each serialises its NIXL calls with a lock.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from common.transports import TransferError

log = logging.getLogger(__name__)

__all__ = [
    "NixlInitiator",
    "NixlTarget",
    "NixlUnavailableError",
    "PeerDisconnectedError",
    "TransferError",
    "WriteHandle",
    "nixl_available",
    "nixl_unavailable_reason",
]

_BACKEND = "UCX"
# "none": shared-memory transports have no peer failure handler; with "peer" UCX refuses them.
_UCX_PARAMS = {"ucx_error_handling_mode": "none"}
_MAX_PROBED_GPUS = 64  # device indices tried when finding which GPU a remote pool is on
# The wheels, built for CUDA 12 (the lock's, and the driver-agnostic choice on CPU machines) or
# CUDA 13 (hosts whose torch is a CUDA 13 build); `nixl` is the meta package that re-exports one.
_NIXL_MODULES = (("nixl_cu12", "nixl_cu12._bindings"), ("nixl_cu13", "nixl_cu13._bindings"),
                 ("nixl._api", "nixl._bindings"))
_INSTALL_HINT = (
    "install it with `pip install -c constraints.txt nixl-cu12` (torch stays pinned), "
    "or run with the TCP transport"
)


class NixlUnavailableError(ImportError):
    """NIXL (or its UCX backend) cannot be used on this machine; use the TCP transport."""


class PeerDisconnectedError(TransferError):
    """The target went away (process died, connection reset). The initiator has dropped the peer;
    ``connect`` again with the (new) metadata of the restarted target."""


# ---------------------------------------------------------------------------------------------
# Import


_nixl: dict[str, Any] | None = None
_nixl_error: str | None = None
_import_lock = threading.Lock()


def _load() -> dict[str, Any]:
    """Import NIXL once; returns its agent classes and its error types, or raises."""
    global _nixl, _nixl_error
    with _import_lock:
        if _nixl is not None:
            return _nixl
        if _nixl_error is None:
            errors = []
            for api, bindings in _NIXL_MODULES:
                try:
                    mod = __import__(api, fromlist=["nixl_agent"])
                    bind = __import__(bindings, fromlist=["nixlBackendError"])
                except (ImportError, OSError) as exc:  # OSError: a shared library failed to load
                    errors.append(f"{api}: {exc}")
                    continue
                _quiet_nixl_logger()
                _nixl = {
                    "agent": mod.nixl_agent,
                    "config": mod.nixl_agent_config,
                    "errors": tuple(getattr(bind, n) for n in dir(bind)
                                    if n.startswith("nixl") and n.endswith("Error")),
                    "disconnect": getattr(bind, "nixlRemoteDisconnectError", ()),
                    "not_found": getattr(bind, "nixlNotFoundError", ()),
                    "invalid": getattr(bind, "nixlInvalidParamError", ()),
                    "module": api,
                }
                return _nixl
            _nixl_error = "; ".join(errors)
    raise NixlUnavailableError(f"NIXL cannot be imported ({_nixl_error}); {_INSTALL_HINT}")


def _quiet_nixl_logger() -> None:
    # NIXL's Python layer logs every agent/backend creation at INFO to stdout; keep warnings only
    # unless the user asked for a level with NIXL_LOG_LEVEL.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def nixl_available() -> bool:
    """True if NIXL imports here (it does not check that UCX finds a usable transport)."""
    try:
        _load()
    except NixlUnavailableError:
        return False
    return True


def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be imported, or None if it can."""
    try:
        _load()
    except NixlUnavailableError as exc:
        return str(exc)
    return None


def _make_agent(name: str) -> Any:
    nx = _load()
    try:
        agent = nx["agent"](name, nx["config"](enable_prog_thread=False, backends=[]))
        agent.create_backend(_BACKEND, dict(_UCX_PARAMS))
    except nx["errors"] + (RuntimeError,) as exc:
        raise NixlUnavailableError(
            f"NIXL loaded ({nx['module']}) but its UCX backend could not start: "
            f"{type(exc).__name__}: {exc} (UCX_TLS={os.environ.get('UCX_TLS', '<unset>')}); "
            f"use the TCP transport") from exc
    return agent


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be in host memory or on a CUDA device, not on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous: it is registered as one byte range")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")


def _memory_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ("VRAM", GPU index) or ("DRAM", 0)."""
    if t.device.type != "cuda":
        return "DRAM", 0
    return "VRAM", t.device.index if t.device.index is not None else torch.cuda.current_device()


def _register(agent: Any, t: torch.Tensor) -> Any:
    mem, dev = _memory_of(t)
    return agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem)


# ---------------------------------------------------------------------------------------------
# Target (decode node)


class NixlTarget:
    """The decode side: an agent that exposes one registered pool tensor to remote writers."""

    def __init__(self, name: str, pool_tensor: torch.Tensor) -> None:
        _check_tensor(pool_tensor, "pool_tensor")
        self.name = name
        self._tensor = pool_tensor  # keep the memory alive while it is registered
        self._lock = threading.Lock()
        self._agent = _make_agent(name)
        self._reg = _register(self._agent, pool_tensor)

    @property
    def base_address(self) -> int:
        """Address of the pool's first byte, as remote ranges must be expressed."""
        return self._tensor.data_ptr()

    @property
    def size_bytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    def metadata(self) -> bytes:
        """NIXL agent metadata (connection info and the pool registration) for initiators."""
        with self._lock:
            return self._live().get_agent_metadata()

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (initiator agent name, payload),
        in arrival order per initiator. Also drives UCX progress (needed for ``tcp``)."""
        with self._lock:
            notifs = self._live().get_new_notifs()
        return [(_name(peer), bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        """Deregister the pool and destroy the agent. Idempotent."""
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            try:
                agent.deregister_memory(self._reg)
            except Exception as exc:  # closing must not raise; the agent dies anyway
                log.warning("NIXL deregister failed on close: %s", exc)
            del agent

    def _live(self) -> Any:
        if self._agent is None:
            raise RuntimeError(f"NixlTarget {self.name!r} is closed")
        return self._agent

    def __enter__(self) -> NixlTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Initiator (prefill node)


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
        _check_tensor(local_tensor, "local_tensor")
        self.name = name
        self._tensor = local_tensor
        self._lo = local_tensor.data_ptr()
        self._hi = self._lo + local_tensor.numel() * local_tensor.element_size()
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[bytes, int]] = {}  # name -> (metadata, generation)
        self._peer_memory: dict[str, tuple[str, int]] = {}  # name -> its pool's (memory type, device id)
        self._memory = _memory_of(local_tensor)
        self._generation = 0
        self._pending: set[WriteHandle] = set()
        self._stuck: list[Any] = []  # handles NIXL could not cancel: never freed while we live
        self._local_blocks: Any = None  # prepared descriptor list of local blocks (prepare_local)
        self._remote_blocks: dict[str, Any] = {}  # peer -> its prepared descriptor list (prepare_remote)
        nx = _load()
        self._disconnect_err = nx["disconnect"]
        self._not_found_err = nx["not_found"]
        self._invalid_err = nx["invalid"]
        self._nixl_errors = nx["errors"]
        self._agent = _make_agent(name)
        self._reg = _register(self._agent, local_tensor)

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
                loaded = _name(agent.add_remote_agent(metadata))
            except self._nixl_errors as exc:
                # NIXL_ERR_NOT_ALLOWED here means NIXL still holds this name, e.g. added earlier
                # by another NixlInitiator method; disconnect() first.
                raise TransferError(f"cannot load NIXL metadata of {peer_name!r}: {type(exc).__name__}: {exc}",
                                    grpc.StatusCode.FAILED_PRECONDITION) from None
            if loaded != peer_name:
                agent.remove_remote_agent(loaded)
                raise TransferError(f"metadata names agent {loaded!r}, expected {peer_name!r}",
                                    grpc.StatusCode.FAILED_PRECONDITION)
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
        local = _ranges(local_ranges, "local_ranges")
        remote = _ranges(remote_ranges, "remote_ranges")
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
                                    grpc.StatusCode.FAILED_PRECONDITION)
            generation = self._peers[peer_name][1]
            remote_memory = self._remote_memory_locked(peer_name, remote[0])
            if remote_memory is None:
                raise TransferError(f"a remote range is outside the memory {peer_name!r} registered",
                                    grpc.StatusCode.INVALID_ARGUMENT)
            ldl = agent.get_xfer_descs(_descs(local, self._memory[1]), self._memory[0])
            rdl = agent.get_xfer_descs(_descs(remote, remote_memory[1]), remote_memory[0])
            try:
                xfer = agent.initialize_xfer("WRITE", ldl, rdl, peer_name, notif)
            except self._not_found_err:
                raise TransferError(f"a remote range is outside the memory {peer_name!r} registered",
                                    grpc.StatusCode.INVALID_ARGUMENT) from None
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
        local = _ranges(blocks, "blocks")
        if len(local) == 0 or int(local[:, 0].min()) < self._lo or int((local[:, 0] + local[:, 1]).max()) > self._hi:
            raise ValueError("a local block is outside the registered local tensor")
        with self._lock:
            agent = self._live()
            if self._local_blocks is not None:
                self._release_dlist(self._local_blocks)
            self._local_blocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(local, self._memory[1]),
                                                       self._memory[0])

    def prepare_remote(self, peer_name: str, blocks: np.ndarray) -> None:
        """Describe a connected peer's pool once as blocks (``(N, 2)``: address, nbytes), for
        :meth:`write_blocks`. Dropped with the peer (disconnect, or connect with new metadata).
        Raises :class:`TransferError` (``INVALID_ARGUMENT``) when a block is outside its pool."""
        remote = _ranges(blocks, "blocks")
        if len(remote) == 0:
            raise ValueError("blocks: no blocks to prepare")
        with self._lock:
            agent = self._live()
            if peer_name not in self._peers:
                raise TransferError(f"not connected to {peer_name!r}: call connect() with its metadata",
                                    grpc.StatusCode.FAILED_PRECONDITION)
            lo = int(remote[:, 0].min())
            span = np.array([[lo, int((remote[:, 0] + remote[:, 1]).max()) - lo]], dtype=np.int64)
            memory = self._remote_memory_locked(peer_name, span[0])
            if memory is None or not agent.check_remote_metadata(
                    peer_name, agent.get_xfer_descs(_descs(span, memory[1]), memory[0])):
                raise TransferError(f"a block is outside the memory {peer_name!r} registered",
                                    grpc.StatusCode.INVALID_ARGUMENT)
            try:
                prepared = agent.prep_xfer_dlist(peer_name, _descs(remote, memory[1]), memory[0])
            except self._nixl_errors as exc:
                raise TransferError(f"cannot describe the pool of {peer_name!r}: {type(exc).__name__}: {exc}",
                                    grpc.StatusCode.INVALID_ARGUMENT) from None
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
                                    grpc.StatusCode.FAILED_PRECONDITION)
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
                        grpc.StatusCode.DEADLINE_EXCEEDED, in_flight=True)
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
            return TransferError(f"NIXL rejected the write to {peer!r}: {exc}", grpc.StatusCode.INVALID_ARGUMENT)
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "transfer state ERR"
        return TransferError(f"write to {peer!r} failed while {when}: {what}")

    def __enter__(self) -> NixlInitiator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ranges(ranges: Sequence[tuple[int, int]] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(ranges, dtype=np.int64) if len(ranges) else np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what} must be a sequence of (address, nbytes) pairs")
    if len(arr) and (arr[:, 0].min() <= 0 or arr[:, 1].min() <= 0):
        raise ValueError(f"{what}: addresses and sizes must be positive")
    return arr


def _descs(ranges: np.ndarray, device: int) -> np.ndarray:
    """NIXL's ``(N, 3)`` descriptor array: address, nbytes, device id."""
    descs = np.empty((len(ranges), 3), dtype=np.uint64)
    descs[:, :2], descs[:, 2] = ranges, device
    return descs


def _name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
