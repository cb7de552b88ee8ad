"""One API server's routes alone (common/openai_http/server.py), in process, against a stand-in
for the daemon's gRPC server: readiness, the node's refusals and their Retry-After, the refusals
the API server makes itself, and a client that leaves before any output."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from common.openai_http.api_keys import ApiKeys
from common.openai_http.gateway_routes import GatewayRoutes
from common.openai_http.server import Front
from common.serving.grpc_status import retry_metadata
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}


class StandInNode(duet_pb2_grpc.DecodeNodeServicer):
    """Generate refuses with RESOURCE_EXHAUSTED and a retry hint while `refuse` is set; else it
    says nothing until its call is cancelled, which it records."""

    def __init__(self) -> None:
        self.refuse = False
        self.cancelled = asyncio.Event()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerationChunk]:
        if self.refuse:
            context.set_trailing_metadata(retry_metadata(7))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield pb.GenerationChunk()


def with_front(test: Callable[[TestClient, StandInNode, HealthServicer], Awaitable[None]], tmp_path,
               **front_args) -> None:
    """Run `test` with a client of a Front whose daemon is a StandInNode on a Unix socket."""
    async def run() -> None:
        server = grpc.aio.server()
        node, health = StandInNode(), HealthServicer()
        duet_pb2_grpc.add_DecodeNodeServicer_to_server(node, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        target = f"unix:{tmp_path}/grpc.sock"
        server.add_insecure_port(target)
        await server.start()
        channel = grpc.aio.insecure_channel(target)
        front = Front(front_args.pop("model_names", ("m",)), channel, GatewayRoutes(), ApiKeys(), **front_args)
        try:
            async with TestClient(TestServer(front.app(), handler_cancellation=True)) as client:
                await test(client, node, health)
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_health_follows_the_daemons_grpc_health(tmp_path) -> None:
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        answer = await client.get("/health")
        assert answer.status == 503 and answer.headers["Retry-After"].isdigit()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert (await client.get("/health/")).status == 200
        for path in ("/metrics", "/tokenize"):  # no registry, no tokenizer: 404, not a crash
            answer = await (client.get(path) if path == "/metrics" else client.post(path, json={"prompt": "x"}))
            assert answer.status == 404 and "error" in await answer.json()

    with_front(test, tmp_path)


def test_models_by_name_also_with_slashes(tmp_path) -> None:
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        for path in ("/v1/models/org/m", "/v1/models/org/m/"):
            assert (await (await client.get(path)).json())["id"] == "org/m"
        answer = await client.get("/v1/models/other")
        assert answer.status == 404 and (await answer.json())["error"]["code"] == "model_not_found"

    with_front(test, tmp_path, model_names=("org/m",))


def test_a_refusal_of_the_node_is_a_429_with_its_retry_hint(tmp_path) -> None:
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        node.refuse = True
        answer = await client.post("/v1/completions", json=BODY)
        assert answer.status == 429 and answer.headers["Retry-After"] == "7"
        error = (await answer.json())["error"]
        assert (error["type"], error["code"], error["message"]) == ("rate_limit_error", "resource_exhausted",
                                                                    "no room")

    with_front(test, tmp_path)


def test_past_the_nodes_cap_the_api_server_refuses_itself(tmp_path) -> None:
    """Holding --max-requests calls already, the API server answers 429 without calling the node."""
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        held = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.5)  # its call is in flight, silent
        answer = await client.post("/v1/completions", json=BODY)
        assert answer.status == 429 and answer.headers["Retry-After"].isdigit()
        assert "--max-requests 1" in (await answer.json())["error"]["message"]
        held.cancel()

    with_front(test, tmp_path, max_generations=1)


def test_past_the_connection_cap_a_request_gets_503(tmp_path) -> None:
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        answer = await client.get("/v1/models")
        assert answer.status == 503 and answer.headers["Retry-After"].isdigit()
        assert answer.headers["Connection"] == "close"

    with_front(test, tmp_path, max_connections=1, open_connections=lambda: 2)


def test_a_client_that_leaves_before_any_output_cancels_its_call(tmp_path) -> None:
    """While a request yields nothing (waiting for admission on the node), a client that hangs up
    still cancels the gRPC call, so the node frees what it holds."""
    async def test(client: TestClient, node: StandInNode, health: HealthServicer) -> None:
        request = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await asyncio.sleep(0.5)
        assert not node.cancelled.is_set()
        request.cancel()  # the client closes its connection
        await asyncio.wait_for(node.cancelled.wait(), 10)

    with_front(test, tmp_path)
