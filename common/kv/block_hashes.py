"""Chained hashes of page-sized token blocks: the names KV events give cached pages.

Block i of a prompt is tokens `[i*block_size, (i+1)*block_size)`; its hash is BLAKE2b-64 of the
previous block's hash (0 before the first) followed by the block's token ids as little-endian
int32. A hash therefore stands for every token up to its block's end, like the page it names in
the radix cache, and a prompt's cached prefix on a node is the run of its leading hashes that
node holds. Deterministic across processes and hosts (no per-process salt), so a router computes
the same names as the nodes.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def salted_root(salt: int) -> int:
    """The hash the blocks of a salted tree of the prefix cache chain from (ROOT_HASH for salt 0):
    a one-token block of `-salt`, which no prompt's page-sized block of token ids can equal."""
    return ROOT_HASH if salt == 0 else chain_hash(ROOT_HASH, [-salt])


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """The hash of `block` following the block hashed `parent` (ROOT_HASH for the first)."""
    data = parent.to_bytes(8, "little") + np.asarray(block, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of `token_ids`, in order (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
