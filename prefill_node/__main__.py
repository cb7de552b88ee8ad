"""Entry point: `python -m prefill_node --host H --port P ...`."""
from __future__ import annotations

import sys

from common.openai_http import served_model_name
from common.serving.daemon import GrpcDaemon, run_node
from common.serving.kv_events_zmq import attach_kv_event_publisher
from common.serving.model_loading import load_model_and_tokenizer
from prefill_node.config import PrefillNodeConfig, parse_args
from prefill_node.node import PrefillNode
from prefill_node.service import PrefillNodeService
from protos.duet.v1 import duet_pb2_grpc


def start(daemon: GrpcDaemon, config: PrefillNodeConfig) -> PrefillNode:
    node = PrefillNode(config, load_model_and_tokenizer(config.model, config.torch_dtype, config.device,
                                                        attention_sinks=config.attention_sinks, dtype_flag=config.dtype,
                                                        quantization=config.quantization)[0])
    duet_pb2_grpc.add_PrefillNodeServicer_to_server(PrefillNodeService(node, daemon.draining), daemon.server)
    attach_kv_event_publisher(daemon, config, node.engine.kv_events, daemon.port,
                              served_model_name(config.model))
    return node


if __name__ == "__main__":
    sys.exit(run_node(parse_args(), "duet.v1.PrefillNode", start))
