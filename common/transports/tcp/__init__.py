"""KV over plain TCP, for machines where NIXL/UCX cannot load: `receiver.py` (`TcpReceiver`) and
`sender.py` (`TcpSender`) behind the shared interface (common/transports/connector.py), over the
frames of `wire.py`."""
