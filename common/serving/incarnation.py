"""This process's identity as a node: a random incarnation drawn at start (GetLoad reports it,
a KV writer announces it in its handshake), and, for a peer on the same host and in the same pid
namespace, what tells that the process is gone (its pid no longer runs with the same start time)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from protos.duet.v1 import duet_pb2 as pb

INCARNATION = secrets.randbits(64) | 1  # never 0, which means "unknown" on the wire


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (the process's start time, in clock ticks since boot); None
    when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # the fields after "(comm)" start at 3


def writer_identity(address: str) -> pb.WriterIdentity:
    return pb.WriterIdentity(incarnation=INCARNATION, address=address, boot_id=_boot_id(), pid=os.getpid(),
                             process_start_ticks=process_start_ticks(os.getpid()) or 0,
                             pid_namespace=_pid_namespace())


def provably_gone(writer: pb.WriterIdentity) -> bool:
    """Whether `writer`'s process is known to have ended: it ran on this host (same boot) in this
    pid namespace, and its pid now runs nothing, or something started later. False when that
    cannot be known here (another host, another container's pids)."""
    if not writer.boot_id or writer.boot_id != _boot_id() or writer.pid <= 0:
        return False
    if not writer.pid_namespace or writer.pid_namespace != _pid_namespace():
        return False
    return process_start_ticks(writer.pid) != writer.process_start_ticks
