"""Entry point: `python -m decode_node --host H --port P ...`."""
from __future__ import annotations

import dataclasses
import sys

import torch

from common.daemon import GrpcDaemon, setup_logging
from common.model_loading import load_model_and_tokenizer
from decode_node.config import parse_args
from decode_node.node import DecodeNode
from decode_node.service import DecodeNodeService
from protos.duet.v1 import duet_pb2, duet_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log_level)
    torch.set_grad_enabled(False)
    daemon = GrpcDaemon(config.host, config.port)  # bind first: a taken port fails fast
    if not config.advertise_address:  # with --port 0 only the bound port is known
        config = dataclasses.replace(config, advertise_address=f"{config.host}:{daemon.port}")
    model, tokenizer = load_model_and_tokenizer(config.model)
    node = DecodeNode(config, model, tokenizer)
    duet_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeService(node), daemon.server)
    daemon.serve(
        [duet_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name],
        metrics_registry=node.metrics.registry,
        metrics_port=config.metrics_port,
        on_shutdown=node.shutdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
