"""The prefix cache's pages kept on the disk tier (common/kv/disk_tier.py), and read back.

**Writing** is write-through and off the engine's step: when the prefix cache starts recording a
whole full page, `KvOffload` queues its block. A writer thread finds the page that holds it now
(`PrefixCache.page_of`), takes one more reference on it for the write (so it is neither evicted nor
reused meanwhile; a cached full page is never written to), reads its bytes from the pool without
the engine lock, writes the file and drops the reference; a node killed at any moment leaves on
disk what it had cached. A full pool evicts pages as soon as requests release them, often before
the writer's turn: a page evicted before it is on disk is copied to memory on the spot (a copy
of one page's bytes, not a disk write), served from there until written, and written from there.
Past `STAGED_BYTES` of such copies waiting, evicted pages are skipped (counted): a slow disk
costs disk hits, never pool pages or step time.

**Reading** runs on the caller's thread (a request's, never the engine's): `read_back(prompt)`
finds the prompt's full pages the pool lacks and the tier holds, right after those the pool
holds, reads and verifies their files without the engine lock, then takes pages, fills them and
records them in the prefix cache, so the request's own match finds them and it is admitted with
them in. When running requests hold the whole pool it waits for room (up to `READ_BACK_WAIT_S`
or the request's deadline), as the request would wait in the scheduler's queue to compute them,
then computes them after all. A bad file ends the run there (the rest is computed); no token ever
comes from a page that failed its checksum.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.core import Engine, locked
from common.kv.block_hashes import block_hashes
from common.kv.disk_tier import DiskTier

log = logging.getLogger(__name__)
STAGED_BYTES = 256 << 20  # copies of evicted pages waiting for the writer, at most
READ_BACK_WAIT_S = 30.0  # how long a read-back waits for pages while running requests hold the pool


@dataclass(frozen=True)
class ReadBack:
    """What one `read_back` brought into the pool."""
    tokens: int = 0  # prompt positions now in the prefix cache that were on disk only
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class OffloadStats:
    """Running totals, read by the metrics (common/serving/tier_metrics.py)."""
    pages_written: int = 0
    bytes_written: int = 0
    writes_skipped: int = 0  # evicted while STAGED_BYTES of copies waited for the writer
    write_errors: int = 0  # the disk refused a write (full, read-only ...)
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    read_backs: int = 0  # read_back calls that brought at least one page


class KvOffload:
    def __init__(self, engine: Engine, tier: DiskTier) -> None:
        self.engine = engine
        self.tier = tier
        self.stats = OffloadStats()
        self.lock = engine.lock  # `locked` methods hold the engine's lock
        # (block hash, parent's hash, tokens) to write, or None: stop
        self._queue: queue.SimpleQueue[tuple[int, int | None, tuple[int, ...]] | None] = queue.SimpleQueue()
        self._staged: dict[int, tuple[tuple[int, ...], bytes]] = {}  # evicted, not yet written: tokens, bytes
        self._filling = threading.Lock()  # held by the read-back taking pages (or waiting for room)
        self._writer = threading.Thread(target=self._write_pages, name="kv-offload-writer", daemon=True)
        self._writer.start()
        engine.prefix_cache.on_cached = self._cached
        engine.prefix_cache.on_evicted = self._evicted

    def close(self) -> None:
        """Stop after the queued writes (their pages go back to the pool)."""
        self._queue.put(None)
        self._writer.join()

    # ---- writing ----

    def _cached(self, block_hash: int, parent: int | None, token_ids: tuple[int, ...]) -> None:
        """The prefix cache recorded a page (under the engine lock): queue it for the writer."""
        if block_hash not in self.tier:
            self._queue.put((block_hash, parent, token_ids))

    def _evicted(self, block_hash: int, parent: int | None, token_ids: tuple[int, ...], page: int) -> None:
        """The prefix cache is freeing a page (under the engine lock): if it is not on disk yet,
        queue a copy of its bytes."""
        if block_hash in self.tier or block_hash in self._staged:
            return
        if (len(self._staged) + 1) * self.tier.payload_bytes > STAGED_BYTES:
            self.stats.writes_skipped += 1
            return
        self._staged[block_hash] = (token_ids, self._page_bytes(page))
        self._queue.put((block_hash, parent, token_ids))

    def _write_pages(self) -> None:
        while (item := self._queue.get()) is not None:
            block_hash = item[0]
            if block_hash not in self.tier:  # queued again since (evicted, recorded anew)
                self._write_page(*item)
            with self.lock:
                self._staged.pop(block_hash, None)
                if self._queue.empty():  # the pages it held for writing are evictable again
                    self.engine.room_made.notify_all()

    def _write_page(self, block_hash: int, parent: int | None, token_ids: tuple[int, ...]) -> None:
        """From its copy when it was evicted, else from the page that holds it now."""
        with self.lock:
            staged = self._staged.get(block_hash)
        if staged is not None:
            self._write(block_hash, parent, token_ids, staged[1])
            return
        page = self._pin(block_hash)
        if page is None:
            return  # evicted while its copy could not be kept (counted)
        try:
            self._write(block_hash, parent, token_ids, self._page_bytes(page))
        finally:
            self._unpin(page)

    def _write(self, block_hash: int, parent: int | None, token_ids: tuple[int, ...], payload: bytes) -> None:
        try:
            if self.tier.write(block_hash, parent, token_ids, payload):
                self.stats.pages_written += 1
                self.stats.bytes_written += len(payload)
        except OSError as exc:
            self.stats.write_errors += 1
            log.warning("kv offload: a page could not be written", extra={"fields": {"error": str(exc)}})

    @locked
    def _pin(self, block_hash: int) -> int | None:
        """The page holding `block_hash`, with a reference for the writer; None if the cache let it go."""
        page = self.engine.prefix_cache.page_of(block_hash)
        if page is not None:
            self.engine.allocator.incref([page])
        return page

    @locked
    def _unpin(self, page: int) -> None:
        self.engine.allocator.decref([page])

    def _page_bytes(self, page: int) -> bytes:
        """One page's K/V as the pool lays it out, `[num_layers, 2, page_size, num_kv_heads, head_dim]`."""
        ps = self.engine.page_size
        kv = self.engine.pool.data[:, :, page * ps : (page + 1) * ps].contiguous().cpu()
        return kv.view(torch.uint8).numpy().tobytes()

    # ---- reading ----

    def read_back(self, token_ids: Sequence[int], deadline: float | None = None) -> ReadBack:
        """Bring the full pages of `token_ids` that follow the pool's cached prefix and that the
        tier holds into the prefix cache, waiting for room until `deadline` (monotonic) at most.
        Call without the engine lock (it reads files)."""
        ps = self.engine.page_size
        hashes = block_hashes(token_ids, ps)
        with self.lock:
            have = self.engine.prefix_cache.matched_length(token_ids[: len(hashes) * ps]) // ps
        started = time.perf_counter()
        payloads: list[bytes] = []
        for i in range(have, len(hashes)):
            payload = self._payload(hashes[i], token_ids[i * ps : (i + 1) * ps])
            if payload is None:
                break
            payloads.append(payload)
        if not payloads:
            return ReadBack()
        wait_until = min(deadline or math.inf, time.monotonic() + READ_BACK_WAIT_S)
        pages = self._fill(token_ids, have, payloads, wait_until)
        seconds = time.perf_counter() - started
        if not pages:
            return ReadBack()
        nbytes = sum(len(p) for p in payloads[:pages])
        self.stats.pages_read += pages
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += seconds
        self.stats.read_backs += 1
        return ReadBack(pages * ps, nbytes, seconds)

    def _payload(self, block_hash: int, token_ids: Sequence[int]) -> bytes | None:
        """A page's bytes from the copies waiting to be written, else from disk; None: neither has it."""
        with self.lock:
            staged = self._staged.get(block_hash)
        if staged is not None:
            return staged[1] if staged[0] == tuple(token_ids) else None
        return self.tier.read(block_hash, token_ids)

    def _fill(self, token_ids: Sequence[int], have: int, payloads: list[bytes], wait_until: float) -> int:
        """Put pages `have ..` of `token_ids` from `payloads` into the prefix cache; how many went in
        (as many as the pool has room for; 0 when the pool's prefix shrank meanwhile or no page could
        be had in time: the rest is computed). One read-back at a time takes pages or waits for them."""
        ps, cache = self.engine.page_size, self.engine.prefix_cache
        if not self._filling.acquire(timeout=max(0.0, wait_until - time.monotonic())):
            return 0
        try:
            with self.lock:
                while True:
                    held, matched = cache.match(token_ids[: have * ps])
                    if matched < have * ps:  # evicted meanwhile
                        self.engine.allocator.decref(held)
                        return 0
                    room = min(len(payloads), self.engine.allocator.num_free + cache.evictable_pages())
                    if room:
                        new = cache.allocate(room, after=held[-1] if held else None)
                        break
                    self.engine.allocator.decref(held)
                    if not self.engine.room_made.wait(max(0.0, wait_until - time.monotonic())):
                        return 0
        finally:
            self._filling.release()
        filled = False
        try:  # the new pages are this call's alone: fill them without the lock
            for page, payload in zip(new, payloads):
                self._put_page(page, payload)
            filled = True
        finally:
            with self.lock:
                if filled:
                    cache.insert(token_ids[: (have + len(new)) * ps], held + new)
                self.engine.allocator.decref(held + new)
        return len(new)

    def _put_page(self, page: int, payload: bytes) -> None:
        pool, ps = self.engine.pool, self.engine.page_size
        kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(pool.dtype)
        pool.data[:, :, page * ps : (page + 1) * ps] = kv.view(pool.num_layers, 2, ps, pool.num_kv_heads, pool.head_dim)
