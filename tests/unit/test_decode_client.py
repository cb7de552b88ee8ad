"""DecodeClient (common/peers/decode_client.py): a failed call is a RequestError naming the node
with its status; a call on a closed client is ChannelClosed, which KvWriter.tell retries over a
channel of its own."""
from __future__ import annotations

import pytest

from common.errors import ErrorCode, RequestError
from common.peers.decode_client import ChannelClosed, DecodeClient
from common.serving.tls import TlsFiles
from harness.local_daemons import free_port


def test_an_unreachable_node_is_unavailable_naming_it():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with DecodeClient.dial(address, TlsFiles()) as client:
        with pytest.raises(RequestError) as caught:
            client.get_load(timeout=2.0)
    assert caught.value.code is ErrorCode.UNAVAILABLE
    assert f"decode node {address}" in str(caught.value)


def test_a_closed_client_says_so():
    client = DecodeClient.dial(f"127.0.0.1:{free_port()}", TlsFiles())
    client.close()
    with pytest.raises(ChannelClosed):
        client.abort("r1", timeout=1.0)
