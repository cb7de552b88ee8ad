"""Where a daemon's threads spend their time: run a module (`$DUET_SAMPLE_MODULE`, e.g.
`decode_node`) with a thread that samples every thread's Python stack every few milliseconds,
and at exit write to `$DUET_SAMPLE_OUT` (JSON) the share of samples of each thread in each
category of `CATEGORIES`, the first that matches a frame from the innermost out. Time inside a
torch operator counts for the Python frame that called it (model forward, sampling, ...).

    DUET_SAMPLE_MODULE=decode_node DUET_SAMPLE_OUT=/tmp/p.json python -m scripts.stack_sampler --port ...

scripts/bench_colocated.py --profile runs the daemons this way.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter, defaultdict

INTERVAL_S = 0.005
# (category, path fragment, function name or None for any), matched innermost frame first.
CATEGORIES = [
    ("idle (waiting for work)", "threading.py", "wait"),
    ("idle (waiting for work)", "queue.py", "get"),
    ("idle (waiting for work)", "scheduler.py", "next_chunk"),
    ("engine: attention", "paged_attention.py", None),
    ("engine: model forward (other)", "common/model/decoder.py", "forward"),
    ("engine: batch building", "common/engine/core.py", None),
    ("sampling", "common/engine/sampling.py", None),
    ("detokenization", "common/model/detokenizer.py", None),
    ("scheduler bookkeeping", "common/engine/scheduler.py", None),
    ("KV transfer / prefill hand-off", "common/transports/", None),
    ("KV transfer / prefill hand-off", "common/peers/", None),
    ("KV transfer / prefill hand-off", "router/", None),
    ("gRPC / streaming", "decode_node/service.py", None),
    ("gRPC / streaming", "prefill_node/", None),
    ("gRPC / streaming", "grpc/", None),
]


def classify(frame) -> str:
    while frame is not None:
        code = frame.f_code
        for name, fragment, function in CATEGORIES:
            if fragment in code.co_filename and (function is None or code.co_name == function):
                return name
        frame = frame.f_back
    return "other"


def main() -> None:
    module, out = os.environ["DUET_SAMPLE_MODULE"], os.environ["DUET_SAMPLE_OUT"]
    counts: dict[str, Counter] = defaultdict(Counter)
    me = threading.get_ident()

    def sample() -> None:
        while True:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    # gRPC's pool threads differ only by number: one row for all of them.
                    name = names.get(ident, "?").split("_")[0].rstrip("0123456789-")
                    counts[name][classify(frame)] += 1
            time.sleep(INTERVAL_S)

    def write() -> None:
        report = {thread: {cat: n / sum(c.values()) for cat, n in c.most_common()} | {"samples": sum(c.values())}
                  for thread, c in counts.items()}
        with open(out, "w") as f:
            json.dump(report, f, indent=2)

    atexit.register(write)
    threading.Thread(target=sample, name="stack-sampler", daemon=True).start()
    sys.argv = [module, *sys.argv[1:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass


if __name__ == "__main__":
    main()
