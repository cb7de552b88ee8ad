"""Entry point: `python -m prefill_node --host H --port P ...`."""
from __future__ import annotations

import sys

import torch

from common.daemon import GrpcDaemon, setup_logging
from common.model_loading import load_model_and_tokenizer
from prefill_node.config import parse_args
from prefill_node.node import PrefillNode
from prefill_node.service import PrefillNodeService
from protos.duet.v1 import duet_pb2, duet_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log_level)
    torch.set_grad_enabled(False)
    daemon = GrpcDaemon(config.host, config.port)
    model, _ = load_model_and_tokenizer(config.model)
    node = PrefillNode(config, model)
    duet_pb2_grpc.add_PrefillNodeServicer_to_server(PrefillNodeService(node), daemon.server)
    daemon.serve(
        [duet_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name],
        metrics_registry=node.metrics.registry,
        metrics_port=config.metrics_port,
        on_shutdown=node.shutdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
