"""Entry point: `python -m decode_node --host H --port P ...`."""
from __future__ import annotations

import dataclasses
import sys

from common.openai_http import attach_openai_front, served_model_name
from common.serving.daemon import GrpcDaemon, run_node
from common.serving.kv_events_zmq import attach_kv_event_publisher
from common.serving.model_loading import load_model_and_tokenizer
from decode_node.config import DecodeNodeConfig, parse_args
from decode_node.node import DecodeNode
from decode_node.service import DecodeNodeService
from protos.duet.v1 import duet_pb2_grpc


def start(daemon: GrpcDaemon, config: DecodeNodeConfig) -> DecodeNode:
    config = dataclasses.replace(config, port=daemon.port)  # with --port 0 only the bound port is known
    node = DecodeNode(config, *load_model_and_tokenizer(config.model, config.torch_dtype, config.device,
                                                          attention_sinks=config.attention_sinks, dtype_flag=config.dtype,
                                                          quantization=config.quantization),
                      on_draining=lambda: daemon.set_ready(False))
    duet_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeService(node, daemon.draining, daemon.request_stop),
                                                   daemon.server)
    daemon.before_stop(node.drain_before_stop)
    front = None
    if config.openai_port is not None:
        front = attach_openai_front(daemon, config.tls, config.openai_port, config.served_model_name, config.model,
                                    config.api_key, config.tool_call_parser, registry=node.metrics.registry,
                                    max_model_len=node.engine.model.config.max_position_embeddings,
                                    api_server_count=config.api_server_count, max_generations=config.max_requests,
                                    drain_seconds=config.drain_seconds,
                                    strip_billing_header=config.anthropic_billing_header == "strip",
                                    log_level=config.log_level)
    attach_kv_event_publisher(daemon, config, node.engine.kv_events, front.port if front else daemon.port,
                              front.model_name if front else served_model_name(config.model))
    return node


if __name__ == "__main__":
    sys.exit(run_node(parse_args(), "duet.v1.DecodeNode", start))
