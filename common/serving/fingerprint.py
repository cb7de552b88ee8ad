"""The compatibility fingerprint: KV written by one node is only meaningful in a pool of a
node that agrees on every field."""
from __future__ import annotations

from common.kv.pool import LAYOUT_VERSION, KVPool
from common.model.decoder import DecoderModel
from protos.duet.v1 import duet_pb2 as pb

_FIELDS = ("model_hash", "dtype", "num_layers", "num_kv_heads", "head_dim", "page_size", "layout_version")


def fingerprint_of(model: DecoderModel, pool: KVPool) -> pb.CompatibilityFingerprint:
    return pb.CompatibilityFingerprint(
        model_hash=model.model_hash, dtype=str(pool.dtype).removeprefix("torch."),
        num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
        page_size=pool.page_size, layout_version=LAYOUT_VERSION,
    )


def fingerprint_key(model: DecoderModel, pool: KVPool) -> str:
    """Every field of the fingerprint in one line: what a disk tier's files must agree on."""
    fingerprint = fingerprint_of(model, pool)
    return ";".join(f"{f}={getattr(fingerprint, f)}" for f in _FIELDS)


def mismatch(ours: pb.CompatibilityFingerprint, theirs: pb.CompatibilityFingerprint,
             our_role: str, their_role: str) -> str | None:
    """A message naming every field that differs, or None when compatible."""
    diffs = [f"{f}: {our_role} has {getattr(ours, f)!r}, {their_role} has {getattr(theirs, f)!r}"
             for f in _FIELDS if getattr(ours, f) != getattr(theirs, f)]
    return "incompatible KV layout (" + "; ".join(diffs) + ")" if diffs else None
