"""KV over NIXL's UCX backend: one-sided WRITEs from a sender's pool into a receiver's pool.

The package's two halves behind the shared interface (common/transports/connector.py):
`receiver.py` (`NixlReceiver`: the pool registered once, a progress poller, fences that a
writer's report or the quarantine lifts) and `sender.py` (`NixlSender`: prepared page blocks,
one WRITE per layer). Below them, NIXL itself: `agent.py` (import, agent, registration),
`target.py` (`NixlTarget`) and `initiator.py` (`NixlInitiator`).

The receiving node owns a :class:`NixlTarget`: it registers its whole KV pool tensor once and hands
out ``metadata()`` (NIXL agent metadata: connection info plus the registration) together with
``base_address`` and ``size_bytes`` over the control plane. The sending node owns a
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
  millisecond or so) while transfers are expected. With ``sm`` the initiator does the copy, and
  the receiver polls lazily (``receiver.target_must_progress``).
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
back to the TCP transport (``common/transports/tcp/``). Neither class is meant to be
shared between processes; within a process each serialises its NIXL calls with a lock.
"""
