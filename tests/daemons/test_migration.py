"""Live migration between real decode nodes (decode_node/migration.py): a stream moved mid-way is
token-identical to one that never moved, over both transports, for every kind of generation
state; bad input changes nothing; a failed or aborted migration leaves both nodes clean; a
draining node hands all its streams over and exits.

Every reference is the same request run unmigrated on the same node pair, in float32, so
"identical" is exact (tokens, text, finish reason, usage)."""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import Daemon
from harness.helpers import Started, call_status, random_ids, wait_clean

FLAGS = ("--dtype", "float32", "--speculative", "ngram", "--num-speculative-tokens", "4", "--lease-seconds", "5",
         "--quarantine-seconds", "8")
PROMPT = random_ids(200, seed=28)
# Text that repeats itself: n-gram drafts get accepted, so the speculative case really speculates.
COPY_PROMPT = random_ids(40, seed=3) * 4
NO_SPEC = {"num_speculative_tokens": 0}


def sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**{"max_tokens": 40, "ignore_eos": True, **fields})


def person_schema() -> pb.GuidedDecoding:
    return pb.GuidedDecoding(json_schema='{"type": "object", "properties": {"name": {"type": "string"}, '
                             '"age": {"type": "integer"}}, "required": ["name", "age"]}')


@dataclass
class Nodes:
    a: Daemon  # the source of most migrations
    b: Daemon  # their target
    spare: Daemon  # killed by one test: tcp, a target that dies; nixl, a source that dies
    transport: str
    started: Started  # spawns a restarted node, which it stops at the end
    other: Daemon | None = None  # tcp: a bfloat16 node, which a float32 node must refuse as a target
    draining: Daemon | None = None  # tcp: a node started with --drain-to a and b


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def nodes(request, tmp_path_factory):
    """The decode nodes of one transport, started side by side (their model loads overlap)."""
    transport = request.param
    flags = (*FLAGS, "--transport", transport)
    with Started(tmp_path_factory.mktemp(f"migration-{transport}")) as s:
        a, b, spare = (s.spawn("decode_node", *flags) for _ in range(3))
        n = Nodes(a, b, spare, transport, s)
        if transport == "tcp":
            n.other = s.spawn("decode_node", "--dtype", "bfloat16", "--transport", "tcp")
            n.draining = s.spawn("decode_node", *flags, "--drain-to", a.address, "--drain-to", b.address)
        s.wait()
        yield n


@pytest.fixture
def pair(nodes):
    """The source and target; both hold nothing when the test ends."""
    yield nodes.a, nodes.b
    wait_clean(nodes.a, nodes.b)


class Outcome:
    """A stream read to its end: tokens and text per sample, the final chunk, and what the
    Migrate call returned (when one was made)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.final: pb.GenerationChunk | None = None
        self.migrated: pb.MigrateResponse | None = None
        self.error: grpc.RpcError | None = None

    def add(self, chunk: pb.GenerationChunk) -> None:
        self.tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        self.text[chunk.index] = self.text.get(chunk.index, "") + chunk.text
        if chunk.finish_reason:
            self.finish[chunk.index] = chunk.finish_reason
        if chunk.HasField("usage"):
            self.final = chunk

    def same_output(self, other: Outcome) -> bool:
        return (self.tokens, self.text, self.finish) == (other.tokens, other.text, other.finish) and \
            (self.final.usage.prompt_tokens, self.final.usage.completion_tokens) == \
            (other.final.usage.prompt_tokens, other.final.usage.completion_tokens)


def run(node, rid: str, request: pb.GenerateRequest, migrate_to=None, after_chunks: int = 4,
        on_migrated=lambda: None) -> Outcome:
    """Stream `request` from `node`; after `after_chunks` chunks, Migrate it to `migrate_to`."""
    request.request_id = rid
    out = Outcome()
    try:
        for i, chunk in enumerate(node.stub.Generate(request, timeout=120)):
            out.add(chunk)
            if migrate_to is not None and i + 1 == after_chunks:
                out.migrated = node.stub.Migrate(pb.MigrateRequest(request_id=rid, target_address=migrate_to.address))
                on_migrated()
    except grpc.RpcError as exc:
        out.error = exc
    return out


CASES = {
    "greedy": pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(temperature=0.0, **NO_SPEC)),
    "seeded": pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(temperature=0.9, top_p=0.95, seed=11, **NO_SPEC)),
    "n2-logprobs": pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(
        temperature=0.8, seed=5, n=2, logprobs=True, top_logprobs=2, **NO_SPEC)),
    "guided-json": pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Describe a person as JSON.")],
        sampling=pb.SamplingParams(max_tokens=60, temperature=0.7, seed=3, guided=person_schema(), **NO_SPEC)),
    "speculative": pb.GenerateRequest(token_ids=COPY_PROMPT, sampling=sampling(temperature=0.0)),
}


# What a continuation carries (sampler and guided state, stop strings, traces) does not depend on
# how its KV moves: over NIXL only the cases whose KV moves differently run again (one sequence,
# two samples' forked pages, speculative draft positions).
KV_CASES = ("greedy", "n2-logprobs", "speculative")
TCP_ONLY = pytest.mark.parametrize("nodes", ["tcp"], indirect=True, scope="module")


@pytest.mark.parametrize("case", CASES)
@TCP_ONLY
def test_migrated_stream_is_identical(pair, case):
    assert_migrated_stream_is_identical(pair, case)


@pytest.mark.parametrize("case", KV_CASES)
@pytest.mark.parametrize("nodes", ["nixl"], indirect=True, scope="module")
def test_migrated_kv_over_nixl_is_identical(pair, case):
    assert_migrated_stream_is_identical(pair, case)


def assert_migrated_stream_is_identical(pair, case: str) -> None:
    a, b = pair
    request = CASES[case]
    reference = run(a, f"ref-{case}", pb.GenerateRequest().FromString(request.SerializeToString()))
    moved = run(a, f"moved-{case}", pb.GenerateRequest().FromString(request.SerializeToString()), migrate_to=b)
    assert moved.error is None, moved.error
    # The target holds the whole context but the last token: moved, or found in its prefix cache.
    assert moved.migrated.tokens_moved + moved.migrated.prefix_matched_length >= moved.final.usage.prompt_tokens
    assert moved.same_output(reference), (case, reference.tokens, moved.tokens)
    if case == "guided-json":
        assert moved.text[0].lstrip().startswith("{")


@TCP_ONLY
def test_stop_string_after_the_migration_ends_the_stream_there(pair):
    a, b = pair
    story = [pb.ChatMessage(role="user", content="Tell me a short story about a cat who learns to sail.")]
    free = run(a, "stop-free", pb.GenerateRequest(messages=story, sampling=sampling(max_tokens=60, **NO_SPEC)))
    text = free.text[0]
    # Five characters that first occur in the last third of the answer, long after the migration point.
    stop = next(text[i:i + 5] for i in range(len(text) * 2 // 3, len(text) - 5) if text.find(text[i:i + 5]) == i)
    request = pb.GenerateRequest(messages=story, sampling=sampling(max_tokens=60, stop=[stop], **NO_SPEC))
    reference = run(a, "stop-ref", request)
    moved = run(a, "stop-moved", pb.GenerateRequest().FromString(request.SerializeToString()), migrate_to=b)
    assert reference.finish[0] == "stop" and stop not in reference.text[0]
    assert moved.same_output(reference)


@TCP_ONLY
def test_the_request_keeps_its_id_and_both_traces_and_metrics_show_it(pair):
    a, b = pair
    moved = run(a, "traced", pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(**NO_SPEC)), migrate_to=b)
    source = {e.name for e in a.stub.GetTrace(pb.GetTraceRequest(request_ids=["traced"])).events}
    target = {e.name for e in b.stub.GetTrace(pb.GetTraceRequest(request_ids=["traced"])).events}
    assert {"migration_started", "migrated"} <= source
    assert {"pages_reserved", "transfer_complete", "generation_start", "finished"} <= target
    assert moved.migrated.pause_seconds > 0
    text = a.metrics_text()
    assert 'duet_migrations_total{outcome="migrated",reason="rpc"}' in text
    assert "duet_migration_pause_seconds_count" in text and "duet_migration_tokens_total" in text


def test_bad_migrations_are_refused_and_change_nothing(pair):
    a, b = pair
    request = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(**NO_SPEC))
    reference = run(a, "bad-ref", pb.GenerateRequest().FromString(request.SerializeToString()))
    a.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="reserved-only", token_ids=PROMPT))
    attempts = {"unknown id": ("no-such-request", b.address), "the node itself": ("bad", a.address),
                "malformed target": ("bad", "no-port"), "empty id": ("", b.address),
                "still reserved": ("reserved-only", b.address), "unreachable target": ("bad", "127.0.0.1:1")}
    codes = {}
    out = Outcome()
    request.request_id = "bad"
    for i, chunk in enumerate(a.stub.Generate(request, timeout=120)):
        out.add(chunk)
        if i == 3:  # refused while the request streams: it goes on undisturbed
            for name, (rid, target) in attempts.items():
                codes[name] = call_status(lambda: a.stub.Migrate(pb.MigrateRequest(
                    request_id=rid, target_address=target)), allowed=set(grpc.StatusCode))[0]
    assert out.same_output(reference)
    assert codes == {"unknown id": grpc.StatusCode.NOT_FOUND, "the node itself": grpc.StatusCode.INVALID_ARGUMENT,
                     "malformed target": grpc.StatusCode.INVALID_ARGUMENT,
                     "empty id": grpc.StatusCode.INVALID_ARGUMENT,
                     "still reserved": grpc.StatusCode.FAILED_PRECONDITION,
                     "unreachable target": grpc.StatusCode.UNAVAILABLE}, codes
    a.stub.Abort(pb.AbortRequest(request_id="reserved-only"))


def test_an_incompatible_target_is_refused(nodes, pair):
    a, _ = pair
    if nodes.other is None:
        pytest.skip("the fingerprint check is the transport-independent handshake: checked once, on tcp")
    out = Outcome()
    request = pb.GenerateRequest(request_id="incompatible", token_ids=PROMPT, sampling=sampling(**NO_SPEC))
    for i, chunk in enumerate(a.stub.Generate(request, timeout=120)):
        out.add(chunk)
        if i == 3:
            code, exc = call_status(lambda: a.stub.Migrate(pb.MigrateRequest(
                request_id="incompatible", target_address=nodes.other.address)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "dtype" in exc.details(), exc
    assert len(out.tokens[0]) == 40 and out.finish[0] == "length"
    wait_clean(nodes.other)


def test_a_request_still_prefilling_is_refused(pair):
    a, b = pair
    long_prompt = random_ids(1000, seed=9)
    stream = a.stub.Generate(pb.GenerateRequest(request_id="prefilling", token_ids=long_prompt,
                                                sampling=sampling(max_tokens=2, **NO_SPEC)), timeout=120)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while a.stub.GetLoad(pb.GetLoadRequest()).running_requests == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    code, exc = call_status(lambda: a.stub.Migrate(pb.MigrateRequest(request_id="prefilling",
                                                                      target_address=b.address)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "prefill" in exc.details(), exc
    reader.join(120)
    assert sum(len(c.token_ids) for c in chunks) == 2


def test_a_target_that_refuses_leaves_the_request_decoding_here(pair):
    a, b = pair
    request = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(temperature=0.9, seed=21, **NO_SPEC))
    reference = run(a, "refused-ref", pb.GenerateRequest().FromString(request.SerializeToString()))
    # The target already holds a live request of that id: its PrepareReceive refuses the move.
    b.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="refused", token_ids=PROMPT[:20]))
    out = Outcome()
    request.request_id = "refused"
    for i, chunk in enumerate(a.stub.Generate(request, timeout=120)):
        out.add(chunk)
        if i == 3:
            code, _ = call_status(lambda: a.stub.Migrate(pb.MigrateRequest(request_id="refused",
                                                                            target_address=b.address)))
            assert code == grpc.StatusCode.ALREADY_EXISTS
    assert out.same_output(reference)
    b.stub.Abort(pb.AbortRequest(request_id="refused"))
    assert 'duet_migrations_total{outcome="failed",reason="rpc"}' in a.metrics_text()


@pytest.mark.parametrize("where", ["source", "target"])
def test_abort_during_migration_ends_it_on_both_nodes(pair, where):
    a, b = pair
    rid = f"abort-{where}"
    node = a if where == "source" else b
    moved = run(a, rid, pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(max_tokens=200, **NO_SPEC)),
                migrate_to=b, on_migrated=lambda: node.stub.Abort(pb.AbortRequest(request_id=rid)))
    assert moved.error is None and moved.finish == {0: "abort"}, (moved.error, moved.finish)
    assert len(moved.tokens[0]) < 200


def test_a_target_that_dies_mid_stream_leaves_the_request_continuing_here(nodes, pair):
    a, _ = pair
    if nodes.transport != "tcp":
        pytest.skip("what the source does when its target dies does not depend on the transport: checked on tcp")
    request = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(max_tokens=60, temperature=0.9, seed=4,
                                                                      **NO_SPEC))
    reference = run(a, "dies-ref", pb.GenerateRequest().FromString(request.SerializeToString()))
    doomed = nodes.spare
    moved = run(a, "dies", request, migrate_to=doomed, on_migrated=lambda: threading.Timer(
        0.3, doomed.proc.send_signal, (signal.SIGKILL,)).start())
    assert moved.error is None, moved.error
    assert moved.same_output(reference)
    assert 'duet_migrations_total{outcome="resumed",reason="rpc"}' in a.metrics_text()


def test_a_target_restarted_since_the_last_migration_there_is_written_again(nodes, pair):
    """A NIXL writer keeps its connection to each target; one restarted on its address makes it
    stale. A migration there then fails with UNAVAILABLE (it used to fail UNKNOWN: cleaning up the
    target called the peer's channel, which the failed write had closed), the stream goes on here
    unchanged, both nodes stay clean, and the next migration, handshaken afresh, moves it."""
    a, _ = pair
    if nodes.transport != "nixl":
        pytest.skip("a TCP transfer opens its own connection: nothing goes stale")
    request = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(max_tokens=60, **NO_SPEC))
    reference = run(a, "restart-ref", pb.GenerateRequest().FromString(request.SerializeToString()))
    assert run(a, "restart-1", pb.GenerateRequest().FromString(request.SerializeToString()),
               migrate_to=nodes.spare).same_output(reference)  # a writes to spare: connected
    nodes.spare.stop(signal.SIGKILL)
    nodes.spare = nodes.started.spawn("decode_node", *FLAGS, "--transport", "nixl", port=nodes.spare.port)
    nodes.started.wait()
    request.request_id = "restart-2"
    out, codes = Outcome(), []
    for i, chunk in enumerate(a.stub.Generate(request, timeout=120)):
        out.add(chunk)
        if i + 1 in (4, 8) and grpc.StatusCode.OK not in codes:
            codes.append(call_status(lambda: a.stub.Migrate(pb.MigrateRequest(
                request_id="restart-2", target_address=nodes.spare.address), timeout=60),
                allowed=set(grpc.StatusCode))[0])
    assert codes in ([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK], [grpc.StatusCode.OK])
    assert out.same_output(reference)
    wait_clean(nodes.spare)


def test_a_source_that_dies_leaves_the_target_clean(nodes, pair):
    _, b = pair
    if nodes.transport != "nixl":
        pytest.skip("a dead writer's pages matter most where its writes are one-sided: checked on nixl")
    doomed = nodes.spare
    out = run(doomed, "orphan", pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(max_tokens=400, **NO_SPEC)),
              migrate_to=b, on_migrated=doomed.proc.kill)
    assert out.error is not None and out.error.code() == grpc.StatusCode.UNAVAILABLE


def test_drain_hands_every_stream_over_and_exits(nodes, pair):
    a, b = pair
    source = nodes.draining
    if source is None:
        pytest.skip("drain moves requests with Migrate: one transport shows it (test_migrated_stream_is_identical "
                    "covers both)")
    requests = [pb.GenerateRequest(token_ids=random_ids(60 + 10 * i, seed=100 + i),
                                   sampling=sampling(max_tokens=32, temperature=0.8 * (i % 2), seed=i, **NO_SPEC))
                for i in range(8)]

    def run_all(node: Daemon, prefix: str) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(requests)
        threads = [threading.Thread(target=lambda i=i, r=r: outcomes.__setitem__(i, run(
            node, f"{prefix}-{i}", pb.GenerateRequest().FromString(r.SerializeToString()))))
            for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        if node is source:
            deadline = time.monotonic() + 60
            while source.stub.GetLoad(pb.GetLoadRequest()).running_requests < len(requests):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.3)  # every stream has tokens out
            source.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        return outcomes

    references = run_all(a, "drain-ref")
    assert call_status(lambda: a.stub.Drain(pb.DrainRequest()))[0] == grpc.StatusCode.FAILED_PRECONDITION
    outcomes = run_all(source, "drain")
    assert source.proc.wait(60) == 0
    for reference, outcome in zip(references, outcomes):
        assert outcome.error is None, outcome.error
        assert outcome.same_output(reference)
    ids = [f"drain-{i}" for i in range(8)]
    finished_on_targets = {e.request_id for d in (a, b) for e in d.stub.GetTrace(pb.GetTraceRequest(
        request_ids=ids)).events if e.name == "finished"}
    assert finished_on_targets == set(ids)


@TCP_ONLY
def test_a_continuation_supersedes_the_instance_its_client_lost(pair):
    """A client whose stream broke (its router died) asks again with the tokens it holds, while
    the node still generates the instance that stream fed (it has not seen the break yet): the
    continuation takes the request over, the old instance ends, and the answer is token for
    token the unbroken one's (it used to be ALREADY_EXISTS until the old instance ended)."""
    a, _ = pair
    request = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling(max_tokens=60, **NO_SPEC))
    reference = run(a, "supersede-ref", pb.GenerateRequest().FromString(request.SerializeToString()))
    request.request_id = "supersede"
    lost = a.stub.Generate(request, timeout=120)
    received: list[int] = []
    for chunk in lost:
        received += chunk.token_ids
        if len(received) >= 4:
            break  # the stream stays open: the node goes on generating into it
    request.continuation.CopyFrom(pb.Continuation(samples=[pb.SampleContinuation(
        index=0, generated_token_ids=received)]))
    rest = [t for chunk in a.stub.Generate(request, timeout=120) for t in chunk.token_ids]
    assert received + rest == reference.tokens[0]
    assert [c.finish_reason for c in lost][-1:] == ["abort"]  # the superseded instance ended
    lost.cancel()


@TCP_ONLY
def test_bad_continuations_are_invalid_argument(pair):
    a, b = pair
    ok = pb.SampleContinuation(index=0, generated_token_ids=[300, 301])

    def generate(continuation: pb.Continuation, **fields) -> grpc.StatusCode:
        request = pb.GenerateRequest(request_id="bad-continuation", token_ids=PROMPT,
                                     sampling=sampling(**{**NO_SPEC, **fields}), continuation=continuation)
        return call_status(lambda: a.stub.Generate(request, timeout=30), allowed=set(grpc.StatusCode))[0]

    bad = {
        "no samples": generate(pb.Continuation()),
        "index past n": generate(pb.Continuation(samples=[pb.SampleContinuation(index=1)])),
        "repeated index": generate(pb.Continuation(samples=[ok, ok]), n=2),
        "nothing left of max_tokens": generate(pb.Continuation(samples=[ok]), max_tokens=2),
        "token outside the vocabulary": generate(pb.Continuation(samples=[
            pb.SampleContinuation(index=0, generated_token_ids=[10**6])])),
        "random_state of the wrong size": generate(pb.Continuation(samples=[
            pb.SampleContinuation(index=0, generated_token_ids=[300], random_state=b"123")])),
        "prompt_logprobs": generate(pb.Continuation(samples=[ok]), prompt_logprobs=1),
        "negative usage": generate(pb.Continuation(samples=[ok], cached_tokens=-1)),
    }
    assert set(bad.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, bad
    # A continuation whose reservation does not hold a prompt followed by that output is refused too
    # (a one-token prompt's reservation needs no KV: it is complete at once).
    a.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="mismatched", token_ids=PROMPT[:1]))
    code = call_status(lambda: a.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="mismatched", kv_window_begin=0, sampling=sampling(**NO_SPEC),
        continuation=pb.Continuation(samples=[pb.SampleContinuation(index=0, generated_token_ids=[1, 2])]))),
        allowed=set(grpc.StatusCode))[0]
    a.stub.Abort(pb.AbortRequest(request_id="mismatched"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
