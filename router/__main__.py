"""The router daemon: `python -m router --decode HOST:PORT ... --prefill HOST:PORT ...`.

Serves duet.v1.DecodeNode/Generate and runs the hand-off over its pools, choosing nodes per
`--routing` (common/peers/routing.py) from their load and, by default, their KV events. Membership can change
while it runs: with `--members FILE` (JSON `{"decode": [...], "prefill": [...]}`) the file is
re-read whenever it changes. A decode node that dies mid-stream has its requests continued on
another (`--migration-limit`, router/continuation.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from common.model.default_model import default_model_path
from common.model.tokenizer import load_tokenizer
from common.openai_http import add_openai_args, attach_openai_front
from common.peers.kv_index import KvIndex
from common.peers.kv_watch import KvWatch
from common.peers.membership import Membership
from common.peers.prefill_pool import PrefillPool
from common.peers.routing import NodeChooser, RoutingPolicy, add_routing_args
from common.serving.daemon import GrpcDaemon, setup_logging
from common.serving.daemon_config import add_tls_args
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2_grpc
from router.router import Router
from router.service import RouterService

log = logging.getLogger("router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router",
                                description="duet router: serves DecodeNode/Generate over N prefill x M decode nodes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode node (repeatable)")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill node (repeatable)")
    p.add_argument("--members", type=Path, help="JSON file of members, re-read when it changes")
    p.add_argument("--model", type=Path, default=None, help="model whose tokenizer renders text prompts "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=32)
    p.add_argument("--poll-seconds", type=float, default=1.0, help="health/load polling period")
    p.add_argument("--migration-limit", type=int, default=1, metavar="N",
                   help="how many times one request may be continued on another decode node after its decode "
                   "node died mid-stream, from the tokens already streamed; 0: the break reaches the client as "
                   "UNAVAILABLE (default %(default)s)")
    p.add_argument("--prefix-fetch", choices=("on", "off"), default="on",
                   help="with --routing prefix: when another decode node holds more of a prompt than the one chosen "
                   "(in its pool or disk tier), name it in the Generate (prefix_holder) so the chosen node fetches the "
                   "prefix from it instead of computing it (default %(default)s)")
    add_routing_args(p, "the decode node and the prefill node of each request")
    add_tls_args(p)
    add_openai_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.api_key and args.openai_port is None:
        p.error("--api-key guards the HTTP API: give --openai-port too")
    if args.migration_limit < 0:
        p.error(f"--migration-limit must be >= 0 (0 turns continuation after a decode node's crash off), "
                f"got {args.migration_limit}")
    args.tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        args.tls.validate()
        args.policy = RoutingPolicy(args.routing, args.load_weight)
    except ValueError as exc:
        p.error(str(exc))
    return args


def watch_members(path: Path, decode: Membership, prefill: PrefillPool, stop: threading.Event, period: float) -> None:
    seen = None
    while not stop.wait(period):
        try:
            mtime = path.stat().st_mtime
            if mtime != seen:
                members = json.loads(path.read_text())
                decode.set(list(members.get("decode", [])))
                prefill.set(list(members.get("prefill", [])))
                seen = mtime
                log.info("membership loaded", extra={"fields": members})
        except (OSError, ValueError) as exc:
            log.warning("cannot read members file", extra={"fields": {"path": str(path), "error": str(exc)}})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    daemon = GrpcDaemon(args.host, args.port, args.tls)
    decode = Membership(duet_pb2_grpc.DecodeNodeStub, args.decode, args.poll_seconds, tls=args.tls)
    prefill = PrefillPool(args.prefill, args.poll_seconds, tls=args.tls, policy=args.policy)
    index = KvIndex() if args.policy.mode == "prefix" else None
    watch = KvWatch(decode, index, retry_seconds=args.poll_seconds) if index is not None else None
    router = Router(load_tokenizer(args.model or default_model_path()), decode, prefill,
                    NodeChooser(args.policy, index), args.min_remote_prefill_tokens, args.migration_limit,
                    prefix_fetch=args.prefix_fetch == "on")
    duet_pb2_grpc.add_DecodeNodeServicer_to_server(RouterService(router), daemon.server)
    decode.on_health = lambda: daemon.set_ready(bool(decode.healthy()))  # SERVING while a decode node is healthy
    decode.on_health()
    if args.openai_port is not None:
        attach_openai_front(daemon, args.tls, args.openai_port, args.served_model_name, args.model,
                            args.api_key, args.tool_call_parser, registry=router.registry,
                            api_server_count=args.api_server_count,
                            strip_billing_header=args.anthropic_billing_header == "strip", log_level=args.log_level)
    stop = threading.Event()
    if args.members is not None:
        threading.Thread(target=watch_members, args=(args.members, decode, prefill, stop, args.poll_seconds),
                         daemon=True).start()

    def shutdown() -> None:
        stop.set()
        if watch is not None:
            watch.close()
        decode.close()
        prefill.close()

    daemon.serve(["duet.v1.DecodeNode"], metrics_registry=router.registry, metrics_port=args.metrics_port,
                 on_shutdown=shutdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
