"""Entry point: `python -m decode_node --host H --port P ...`."""
from __future__ import annotations

import dataclasses
import sys

from common.daemon import GrpcDaemon, run_node
from common.model_loading import load_model_and_tokenizer
from decode_node.config import DecodeNodeConfig, parse_args
from decode_node.node import DecodeNode
from decode_node.service import DecodeNodeService
from protos.duet.v1 import duet_pb2_grpc


def start(daemon: GrpcDaemon, config: DecodeNodeConfig) -> DecodeNode:
    config = dataclasses.replace(config, port=daemon.port)  # with --port 0 only the bound port is known
    node = DecodeNode(config, *load_model_and_tokenizer(config.model))
    duet_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeService(node), daemon.server)
    return node


if __name__ == "__main__":
    sys.exit(run_node(parse_args(), "duet.v1.DecodeNode", start))
