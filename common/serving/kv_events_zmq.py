"""KV events in vLLM's wire format over ZMQ (`--kv-events-endpoint`): what the Gateway API
Inference Extension's precise prefix-cache scorer (llm-d's KV cache indexer) subscribes to.

Fed by the same KvEventLog as WatchKvEvents: each published change is one message of three frames,
the topic (`--kv-events-topic`), the change's sequence number (8 bytes, big-endian) and a msgpack
payload `[timestamp, events]` whose events are
    ["BlockStored", block_hashes, parent_block_hash or None, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
Stored blocks go out in chains (each hash continues the one before it, `token_ids` covers
len(block_hashes) x block_size tokens) whose parent is a hash already announced, or None at a
prompt's start. `lora_id` is None; `medium` is where the pool lives ("GPU" on CUDA, "CPU"), or
"DISK" for blocks the --kv-offload-dir tier holds.

As vLLM's publisher does, the PUB socket binds when the endpoint's host is a wildcard (`*`,
`0.0.0.0`, `::`) or it is an ipc:// or inproc:// address, and otherwise connects: llm-d's picker
binds its SUB socket and every pod connects to it (`tcp://<picker service>:5557`).

The first message says AllBlocksCleared and then stores what the cache holds (at start, nothing):
a node that restarted on the same address resets what subscribers knew of it. A publisher that
fell behind the log's history does the same. A subscriber that saw a gap in the sequence asks
the replay socket (`--kv-events-replay-endpoint`, a ROUTER, as vLLM's publisher) by sending the
first sequence it wants (8 bytes, big-endian); it gets each kept message from there as
[sequence, payload] and then [-1 (8 bytes, signed), b""].
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

import msgpack
import zmq

from common.kv.events import POOL, KvChange, KvEventLog, StoredBlock
from common.serving.daemon import GrpcDaemon
from common.serving.daemon_config import DaemonConfig

log = logging.getLogger(__name__)

KEPT_MESSAGES = 1024  # what a replay can reach back to
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 20  # the longest a change waits to go out while a replay socket is watched


def default_topic(host: str, port: int, model: str) -> str:
    """`kv@<host>:<port>@<model>`, the topic the picker expects of a pod."""
    return f"kv@{host}:{port}@{model}"


def binds(endpoint: str) -> bool:
    """Whether a PUB socket on `endpoint` binds (else it connects): vLLM's rule."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return not endpoint.startswith("tcp://") or host in ("*", "0.0.0.0", "::")


class KvEventPublisher:
    """Publishes `events` on `endpoint` under `topic` while started (a daemon front: started
    when the daemon serves, stopped when it shuts down). The sockets are opened at construction,
    so a taken or malformed endpoint fails the daemon's start (ValueError naming the flag)."""

    def __init__(self, events: KvEventLog, endpoint: str, topic: str, medium: str,
                 replay_endpoint: str | None = None) -> None:
        self._events = events
        self._topic = topic.encode()
        self._medium = medium
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=KEPT_MESSAGES)
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._open(zmq.PUB, endpoint, "--kv-events-endpoint", bind=binds(endpoint))
            if replay_endpoint:
                self._replay = self._open(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint", bind=True)
        except ValueError:
            self._context.destroy(linger=0)  # closes the socket already opened
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)

    def _open(self, kind: int, endpoint: str, flag: str, bind: bool) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"{flag} {endpoint!r}: {exc}") from None
        return socket

    def start(self) -> None:
        self._thread.start()
        log.info("kv events over zmq", extra={"fields": {"topic": self._topic.decode(),
                                                          "replay": self._replay is not None}})

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def join(self, timeout: float) -> None:
        """`stop` has closed everything already."""

    def _run(self) -> None:
        cursor = self._resync()
        while not self._stop.is_set():
            changes = self._events.changes_after(cursor)
            if changes is None:  # fell behind the log's history
                cursor = self._resync()
                continue
            for change in changes:
                self._send(change.sequence, self._change_events(change))
                cursor = change.sequence
            if self._replay is None:
                self._events.wait(cursor, 0.5)
            elif self._replay.poll(_POLL_MS):
                self._answer_replay()

    def _resync(self) -> int:
        sequence, media = self._events.snapshot_blocks()
        self._send(sequence, [["AllBlocksCleared"], *(e for medium, blocks in media.items()
                                                       for e in self._stored_events(blocks, medium))])
        return sequence

    def _send(self, sequence: int, events: list[list]) -> None:
        payload = msgpack.packb([time.time(), events])
        self._kept.append((sequence, payload))
        self._pub.send_multipart([self._topic, sequence.to_bytes(8, "big"), payload])

    def _answer_replay(self) -> None:
        identity, *frames = self._replay.recv_multipart()
        start = int.from_bytes(frames[-1], "big") if frames and len(frames[-1]) == 8 else None
        for sequence, payload in self._kept if start is not None else ():
            if sequence >= start:
                self._replay.send_multipart([identity, b"", sequence.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def _change_events(self, change: KvChange) -> list[list]:
        medium = self._medium_name(change.medium)
        removed = [["BlockRemoved", list(change.removed), medium]] if change.removed else []
        return removed + self._stored_events(change.stored_blocks, change.medium)

    def _medium_name(self, medium: str) -> str:
        """The pool is "GPU" or "CPU" (where it lives); the offload tier is "DISK"."""
        return self._medium if medium == POOL else medium.upper()

    def _stored_events(self, blocks: Iterable[StoredBlock], medium: str) -> list[list]:
        """BlockStored events, one per chain of consecutive blocks."""
        events: list[list] = []
        for block in blocks:
            chain = events[-1] if events else None
            if chain is not None and block.parent is not None and block.parent == chain[1][-1]:
                chain[1].append(block.block_hash)
                chain[3].extend(block.token_ids)
            else:
                events.append(["BlockStored", [block.block_hash], block.parent, list(block.token_ids),
                               self._events.block_size, None, self._medium_name(medium)])
        return events


def attach_kv_event_publisher(daemon: GrpcDaemon, config: DaemonConfig, events: KvEventLog, port: int,
                              model: str) -> None:
    """With `--kv-events-endpoint`, publish `events` while `daemon` serves; the default topic names
    the node by its advertised host, `port` (its HTTP port where it has one) and `model`."""
    if not config.kv_events_endpoint:
        return
    topic = config.kv_events_topic or default_topic(config.advertise_host or config.host, port, model)
    daemon.add_front(KvEventPublisher(events, config.kv_events_endpoint, topic,
                                      "GPU" if config.device == "cuda" else "CPU",
                                      config.kv_events_replay_endpoint or None))
