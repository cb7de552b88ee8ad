"""Optional TLS / mutual TLS for every gRPC server and channel a node opens.

One certificate per node serves both ways: it is the server certificate of the node's own
gRPC port and the client certificate the node presents to its peers. With `--tls-ca`, servers
require a client certificate signed by that CA (mutual TLS), so only authorised nodes and
clients can obtain transport metadata, reserve pages or push KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from common.daemon_limits import CHANNEL_OPTIONS


@dataclass(frozen=True)
class TlsFiles:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def validate(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.ca is not None and self.cert is None:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes(), certificate_chain=Path(self.cert).read_bytes())

    def channel(self, address: str) -> grpc.Channel:
        """A channel to a peer: TLS (presenting this node's certificate) when enabled."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self.channel_credentials(), options=CHANNEL_OPTIONS)
