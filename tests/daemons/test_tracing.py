"""Request traces: the recorder (retention, Chrome trace-event JSON) and a traced hand-off through
both real daemons, fetched and merged by loadgen."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest

from common.daemon_limits import MAX_REQUEST_ID_LENGTH
from common.serving.trace_messages import trace_event_from_proto, trace_to_proto
from common.tracing import MAX_EVENTS_PER_REQUEST, Tracer, TraceFileWriter, chrome_trace, merge
from decode_node.config import parse_args as decode_args
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import ROOT, free_port
from harness.helpers import started_pair
from harness.reference import FP32

# ---------------------------------------------------------------- the recorder


def test_instant_and_span_events():
    t = Tracer("decode a:1")
    t.event("r1", "received", rpc="Generate")
    with t.span("r1", "work", tokens=3) as args:
        time.sleep(0.02)
        args["later"] = True
    instant, span = t.events()
    assert (instant.request_id, instant.name, instant.node, instant.duration_s) == ("r1", "received", "decode a:1", 0)
    assert instant.args == {"rpc": "Generate"}
    assert span.duration_s >= 0.02 and span.start_unix >= instant.start_unix
    assert span.args == {"tokens": 3, "later": True}
    with pytest.raises(TimeoutError), t.span("r1", "transfer_finished"):
        raise TimeoutError
    assert t.events()[-1].args == {"error": "TimeoutError"}


def test_retention_keeps_the_most_recently_active_requests_whole():
    t = Tracer("n", max_requests=3)
    for rid in ("a", "b", "c"):
        t.event(rid, "received")
        t.event(rid, "first_token")
    t.event("a", "finished")  # activity keeps "a"; "b" is now the least recent
    t.event("d", "received")
    kept = defaultdict(list)
    for e in t.events():
        kept[e.request_id].append(e.name)
    assert dict(kept) == {"c": ["received", "first_token"], "a": ["received", "first_token", "finished"],
                          "d": ["received"]}
    assert t.events(["b"]) == [] and [e.name for e in t.events(["d", "c"])] == ["received", "received", "first_token"]


def test_events_per_request_are_capped_and_the_cut_is_marked():
    t = Tracer("n")
    for i in range(MAX_EVENTS_PER_REQUEST + 10):
        t.event("long", "transfer_layer_posted", layer=i)
    events = t.events(["long"])
    assert len(events) == MAX_EVENTS_PER_REQUEST + 1 and events[-1].name == "events_dropped"


def test_events_without_a_request_id_are_not_recorded():
    t = Tracer("n")
    t.event("", "received")
    assert t.events() == [] and t.version == 0


def test_ids_the_nodes_refuse_are_not_recorded():
    """Junk ids (up to a 64 MiB message each) must not pile up in the retained traces."""
    t = Tracer("n")
    t.event("x" * (MAX_REQUEST_ID_LENGTH + 1), "received")
    t.event("x" * MAX_REQUEST_ID_LENGTH, "received")
    assert [e.request_id for e in t.events()] == ["x" * MAX_REQUEST_ID_LENGTH]


def test_concurrent_recording_loses_nothing():
    t = Tracer("n", max_requests=100)

    def work(k: int) -> None:
        for i in range(500):
            t.event(f"r{k}", "step", i=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(8):
        assert [e.args["i"] for e in t.events([f"r{k}"])] == list(range(500))


def test_proto_round_trip():
    t = Tracer("prefill p:2")
    with t.span("r", "prefill_chunk", tokens=40):
        pass
    t.event("r", "transfer_layer_posted", layer=3, bytes=1024)
    trace = trace_to_proto(t.events(["r", "unknown"]))
    assert isinstance(trace, pb.Trace) and len(trace.events) == 2
    back = [trace_event_from_proto(e) for e in trace.events]
    assert back == t.events() and [e.args for e in back] == [e.args for e in t.events()]
    assert json.loads(trace.events[1].args_json) == {"layer": 3, "bytes": 1024}


def test_merge_orders_by_time_and_drops_duplicates():
    a, b = Tracer("decode d:1"), Tracer("prefill p:2")
    a.event("r", "received")
    b.event("r", "received")
    a.event("r", "first_token")
    merged = merge(a.events(), b.events(), a.events())  # the same node fetched twice
    assert [(e.node, e.name) for e in merged] == [("decode d:1", "received"), ("prefill p:2", "received"),
                                                  ("decode d:1", "first_token")]


def check_chrome_trace(doc: dict) -> list[dict]:
    """Assert the Chrome trace-event format ("traceEvents" array form); return the non-metadata events."""
    assert set(doc) >= {"traceEvents"}
    json.dumps(doc, allow_nan=False)
    events, named_processes, named_threads = [], set(), set()
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ph"] in ("M", "X", "i"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
            (named_processes if e["name"] == "process_name" else named_threads).add(
                e["pid"] if e["name"] == "process_name" else (e["pid"], e["tid"]))
            continue
        assert isinstance(e["ts"], float) and isinstance(e["args"], dict)
        if e["ph"] == "X":
            assert isinstance(e["dur"], float) and e["dur"] >= 0
        else:
            assert e["s"] in ("g", "p", "t")
        events.append(e)
    assert {e["pid"] for e in events} <= named_processes
    assert {(e["pid"], e["tid"]) for e in events} <= named_threads
    return events


def test_chrome_json_shape_and_units():
    a, b = Tracer("decode d:1"), Tracer("prefill p:2")
    a.record("r1", "remote_prefill", 1700000000.25, 0.5, prefill="p:2")
    b.event("r1", "received")
    a.event("r2", "received")
    events = check_chrome_trace(chrome_trace(a.events() + b.events()))
    meta = [e for e in chrome_trace(a.events() + b.events())["traceEvents"] if e["ph"] == "M"]
    names = {(e["name"], e["args"]["name"]) for e in meta}
    assert {("process_name", "decode d:1"), ("process_name", "prefill p:2"),
            ("thread_name", "r1"), ("thread_name", "r2")} <= names
    span = next(e for e in events if e["name"] == "remote_prefill")
    assert (span["ph"], span["ts"], span["dur"]) == ("X", 1700000000.25e6, 0.5e6)
    assert span["args"] == {"request_id": "r1", "prefill": "p:2"}
    tid_of = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert {e["tid"] for e in events if e["args"]["request_id"] == "r1"} == {tid_of["r1"]}  # one row per request
    assert len({e["pid"] for e in events if e["args"]["request_id"] == "r1"}) == 2  # on two nodes


def test_file_writer_rewrites_only_after_changes(tmp_path):
    t, path = Tracer("n"), tmp_path / "t.json"
    writer = TraceFileWriter(t, path, interval_s=0.05)
    try:
        t.event("r", "received")
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e["name"] for e in check_chrome_trace(json.loads(path.read_text()))] == ["received"]
        path.unlink()
        time.sleep(0.3)  # idle: nothing changed, nothing rewritten
        assert not path.exists()
        t.event("r", "finished")
    finally:
        writer.close()  # the final write
    assert [e["name"] for e in check_chrome_trace(json.loads(path.read_text()))] == ["received", "finished"]
    assert not list(tmp_path.glob(".*tmp"))


def test_trace_flags():
    c = decode_args(["--trace", "out.json", "--trace-requests", "5"])
    assert str(c.trace) == "out.json" and c.trace_requests == 5
    assert decode_args([]).trace is None
    with pytest.raises(SystemExit):
        decode_args(["--trace-requests", "0"])


# ---------------------------------------------------------------- both daemons, traced


NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 3, 40, 4


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traced")
    files = {name: tmp / f"{name}.json" for name in ("prefill", "decode", "run", "result")}
    flags = (*FP32, "--transport", "tcp", "--threads", "1", "--kv-pages", "128")
    dead = f"127.0.0.1:{free_port()}"
    with started_pair(tmp, (*flags, "--trace", str(files["prefill"])),
                      (*flags, "--min-remote-prefill-tokens", "1", "--trace", str(files["decode"]))) as (dn, pn):
        loadgen = subprocess.run(
            [sys.executable, "-m", "loadgen", "--target", dn.address, "--num-requests", str(NUM_REQUESTS),
             "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--no-progress",
             "--output", str(files["result"]), "--trace", str(files["run"]),
             "--trace-from", pn.address, "--trace-from", dead],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        all_retained = {name: stub.GetTrace(pb.GetTraceRequest(), timeout=10)
                        for name, stub in (("decode", dn.stub), ("prefill", pn.stub))}
        unknown = dn.stub.GetTrace(pb.GetTraceRequest(request_ids=["no-such-request"]), timeout=10)
    # Both daemons got SIGTERM on leaving the `with`.
    assert loadgen.returncode == 0, loadgen.stdout + loadgen.stderr
    return dict(files=files, stderr=loadgen.stderr, dead=dead, prefill=pn.address, decode=dn.address,
                all_retained=all_retained, unknown=unknown)


def _by_request(events: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """request id -> "decode"/"prefill" -> that node's events of the request, in time order."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in sorted(events, key=lambda e: e["ts"]):
        out[e["args"]["request_id"]][e["node"].split()[0]].append(e)
    return out


def _run_events(traced_run) -> list[dict]:
    doc = json.loads(traced_run["files"]["run"].read_text())
    events = check_chrome_trace(doc)
    node_of = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    return [{**e, "node": node_of[e["pid"]]} for e in events]


def test_loadgen_merges_both_nodes_and_reports_a_dead_one(traced_run):
    result = json.loads(traced_run["files"]["result"].read_text())
    ids = {r["request_id"] for r in result["requests"]}
    assert len(ids) == NUM_REQUESTS and all(r["status"] == "OK" for r in result["requests"])
    by_request = _by_request(_run_events(traced_run))
    assert set(by_request) == ids
    for rid in ids:
        assert set(by_request[rid]) == {"decode", "prefill"}, rid
    assert f"no events from {traced_run['dead']}: UNAVAILABLE" in traced_run["stderr"]
    assert f"from {traced_run['prefill']}" in traced_run["stderr"]
    nodes = {e["node"] for e in _run_events(traced_run)}
    assert nodes == {f"decode {traced_run['decode']}", f"prefill {traced_run['prefill']}"}
    assert traced_run["unknown"].events == []
    assert {e.request_id for e in traced_run["all_retained"]["decode"].events} >= ids


def _first(events: list[dict], name: str) -> dict:
    matches = [e for e in events if e["name"] == name]
    assert matches, f"no {name!r} event among {[e['name'] for e in events]}"
    return matches[0]


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def test_events_are_causally_ordered_across_the_two_processes(traced_run):
    result = json.loads(traced_run["files"]["result"].read_text())
    slack_us = 1000.0  # a span's end is its wall-clock start plus a perf_counter duration
    for r in result["requests"]:
        nodes = _by_request(_run_events(traced_run))[r["request_id"]]
        d, p = nodes["decode"], nodes["prefill"]
        t = {name: _first(d, name)["ts"] for name in ("received", "prefix_matched", "pages_reserved",
                                                      "transfer_started", "transfer_complete",
                                                      "generation_start", "first_token", "finished")}
        assert _first(d, "received")["args"]["rpc"] == "Generate"
        assert t["received"] <= t["prefix_matched"] <= t["pages_reserved"] < t["transfer_started"] \
            < t["transfer_complete"] <= t["generation_start"] <= t["first_token"] <= t["finished"]
        assert _first(d, "pages_reserved")["args"]["slots"] == r["prompt_tokens"] - 1
        finished = _first(d, "finished")["args"]
        assert (finished["finish_reason"], finished["completion_tokens"]) == (r["finish_reason"], r["completion_tokens"])
        # The prefill node's work, on the other process's clock, falls between the reservation
        # and the first token; its confirmation reaches the decode node after the bytes landed.
        for e in p:
            assert t["pages_reserved"] < e["ts"] and _end(e) < t["first_token"] + slack_us, e
        p_names = [e["name"] for e in p]
        assert p_names.index("received") < p_names.index("prefix_matched") < p_names.index("prefilled") \
            < p_names.index("transfer_finished") < p_names.index("completion_sent")
        # The decode node records transfer_complete inside the prefill node's CompleteTransfer call,
        # so it falls within that span (whose end also waits for the reply to travel back).
        finishing = _first(p, "transfer_finished")
        assert finishing["ts"] - slack_us <= t["transfer_complete"] <= _end(finishing) + slack_us
        assert _first(p, "prefill_chunk")["args"]["tokens"] == r["prompt_tokens"] - 1
        assert _end(_first(d, "remote_prefill")) >= _first(p, "completion_sent")["ts"] - slack_us


def test_per_layer_transfer_events_cover_every_layer(traced_run, model):
    cfg = model.config  # the daemons load the same default model
    num_layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    element_bytes = 4  # the daemons' KV pool is float32 by default
    result = json.loads(traced_run["files"]["result"].read_text())
    by_request = _by_request(_run_events(traced_run))
    for r in result["requests"]:
        posted = [e for e in by_request[r["request_id"]]["prefill"] if e["name"] == "transfer_layer_posted"]
        assert sorted(e["args"]["layer"] for e in posted) == list(range(num_layers))
        sent_tokens = r["prompt_tokens"] - 1
        for e in posted:
            assert e["args"]["bytes"] == sent_tokens * 2 * kv_heads * head_dim * element_bytes
            assert e["args"]["slots"] == sent_tokens
        # Each layer is reported done after it was posted and before the whole transfer finished.
        events = by_request[r["request_id"]]["prefill"]
        done = {e["args"]["layer"]: e["ts"] for e in events if e["name"] == "transfer_layer_done"}
        assert sorted(done) == list(range(num_layers))
        finished = _end(_first(events, "transfer_finished"))
        for e in posted:
            assert e["ts"] <= done[e["args"]["layer"]] <= finished, e


def test_daemons_leave_their_own_trace_files_after_sigterm(traced_run):
    run = _run_events(traced_run)
    for name, address in (("decode", traced_run["decode"]), ("prefill", traced_run["prefill"])):
        doc = json.loads(traced_run["files"][name].read_text())
        own = {(e["name"], e["ts"], e["args"]["request_id"]) for e in check_chrome_trace(doc)}
        processes = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
        assert processes == [f"{name} {address}"]
        fetched = {(e["name"], e["ts"], e["args"]["request_id"]) for e in run if e["node"] == f"{name} {address}"}
        assert fetched and fetched <= own  # the file holds everything GetTrace served, and the rest
        assert len(own) == len(traced_run["all_retained"][name].events)
