"""The disk tier: full prefix pages kept as files beyond the pool, read back instead of recomputed.

One file per block, named by its chained block hash (common/kv/block_hashes.py) under a folder
per model fingerprint (`--kv-offload-dir DIR` holds `DIR/<fingerprint digest>/<hash>.kv`), so
nodes of different models or KV layouts can share a directory and never read each other's pages.
A file is

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | payload

where the header names the fingerprint, the block's hash, its parent's hash and its tokens, the
payload's length and its xxh3-64 checksum, and the payload is the page's K/V for every layer
(`[num_layers, 2, page_size, num_kv_heads, head_dim]` of the pool's dtype, as the pool lays it
out). Files are written under a temporary name and renamed, so a reader never sees half a write
under a block's name; a file that is short, garbled, of another fingerprint, whose tokens do not
hash to its name, or whose payload fails its checksum is a miss: counted by reason, deleted,
never served.

The index (which blocks are held, their size, least recently used first) lives in memory and is
rebuilt from the files' headers at start, so a node restarted on the same directory serves the
prefixes it held (a warm restart). Past `capacity_bytes` the least recently used files go.
With a `KvEventLog`, every block the tier starts or stops holding is reported with medium DISK.

Thread-safe: the index has its own lock and no file I/O happens under it.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from common.kv.block_hashes import ROOT_HASH, chain_hash
from common.kv.events import DISK, KvEventLog

MAGIC = b"DUETKV\x00\x01"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20
# Why a file was not served (each also a deleted file): what duet_kv_tier_errors counts.
TORN, CHECKSUM, FOREIGN = "torn", "checksum", "fingerprint"


@dataclass(frozen=True)
class TierBlock:
    block_hash: int
    parent: int | None  # the block before it; None: it starts its prompt
    token_ids: tuple[int, ...]
    size: int  # bytes of its file


class BadTierFile(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DiskTier:
    def __init__(self, directory: Path, capacity_bytes: int, fingerprint: str, payload_bytes: int,
                 events: KvEventLog | None = None) -> None:
        """`fingerprint`: the model and KV layout the pages belong to (all fields of the
        handshake's CompatibilityFingerprint); `payload_bytes`: one page's K/V."""
        if capacity_bytes < 0:
            raise ValueError("the disk tier's capacity must be >= 0")
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.capacity_bytes = capacity_bytes
        self.directory = Path(directory) / xxhash.xxh3_64_hexdigest(fingerprint.encode())
        self.directory.mkdir(parents=True, exist_ok=True)
        self.events = events
        self.errors: Counter[str] = Counter()  # by reason: files found bad and deleted
        self._lock = threading.Lock()
        self._index: OrderedDict[int, TierBlock] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._load_index()

    # ---- what is held ----

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    # ---- writing and reading ----

    def write(self, block_hash: int, parent: int | None, token_ids: Sequence[int], payload: bytes) -> bool:
        """Keep one page; False when it cannot be kept (larger than the capacity, or the disk
        refused: logged by the caller). Writing a block already held only marks it used."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a page's payload is {self.payload_bytes} bytes, got {len(payload)}")
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        tokens = tuple(int(t) for t in token_ids)
        header = json.dumps({"fingerprint": self.fingerprint, "block_hash": block_hash, "parent": parent,
                             "token_ids": tokens, "payload_bytes": len(payload),
                             "checksum": xxhash.xxh3_64_intdigest(payload)}).encode()
        data = MAGIC + _LENGTH.pack(len(header)) + header + payload
        if len(data) > self.capacity_bytes:
            return False
        path = self._path(block_hash)
        temporary = path.with_name(f".tmp-{secrets.token_hex(6)}-{path.name}")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = TierBlock(block_hash, parent, tokens, len(data))
                self._bytes += len(data)
                if self.events is not None:
                    self.events.stored(block_hash, parent, tokens, medium=DISK)
            dropped = self._shrink_locked()
        self._delete(dropped)
        return block_hash not in dropped

    def read(self, block_hash: int, token_ids: Sequence[int]) -> bytes | None:
        """The payload of `block_hash`, verified, whose tokens must be `token_ids`; None on a
        miss (not held, deleted meanwhile, or bad: then counted in `errors` and deleted)."""
        with self._lock:
            block = self._index.get(block_hash)
            if block is None:
                return None
            self._index.move_to_end(block_hash)
        try:
            data = self._path(block_hash).read_bytes()
        except OSError:  # deleted meanwhile, or unreadable: a miss
            self._forget(block_hash)
            return None
        try:
            header, payload = self._parse(data, block_hash)
            if xxhash.xxh3_64_intdigest(payload) != header["checksum"]:
                raise BadTierFile(CHECKSUM, "the payload does not match its checksum")
        except BadTierFile as exc:
            self._discard(block_hash, exc.reason)
            return None
        if tuple(header["token_ids"]) != tuple(int(t) for t in token_ids):
            return None  # a 64-bit hash collision: another prefix's page, kept for that prefix
        return payload

    # ---- the index ----

    def _load_index(self) -> None:
        """Rebuild the index from the files' headers, oldest modified first; leftovers of
        interrupted writes and bad headers are deleted."""
        found: list[tuple[float, TierBlock]] = []
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".kv":
                continue
            try:
                block_hash = int(path.stem, 16)
                with path.open("rb") as f:
                    head = f.read(len(MAGIC) + _LENGTH.size)
                    if len(head) < len(MAGIC) + _LENGTH.size:
                        raise BadTierFile(TORN, "shorter than a header")
                    (length,) = _LENGTH.unpack_from(head, len(MAGIC))
                    header = self._header(head + f.read(min(length, MAX_HEADER_BYTES)), block_hash)
                stat = path.stat()
                if stat.st_size != len(head) + length + header["payload_bytes"]:
                    raise BadTierFile(TORN, f"{stat.st_size} bytes where the header promises more or fewer")
                block = TierBlock(block_hash, header["parent"], tuple(header["token_ids"]), stat.st_size)
                found.append((stat.st_mtime, block))
            except ValueError:
                continue  # not a block's name: not ours
            except BadTierFile as exc:
                self.errors[exc.reason] += 1
                path.unlink(missing_ok=True)
        for _, block in sorted(found, key=lambda f: f[0]):
            self._index[block.block_hash] = block
            self._bytes += block.size
            if self.events is not None:
                self.events.stored(block.block_hash, block.parent, block.token_ids, medium=DISK)
        self._delete(self._shrink_locked())

    def _parse(self, data: bytes, block_hash: int) -> tuple[dict, bytes]:
        header = self._header(data, block_hash)
        start = len(MAGIC) + _LENGTH.size + _LENGTH.unpack_from(data, len(MAGIC))[0]
        payload = data[start:]
        if len(payload) != header["payload_bytes"]:
            raise BadTierFile(TORN, f"{len(payload)} payload bytes where the header says {header['payload_bytes']}")
        return header, payload

    def _header(self, data: bytes, block_hash: int) -> dict:
        """The header of a file's leading bytes, checked against this tier and `block_hash`."""
        if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + _LENGTH.size:
            raise BadTierFile(TORN, "not a duet KV page file")
        (length,) = _LENGTH.unpack_from(data, len(MAGIC))
        raw = data[len(MAGIC) + _LENGTH.size : len(MAGIC) + _LENGTH.size + length]
        if length > MAX_HEADER_BYTES or len(raw) != length:
            raise BadTierFile(TORN, "the header is cut short")
        try:
            header = json.loads(raw)
            tokens, parent = tuple(header["token_ids"]), header["parent"]
            payload_bytes, _ = int(header["payload_bytes"]), int(header["checksum"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadTierFile(TORN, f"unreadable header ({exc})") from None
        if header.get("fingerprint") != self.fingerprint:
            raise BadTierFile(FOREIGN, "written for another model or KV layout")
        if payload_bytes != self.payload_bytes or header.get("block_hash") != block_hash or \
                chain_hash(ROOT_HASH if parent is None else parent, tokens) != block_hash:
            raise BadTierFile(TORN, "the header does not describe this block")
        return header

    def _shrink_locked(self) -> list[int]:
        """Drop least recently used blocks past the capacity; returns their hashes (files to delete)."""
        dropped = []
        while self._bytes > self.capacity_bytes and self._index:
            block_hash, block = self._index.popitem(last=False)
            self._bytes -= block.size
            dropped.append(block_hash)
            if self.events is not None:
                self.events.removed(block_hash, medium=DISK)
        if self.events is not None:
            self.events.publish()
        return dropped

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            block = self._index.pop(block_hash, None)
            if block is None:
                return
            self._bytes -= block.size
            if self.events is not None:
                self.events.removed(block_hash, medium=DISK)
                self.events.publish()

    def _discard(self, block_hash: int, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1
        self._forget(block_hash)
        self._delete([block_hash])

    def _delete(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            self._path(block_hash).unlink(missing_ok=True)

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kv"
