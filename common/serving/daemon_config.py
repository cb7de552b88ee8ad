"""Settings both daemons share, their command-line flags, and the optional JSON config file."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from common.serving.dtype_choice import DTYPES, resolve_dtype
from common.serving.placement import parse_cpus
from common.serving.tls import TlsFiles
from common.transports import TRANSPORTS

if TYPE_CHECKING:
    import torch

C = TypeVar("C", bound="DaemonConfig")

DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")  # --quantization (common/model/gguf_weight.py)


def check_device(device: str, dtype: str) -> None:
    """Raise ValueError, naming the flag to change, unless this machine can run `--device` with
    `--dtype`."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    resolve_dtype(device, dtype)
    if device == "cuda":
        import torch  # here, not at the top: the router imports this module and needs no torch

        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            raise ValueError(f"--device cuda: {why}; run with --device cpu, or see docs/gpu.md")


@dataclass(frozen=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    model: Path | None = None  # None = the embedded SmolLM2-135M-Instruct
    transport: str = "nixl"
    page_size: int = 16  # prefill and decode nodes must agree (checked in the handshake)
    kv_pages: int = 1024  # 16k tokens at the default page size
    # A hybrid model's sliding layers on pages of their own (common/kv/sliding_pages.py): how many.
    # None: as many as kv_pages (none with --kv-offload-dir); 0: on the kv_pages with every layer.
    kv_sliding_pages: int | None = None
    max_batch_tokens: int = 512
    threads: int | None = None  # compute threads, fixed; None = adaptive, up to one per CPU of --cpus and the quota
    cpus: tuple[int, ...] | None = None  # CPUs to run on; None = those the process was started with
    nice: int = 0  # added to the process's niceness at start (the prefill node defaults to 10)
    attention_sinks: int = 0  # sliding-window models: leading positions every query attends too
    device: str = "cpu"  # where the weights and the KV pool live: cpu or cuda (docs/gpu.md)
    dtype: str = "auto"  # weights, activations and KV (common/serving/dtype_choice.py); see resolved_dtype
    quantization: str = "none"  # gguf | int8 | int4: projections computed in GGUF blocks (common/model/gguf_weight.py)
    log_level: str = "info"
    drain_seconds: float = 10.0  # how long SIGTERM lets in-flight streams finish before cutting them
    advertise_host: str = ""  # the host peers should dial; default --host
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None  # set: mutual TLS, peers must present a certificate signed by it
    trace: Path | None = None  # write the request traces here as Chrome trace-event JSON
    trace_requests: int = 1000  # recent requests whose trace events are kept
    kv_events_endpoint: str = ""  # ZMQ PUB endpoint of vLLM-format KV events (common/serving/kv_events_zmq.py)
    kv_events_topic: str = ""  # default kv@<advertise host>:<HTTP port, else gRPC port>@<served model name>
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER endpoint answering replays
    kv_offload_dir: Path | None = None  # the disk tier of prefix pages (common/serving/kv_tiers.py); None = off
    kv_offload_gib: float = 16.0  # its size; least recently used pages go past it

    @property
    def sliding_pages(self) -> int | None:
        """What the engine gets for --kv-sliding-pages (common/engine/core.py `Engine`)."""
        return 0 if self.kv_sliding_pages is None and self.kv_offload_dir is not None else self.kv_sliding_pages

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def grpc_workers(self) -> int:
        """Threads of the gRPC server (common/serving/daemon.py `GrpcDaemon`)."""
        return 64

    @property
    def resolved_dtype(self) -> str:
        """What `--dtype` means on this machine: `auto` resolved."""
        return resolve_dtype(self.device, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.resolved_dtype)

    @property
    def advertise_address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_pages < 1 or self.max_batch_tokens < 1:
            raise ValueError("--page-size, --kv-pages and --max-batch-tokens must be >= 1")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if self.cpus is not None and not self.cpus:
            raise ValueError("--cpus must name at least one CPU")
        if not 0 <= self.nice <= 19:
            raise ValueError("--nice must be in [0, 19]")
        if self.attention_sinks < 0:
            raise ValueError("--attention-sinks must be >= 0")
        check_device(self.device, self.dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "gguf" and self.model is not None and self.model.suffix != ".gguf":
            raise ValueError(f"--quantization gguf computes a GGUF file's own blocks; --model {self.model} is not "
                             "a .gguf file (use --quantization none)")
        if self.trace_requests < 1:
            raise ValueError("--trace-requests must be >= 1")
        if not self.drain_seconds > 0:
            raise ValueError("--drain-seconds must be > 0")
        if (self.kv_events_topic or self.kv_events_replay_endpoint) and not self.kv_events_endpoint:
            raise ValueError("--kv-events-topic and --kv-events-replay-endpoint need --kv-events-endpoint")
        if self.kv_sliding_pages is not None and self.kv_sliding_pages < 0:
            raise ValueError("--kv-sliding-pages must be >= 0")
        if self.kv_sliding_pages and self.kv_offload_dir is not None:
            raise ValueError("--kv-offload-dir keeps every layer of a page on the disk tier: run it with "
                             "--kv-sliding-pages 0 (a hybrid model's sliding layers on the same pages)")
        if not self.kv_offload_gib > 0:
            raise ValueError("--kv-offload-gib must be > 0")
        if self.kv_offload_dir is not None and self.kv_offload_dir.exists() and not self.kv_offload_dir.is_dir():
            raise ValueError(f"--kv-offload-dir {self.kv_offload_dir} exists and is not a directory")
        self.tls.validate()


def daemon_parser(prog: str, description: str, defaults: DaemonConfig) -> argparse.ArgumentParser:
    d = defaults
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", type=Path, help="JSON file of flag values (keys as flag names, '-' or '_'); "
                   "flags given on the command line win")
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port, 0 = any free port (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--model", type=Path, default=None, help="a .gguf file or Hugging Face directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--transport", default=d.transport, choices=TRANSPORTS,
                   help="KV data plane: NIXL's UCX backend or plain TCP (default %(default)s)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=d.kv_pages, help="pages in the KV pool (default %(default)s)")
    p.add_argument("--kv-sliding-pages", type=int, default=None, metavar="N",
                   help="a hybrid model's (Gemma 2/3, gpt-oss) sliding layers on N pages of their own, which "
                        "hold each request's window only (default: as many as --kv-pages; 0: on the --kv-pages "
                        "with every layer, as --kv-offload-dir needs)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget of one engine step; longer prompts are chunked (default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads, fixed (default: adaptive, at most one per CPU this daemon may run on "
                   "(see --cpus) and its cgroup's CPU quota allows, one fewer at a time while neighbours hold "
                   "those cores; the metric duet_compute_threads says how many)")
    p.add_argument("--cpus", type=parse_cpus, default=None, metavar="LIST",
                   help="run on these CPUs only, e.g. 0 or 0-3,6 (default: those it was started with); "
                   "a prefill and a decode node sharing a host may split the cores this way")
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds, metavar="S",
                   help="on SIGTERM, how long in-flight streams may run on before they are cut; set it above your "
                   "longest request's duration for restarts that cost no request (default %(default)s)")
    p.add_argument("--nice", type=int, default=d.nice, metavar="N",
                   help="lower this daemon's CPU priority by N (0-19) at start, so that a node on the same "
                   "cores gets them first (default %(default)s)")
    p.add_argument("--attention-sinks", type=int, default=d.attention_sinks, metavar="N",
                   help="sliding-window models only: every query also attends the first N positions "
                   "(StreamingLLM sinks); prefill and decode nodes must agree (default %(default)s)")
    p.add_argument("--device", default=d.device, choices=DEVICES,
                   help="run the model and keep the KV pool here; cuda = the current CUDA device, registered "
                   "with NIXL as VRAM (default %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="weights, activations and KV cache; auto = bfloat16 on a CUDA device or a CPU with "
                   "AVX512-BF16 or AMX (as vLLM), else float32; float16 needs --device cuda; prefill and "
                   "decode nodes must agree (default %(default)s)")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="compute the projections and the lm_head from 4- or 8-bit blocks (CPU), reading a quarter "
                   "to an eighth of the bytes a decode step reads in float32: gguf = a GGUF's own Q4_0, Q4_1, Q8_0, "
                   "Q4_K and Q6_K blocks, each weight the value a dequantized load gives it; int8 / int4 = any model's "
                   "weights quantized at load (32 weights a scale; int4 with a minimum); none = dequantize every "
                   "weight (docs/models.md \"Quantized weights\"); prefill and decode nodes must agree "
                   "(default %(default)s)")
    p.add_argument("--advertise-host", default="", metavar="HOST",
                   help="address other nodes should use to reach this one (default: --host); needed when "
                   "listening on 0.0.0.0 or behind NAT")
    add_tls_args(p)
    p.add_argument("--trace", type=Path, metavar="FILE.json",
                   help="write request traces (Chrome trace-event JSON, open in Perfetto) to FILE, every few "
                   "seconds and at shutdown; GetTrace serves them either way")
    p.add_argument("--trace-requests", type=int, default=d.trace_requests, metavar="N",
                   help="keep the trace events of the N most recent requests (default %(default)s)")
    p.add_argument("--kv-events-endpoint", default="", metavar="tcp://HOST:PORT",
                   help="publish the prefix cache's stores and removals as vLLM's KV events on this ZMQ PUB "
                   "endpoint, for the inference gateway's prefix-cache scorer (docs/operations.md \"Behind the Kubernetes "
                   "inference gateway\"; default: off)")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="their topic (default: kv@<advertise host>:<HTTP port, else gRPC port>@<served model name>)")
    p.add_argument("--kv-events-replay-endpoint", default="", metavar="tcp://HOST:PORT",
                   help="answer replays of missed KV events from a sequence number on this ZMQ ROUTER endpoint")
    p.add_argument("--kv-offload-dir", type=Path, default=None, metavar="DIR",
                   help="keep every prefix page the cache records in files here too (written in the background), "
                   "and read them back instead of recomputing a prompt the pool no longer holds; a node restarted "
                   "on the same DIR serves the prefixes it held (docs/operations.md \"The disk tier\"; default: off)")
    p.add_argument("--kv-offload-gib", type=float, default=d.kv_offload_gib, metavar="N",
                   help="how much of --kv-offload-dir the tier may fill; the least recently used pages go past it "
                   "(default %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", type=Path, help="PEM certificate: serve gRPC over TLS and present it to peers")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, help="PEM CA bundle: require and verify client certificates "
                   "(mutual TLS) and verify peers' certificates")


def parse_config(parser: argparse.ArgumentParser, config_class: type[C], argv: list[str] | None) -> C:
    """Parse flags (over values from `--config FILE`) into `config_class`; bad values exit with
    a usage error naming the flag."""
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        parser.set_defaults(**_file_values(parser, known.config))
    args = vars(parser.parse_args(argv))
    fields = {f.name for f in dataclasses.fields(config_class)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if k in fields}
    try:
        return config_class(**values)
    except ValueError as exc:
        parser.error(str(exc))


def _file_values(parser: argparse.ArgumentParser, path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read config file {path}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"config file {path} must hold a JSON object")
    dests = {a.dest for a in parser._actions}
    out = {}
    for key, value in values.items():
        dest = key.lstrip("-").replace("-", "_")
        if dest not in dests:
            parser.error(f"config file {path}: unknown setting {key!r}")
        out[dest] = value
    return out
