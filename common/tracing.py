"""Request traces: timestamped events per request, kept for a bounded number of recent requests,
served by GetTrace and written as Chrome trace-event JSON (viewable in Perfetto / chrome://tracing).

Events carry wall-clock times (`time.time()`), so events recorded by different processes on one
host, or on hosts with synchronized clocks, line up; the request id joins them across nodes.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.daemon_limits import valid_request_id

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUESTS = 1000
# A request stops recording after this many events (a very long prompt prefilled in many small
# chunks posts a per-layer event per chunk); one "events_dropped" event marks the cut.
MAX_EVENTS_PER_REQUEST = 4096


@dataclass(frozen=True, slots=True)
class TraceEvent:
    request_id: str
    name: str
    node: str
    start_unix: float  # seconds since the epoch
    duration_s: float = 0.0  # 0 = an instant event
    args: dict = field(default_factory=dict, hash=False)  # compared, not hashed


class Tracer:
    """Thread-safe recorder of one node's request events: the most recent `max_requests`
    requests (by latest activity) are kept, older ones are dropped whole."""

    def __init__(self, node: str, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.node = node
        self.max_requests = max_requests
        # request id -> its events as (name, start_unix, duration_s, args): cheaper than objects
        self._by_request: OrderedDict[str, list[tuple[str, float, float, dict]]] = OrderedDict()
        self._lock = threading.Lock()
        self.version = 0  # bumped on every recorded event; lets a writer skip unchanged traces

    def event(self, request_id: str, name: str, **args) -> None:
        """An instant event, now."""
        self.record(request_id, name, time.time(), 0.0, **args)

    @contextmanager
    def span(self, request_id: str, name: str, **args) -> Iterator[dict]:
        """A duration event around the `with` body; the yielded dict takes args known only later.
        A body that raises is recorded too, with the exception's type as arg "error"."""
        start, started = time.time(), time.perf_counter()
        try:
            yield args
        except BaseException as exc:
            args["error"] = type(exc).__name__
            raise
        finally:
            self.record(request_id, name, start, time.perf_counter() - started, **args)

    def record(self, request_id: str, name: str, start_unix: float, duration_s: float = 0.0, **args) -> None:
        """An event with explicit times (for one span shared by several requests)."""
        if not valid_request_id(request_id):
            return  # nothing to join it with, or an id the node refuses (bounds what traces hold)
        e = (name, start_unix, max(0.0, duration_s), args)
        with self._lock:
            events = self._by_request.get(request_id)
            if events is None:
                events = self._by_request[request_id] = []
                if len(self._by_request) > self.max_requests:
                    self._by_request.popitem(last=False)
            else:
                self._by_request.move_to_end(request_id)
            if len(events) < MAX_EVENTS_PER_REQUEST:
                events.append(e)
            elif len(events) == MAX_EVENTS_PER_REQUEST:
                events.append(("events_dropped", start_unix, 0.0, {"after": MAX_EVENTS_PER_REQUEST}))
            self.version += 1

    def events(self, request_ids: Iterable[str] = ()) -> list[TraceEvent]:
        """The retained events of `request_ids` (all retained requests when empty)."""
        wanted = list(request_ids)
        with self._lock:
            if wanted:
                selected = [(rid, list(self._by_request.get(rid, ()))) for rid in dict.fromkeys(wanted)]
            else:
                selected = [(rid, list(events)) for rid, events in self._by_request.items()]
        return [TraceEvent(rid, name, self.node, start, duration, args)
                for rid, events in selected for name, start, duration, args in events]


def merge(*groups: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Events of several nodes (or of repeated fetches) in time order, each distinct event once."""
    return sorted(set().union(*map(set, groups)), key=lambda e: (e.start_unix, e.node, e.request_id, e.name))


def chrome_trace(events: Iterable[TraceEvent]) -> dict:
    """Chrome trace-event JSON ("traceEvents" array format): one process per node, one thread
    per request id (named by "M" metadata events), spans as "X" events, instants as "i";
    times in microseconds since the epoch."""
    events = merge(events)
    pids = {node: i for i, node in enumerate(sorted({e.node for e in events}), start=1)}
    tids = {rid: i for i, rid in enumerate(dict.fromkeys(e.request_id for e in events), start=1)}
    out: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": node}}
                       for node, pid in pids.items()]
    out += [{"name": "thread_name", "ph": "M", "pid": pids[node], "tid": tids[rid], "args": {"name": rid}}
            for node, rid in dict.fromkeys((e.node, e.request_id) for e in events)]
    for e in events:
        entry = {"name": e.name, "cat": "request", "pid": pids[e.node], "tid": tids[e.request_id],
                 "ts": e.start_unix * 1e6, "args": {"request_id": e.request_id, **e.args}}
        if e.duration_s > 0:
            entry.update(ph="X", dur=e.duration_s * 1e6)
        else:
            entry.update(ph="i", s="t")
        out.append(entry)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Path, events: Iterable[TraceEvent]) -> None:
    """Write atomically (temp file + rename): a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(chrome_trace(events), default=str))
    os.replace(tmp, path)


class TraceFileWriter:
    """Keeps `path` holding the Chrome JSON of everything `tracer` retains: rewritten when
    something changed (so a killed daemon leaves a recent file) and on close. Rewrites are at
    least `interval_s` apart, and further apart when a rewrite is slow (a full pool of retained
    requests), so the writer never takes more than 1/MAX_DUTY_DIVISOR of the time (and the GIL)."""

    MAX_DUTY_DIVISOR = 20

    def __init__(self, tracer: Tracer, path: Path, interval_s: float = 3.0) -> None:
        self.tracer, self.path, self.interval_s = tracer, Path(path), interval_s
        self._written = -1
        self._last_write_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trace-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(max(self.interval_s, self.MAX_DUTY_DIVISOR * self._last_write_s)):
            self.flush()

    def flush(self) -> None:
        version = self.tracer.version
        if version == self._written:
            return
        started = time.perf_counter()
        try:
            write_chrome_trace(self.path, self.tracer.events())
            self._written = version
            self._last_write_s = time.perf_counter() - started
        except OSError as exc:
            log.warning("cannot write the trace file", extra={"fields": {"path": str(self.path), "error": str(exc)}})

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
