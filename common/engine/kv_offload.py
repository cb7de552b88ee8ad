"""The prefix cache's pages kept on the disk tier (common/kv/disk_tier.py), and read back.

**Writing** is write-through and off the engine's step: when the prefix cache starts recording a
whole full page, `KvOffload` queues its block. A writer thread finds the page that holds it now
(`PrefixCache.page_of`), takes one more reference on it for the write (so it is neither evicted nor
reused meanwhile; a cached full page is never written to), reads its bytes from the pool without
the engine lock, writes the file and drops the reference. The cache evicts least recently used
pages first, so a page is on disk long before the pool lets it go, and a node killed at any
moment leaves on disk what it had cached. A block evicted before its turn, or queued while the
writer is a whole pool behind, is skipped (counted): a slow disk costs disk hits, never pool
pages or step time.

**Reading** runs on the caller's thread (a request's, never the engine's): `read_back(prompt)`
finds the prompt's full pages the pool lacks and the tier holds, right after those the pool
holds, reads and verifies their files without the engine lock, then takes pages, fills them and
records them in the prefix cache, so the request's own match finds them and it is admitted with
them in. A bad file ends the run there (the rest is computed); no token ever comes from a page
that failed its checksum.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.core import Engine, locked
from common.kv.block_hashes import block_hashes
from common.kv.disk_tier import DiskTier
from common.kv.page_allocator import OutOfPages

log = logging.getLogger(__name__)


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
    writes_skipped: int = 0  # evicted before the writer's turn, or the writer was a pool behind
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
        self._queue: queue.SimpleQueue[tuple[int, int | None, tuple[int, ...]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_pages, name="kv-offload-writer", daemon=True)
        self._writer.start()
        engine.prefix_cache.on_cached = self._cached

    def close(self) -> None:
        """Stop after the queued writes (their pages go back to the pool)."""
        self._queue.put(None)
        self._writer.join()

    # ---- writing ----

    def _cached(self, block_hash: int, parent: int | None, token_ids: tuple[int, ...]) -> None:
        """The prefix cache recorded a page (under the engine lock): queue it for the writer."""
        if self._queue.qsize() >= self.engine.allocator.num_pages:
            self.stats.writes_skipped += 1
        elif block_hash not in self.tier:
            self._queue.put((block_hash, parent, token_ids))

    def _write_pages(self) -> None:
        while (item := self._queue.get()) is not None:
            block_hash, parent, token_ids = item
            page = self._pin(block_hash)
            if page is None:
                self.stats.writes_skipped += 1  # evicted before its turn
                continue
            try:
                payload = self._page(page).view(torch.uint8).numpy().tobytes()
                if self.tier.write(block_hash, parent, token_ids, payload):
                    self.stats.pages_written += 1
                    self.stats.bytes_written += len(payload)
            except OSError as exc:
                self.stats.write_errors += 1
                log.warning("kv offload: a page could not be written", extra={"fields": {"error": str(exc)}})
            finally:
                self._unpin(page)

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
        self.engine.room_made.notify_all()  # it may be evictable again

    def _page(self, page: int) -> torch.Tensor:
        """A copy of one page's K/V, `[num_layers, 2, page_size, num_kv_heads, head_dim]`, on the CPU."""
        ps = self.engine.page_size
        return self.engine.pool.data[:, :, page * ps : (page + 1) * ps].contiguous().cpu()

    # ---- reading ----

    def read_back(self, token_ids: Sequence[int]) -> ReadBack:
        """Bring the full pages of `token_ids` that follow the pool's cached prefix and that the
        tier holds into the prefix cache. Call without the engine lock (it reads files)."""
        ps = self.engine.page_size
        hashes = block_hashes(token_ids, ps)
        with self.lock:
            have = self.engine.prefix_cache.matched_length(token_ids[: len(hashes) * ps]) // ps
        wanted = self.tier.held_run(hashes[have:])
        if not wanted:
            return ReadBack()
        started = time.perf_counter()
        payloads: list[bytes] = []
        for i in range(have, have + wanted):
            payload = self.tier.read(hashes[i], token_ids[i * ps : (i + 1) * ps])
            if payload is None:
                break
            payloads.append(payload)
        if not payloads:
            return ReadBack()
        pages = self._fill(token_ids, have, payloads)
        seconds = time.perf_counter() - started
        if not pages:
            return ReadBack()
        nbytes = sum(len(p) for p in payloads[:pages])
        self.stats.pages_read += pages
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += seconds
        self.stats.read_backs += 1
        return ReadBack(pages * ps, nbytes, seconds)

    def _fill(self, token_ids: Sequence[int], have: int, payloads: list[bytes]) -> int:
        """Put pages `have ..` of `token_ids` from `payloads` into the prefix cache; how many went in
        (0 when the pool's prefix shrank meanwhile or no pages could be had: they are computed)."""
        ps, cache = self.engine.page_size, self.engine.prefix_cache
        with self.lock:
            held, matched = cache.match(token_ids[: have * ps])
            try:
                if matched < have * ps:
                    raise OutOfPages(have, len(held))  # evicted meanwhile
                new = cache.allocate(len(payloads), after=held[-1] if held else None)
            except OutOfPages:
                self.engine.allocator.decref(held)
                return 0
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
