"""Writing KV into a decode node's reserved slots, with the control calls around the bytes:
BeginTransfer before the first byte, CompleteTransfer (with the KV's checksums when the decode
node verifies them) after the last, and an `abandoned` report when a one-sided transfer failed,
so the decode node can reuse the pages at once instead of quarantining them.

Two kinds of node write: a prefill node writes the KV it computes, layer by layer as the forward
finishes each; a decode node writes KV it already holds (`write`): a running request's when it
migrates it to another decode node (decode_node/migration.py), a cached prefix's when another
decode node fetches it (decode_node/prefix_fetch.py). Both write through one `KvWriter`.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from common.daemon_limits import check_prompt, check_request_id
from common.engine.attention_window import layer_skips
from common.engine.core import Engine
from common.errors import ErrorCode, FailedPrecondition, InvalidArgument, RequestError, Unavailable
from common.kv.segments import MetadataError, MultiGroupUnreadable, Placement
from common.model.decoder import DecoderModel
from common.node_messages import SendRequest
from common.peers.decode_client import ChannelClosed, DecodeClient
from common.peers.decode_peers import DecodePeer, DecodePeers
from common.serving.incarnation import INCARNATION, writer_identity
from common.serving.tls import TlsFiles
from common.transports import TransferError
from common.transports.checksum import kv_checksums
from common.transports.connector import KvSender, Transfer
from common.transports.layer_slots import layer_pieces, receiver_layer_slots, sender_layer_slots
from protos.duet.v1 import duet_pb2 as pb

log = logging.getLogger(__name__)
TELL_TIMEOUT_S = 2.0  # a best-effort word to a decode node (an abandoned transfer, an Abort)


def check_send_request(req: SendRequest, model: DecoderModel) -> list[int]:
    """What a node is asked to write (RemoteSend, SendPrefix), checked before anyone is contacted:
    the request id, the prompt, the window `0 <= begin < end < len(token_ids)` (the decode node
    computes the last token itself) and the shape of `kv_append_metadata`, which is returned."""
    check_request_id(req.request_id)
    n, begin, end = len(req.token_ids), req.kv_window_begin, req.kv_window_end
    if not 0 <= begin < end < n:
        raise InvalidArgument(f"need 0 <= kv_window_begin < kv_window_end < len(token_ids); got "
                              f"begin={begin}, end={end}, {n} tokens")
    cfg = model.config
    check_prompt(req.token_ids, cfg.vocab_size, cfg.max_position_embeddings)
    metadata = list(req.kv_append_metadata)
    read_placement(metadata, model, begin, end, 2**62, 2**62)
    return metadata


def read_placement(metadata: list[int], model: DecoderModel, begin: int, end: int, num_slots: int,
                   sliding_slots: int) -> Placement:
    """`kv_append_metadata` of a window `[begin, end)` for a pool of `num_slots` slots (and
    `sliding_slots` in its sliding group): INVALID_ARGUMENT when it does not fit, FAILED_PRECONDITION
    for the two-group form at a node whose model has no sliding layers."""
    skips = layer_skips(model.config, begin, end)
    sliding = [skips[i] for i in model.sliding_layers]
    try:
        return Placement.from_wire(metadata, end - begin, num_slots, end - begin - min(sliding) if sliding else None,
                                   sliding_slots)
    except MultiGroupUnreadable as exc:
        raise FailedPrecondition(str(exc)) from None
    except MetadataError as exc:
        raise InvalidArgument(f"kv_append_metadata: {exc}") from None


@dataclass
class OpenTransfer:
    """One request's transfer into a decode node's reservation, admitted by BeginTransfer."""

    peer: DecodePeer
    request_id: str
    nonce: int
    transfer: Transfer


class KvWriter:
    def __init__(self, engine: Engine, sender: KvSender, fingerprint: pb.CompatibilityFingerprint,
                 advertise_address: str, tls: TlsFiles) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.sender = sender
        self.tls = tls
        self.peers = DecodePeers(fingerprint, writer_identity(advertise_address), sender, tls)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kv-checksum")  # beside the transfer's wait

    def close(self) -> None:
        self._hasher.shutdown()
        self.peers.close()
        self.sender.close()

    def destination(self, peer: DecodePeer, metadata: list[int], begin: int, end: int) -> list[np.ndarray]:
        """Per layer, the reserved slots `metadata` names on `peer` of what the layer moves of the
        window `[begin, end)` (`read_placement`, `receiver_layer_slots`)."""
        try:
            placement = read_placement(metadata, self.engine.model, begin, end, peer.info.num_slots,
                                       peer.info.sliding_slots)
        except RequestError as exc:
            raise type(exc)(f"decode node {peer.address}: {exc}") from None
        return receiver_layer_slots(placement, layer_skips(self.engine.model.config, begin, end),
                                    self.engine.model.sliding_layers)

    def source(self, window: torch.Tensor, skips: Sequence[int]) -> list[np.ndarray]:
        """Per layer, this node's slots of what the layer moves of a window whose positions lie
        at the full slots `window` (`sender_layer_slots`)."""
        sliding = self.engine.sliding
        return sender_layer_slots(window, skips, self.pool.sliding_layers, None if sliding is None else sliding.slots)

    @contextmanager
    def transfer(self, peer: DecodePeer, request_id: str, nonce: int, metadata: list[int], deadline: float,
                 on_layer_done: Callable[[int], None] = lambda layer: None) -> Iterator[OpenTransfer]:
        """The transfer into the reservation (request_id, nonce) at `peer`, begun (`begin`), for
        the body to post its layers into and `finish`; stopped (`fail`) if the body raises. The
        one shape of a transfer, for the prefill node's computed KV and a decode node's held KV."""
        job = self.begin(peer, request_id, nonce, metadata, deadline, on_layer_done)
        try:
            yield job
        except BaseException:
            self.fail(job)
            raise

    def begin(self, peer: DecodePeer, request_id: str, nonce: int, metadata: list[int], deadline: float,
              on_layer_done: Callable[[int], None] = lambda layer: None) -> OpenTransfer:
        """Be admitted to the reservation (request_id, nonce) at `peer` (BeginTransfer), then open
        the transfer that writes it, to be done by `deadline` (time.monotonic())."""
        self.call(peer, lambda timeout: peer.client.begin_transfer(request_id, nonce, metadata, INCARNATION, timeout),
                  deadline)
        try:
            transfer = self.sender.open(peer.address, request_id, nonce, max(0.1, deadline - time.monotonic()),
                                        on_layer_done=on_layer_done)
        except TransferError as exc:
            self.peers.drop(peer.address)
            self.abandon(peer, request_id, nonce)
            raise Unavailable(str(exc)) from None
        return OpenTransfer(peer, request_id, nonce, transfer)

    def finish(self, job: OpenTransfer, src: list[np.ndarray], deadline: float) -> None:
        """Wait for every byte to land, then tell the decode node (CompleteTransfer, with the
        checksums of this node's slots `src` of each layer (`source`), when it verifies KV:
        computed meanwhile)."""
        peer = job.peer
        checksums = None
        if peer.info.verify_kv:
            checksums = self._hasher.submit(kv_checksums, self.pool, src)
        try:
            job.transfer.finish()
        except TransferError as exc:
            if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED) or exc.in_flight:
                # A dead or stalled peer: forget its endpoint, so the next request re-handshakes
                # instead of reusing a connection that may still carry this transfer's bytes.
                self.peers.drop(peer.address)
            raise RequestError(str(exc), exc.code) from None
        self.call(peer, lambda timeout: peer.client.complete_transfer(
            job.request_id, job.nonce, timeout, checksums=checksums.result() if checksums else ()), deadline)

    def write(self, peer: DecodePeer, request_id: str, nonce: int, metadata: list[int], src_slots: torch.Tensor,
              deadline: float) -> None:
        """Write K/V this node holds, at `src_slots` (the reserved window's positions, in order),
        into the reservation (request_id, nonce) at `peer`, each layer what `layer_skips` says it
        moves: admitted, every layer posted, every byte landed, confirmed."""
        n, src = len(src_slots), torch.as_tensor(src_slots)
        dst = self.destination(peer, metadata, 0, n)
        skips = layer_skips(self.engine.model.config, 0, n)
        sliding = self.engine.sliding
        with self.transfer(peer, request_id, nonce, metadata, deadline) as job:
            pieces = layer_pieces(src, 0, skips, self.pool.sliding_layers, None if sliding is None else sliding.slots, dst)
            for layer, moved in enumerate(pieces):
                job.transfer.post_layer(layer, moved)
            self.finish(job, self.source(src, skips), deadline)

    def fail(self, job: OpenTransfer) -> None:
        """Stop a transfer that will not complete; when its writes landed unseen (one-sided) and
        none can land any more, say so (CompleteTransfer{abandoned})."""
        if job.transfer.cancel() and self.sender.one_sided:
            self.abandon(job.peer, job.request_id, job.nonce)

    def call(self, peer: DecodePeer, rpc: Callable[[float], None], deadline: float) -> None:
        """One control-plane call to the decode node (`rpc(timeout)`), within the transfer's
        deadline; a node that is gone is forgotten, so the next request re-handshakes."""
        try:
            rpc(max(0.1, deadline - time.monotonic()))
        except RequestError as exc:
            if exc.code is ErrorCode.UNAVAILABLE:
                self.peers.drop(peer.address)
            raise

    def abandon(self, peer: DecodePeer, request_id: str, nonce: int) -> None:
        """Tell the decode node that this failed transfer will write nothing more, so it can
        reuse the pages at once instead of holding them until its --quarantine-seconds pass.
        Best effort: when the decode node is unreachable, the quarantine ends it."""
        try:
            self.tell(peer, lambda client: client.complete_transfer(request_id, nonce, TELL_TIMEOUT_S, abandoned=True))
        except RequestError as exc:
            log.info("could not report an abandoned transfer", extra={"fields": {
                "request_id": request_id, "error": str(exc)}})

    def tell(self, peer: DecodePeer, rpc: Callable[[DecodeClient], None]) -> None:
        """A short call to `peer` (`rpc(client)`) that also works after a failed transfer dropped
        it (closing its channel): then over a channel of its own. Raises RequestError."""
        try:
            rpc(peer.client)
        except ChannelClosed:
            with DecodeClient.dial(peer.address, self.tls) as client:
                rpc(client)
