"""NVIDIA's benchmark client aiperf as a second, independent client of `make bench-peer` and
`scripts/bench_contention.py`: installed on first use into its own virtual environment
(.venv-aiperf, never .venv), run as a user runs it (`aiperf profile`, its own processes on the
same host as the server), its JSON export read back into the numbers loadgen reports.

Offline, aiperf loads a tokenizer only by a Hugging Face repo id, from a Hugging Face cache
(`HF_HOME/hub/models--ORG--NAME/snapshots/REV/`); a local directory is refused as a repo id. So
the served model's tokenizer files are laid out as such a cache, under the repo id TOKENIZER_REPO.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.local_daemons import ROOT
from scripts.peer_vllm import run_step

AIPERF = "aiperf==0.13.0"
AIPERF_VENV = ROOT / ".venv-aiperf"
INSTALLED_STAMP = AIPERF_VENV / ".duet-aiperf-installed"
TOKENIZER_REPO = "duet"  # the org of the cache's repo id: duet/<model directory name>
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
RUN_TIMEOUT_S = 1800


class AiperfUnavailable(Exception):
    """aiperf could not be installed or did not produce its export; the message says why."""


@dataclass(frozen=True)
class AiperfWorkload:
    """One `aiperf profile` run: chat requests, streamed, EOS ignored, fixed lengths."""

    name: str
    input_tokens: int
    output_tokens: int
    concurrency: int
    requests: int  # single-turn: requests; multi-turn: conversations x turns
    conversations: int = 0  # > 0: multi-turn, `turns` turns each, every turn `input_tokens` new tokens
    turns: int = 1

    def arguments(self) -> list[str]:
        args = ["--endpoint-type", "chat", "--streaming", "--extra-inputs", "ignore_eos:true",
                "--prompt-input-tokens-mean", str(self.input_tokens), "--prompt-input-tokens-stddev", "0",
                "--prompt-output-tokens-mean", str(self.output_tokens), "--prompt-output-tokens-stddev", "0",
                "--concurrency", str(self.concurrency), "--request-count", str(self.requests),
                "--warmup-request-count", str(self.concurrency), "--random-seed", "5"]
        if self.conversations:
            args += ["--conversation-num", str(self.conversations), "--conversation-turn-mean", str(self.turns),
                     "--conversation-turn-stddev", "0"]
        return args


def ensure_installed() -> Path:
    """The `aiperf` command of .venv-aiperf, installing it first when needed."""
    executable = AIPERF_VENV / "bin" / "aiperf"
    if INSTALLED_STAMP.is_file() and INSTALLED_STAMP.read_text().strip() == AIPERF and executable.exists():
        return executable
    python = AIPERF_VENV / "bin" / "python"
    if not python.exists():
        run_step(sys.executable, "-m", "venv", AIPERF_VENV, what=f"creating {AIPERF_VENV}", error=AiperfUnavailable)
    run_step(python, "-m", "pip", "install", "--quiet", AIPERF, what=f"pip install {AIPERF}", error=AiperfUnavailable)
    INSTALLED_STAMP.write_text(AIPERF + "\n")
    return executable


def tokenizer_cache(model_dir: Path, hf_home: Path) -> str:
    """Lay `model_dir`'s tokenizer out as a Hugging Face cache under `hf_home`; its repo id."""
    files = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    revision = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
    repo = hf_home / "hub" / f"models--{TOKENIZER_REPO}--{model_dir.name}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return f"{TOKENIZER_REPO}/{model_dir.name}"


def run_aiperf(url: str, model_dir: Path, workload: AiperfWorkload, work_dir: Path) -> dict:
    """`aiperf profile` of `workload` against the OpenAI server at `url` serving `model_dir` (by its
    directory name); its numbers as bench-peer records name them."""
    hf_home = work_dir / "hf"
    repo = tokenizer_cache(model_dir, hf_home)
    artifacts = work_dir / f"aiperf-{workload.name}"
    shutil.rmtree(artifacts, ignore_errors=True)
    cmd = [str(ensure_installed()), "profile", "--model", model_dir.name, "--url", url, "--tokenizer", repo,
           "--ui-type", "none", "--artifact-dir", str(artifacts), *workload.arguments()]
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = work_dir / f"aiperf-{workload.name}.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S)
    export = artifacts / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.is_file():
        raise AiperfUnavailable(f"aiperf exited with {done.returncode} and no export; its log: {log}")
    return summary_of(json.loads(export.read_text()))


def summary_of(export: dict) -> dict:
    """The numbers of aiperf's JSON export (`profile_export_aiperf.json`) as bench-peer records
    name them; a metric aiperf did not report is None."""

    def stat(metric: str, name: str) -> float | None:
        return (export.get(metric) or {}).get(name)

    completed = int(stat("request_count", "avg") or 0)
    return {"completed": completed, "failed": int(stat("error_request_count", "avg") or 0),
            "duration_s": stat("benchmark_duration", "avg"),
            "total_output_tokens": stat("total_osl", "avg"), "total_input_tokens": stat("total_isl", "avg"),
            "ttft_p50_ms": stat("time_to_first_token", "p50"), "ttft_p99_ms": stat("time_to_first_token", "p99"),
            "itl_p50_ms": stat("inter_token_latency", "p50"), "itl_p99_ms": stat("inter_token_latency", "p99"),
            "tpot_p99_ms": None, "output_tokens_per_s": stat("output_token_throughput", "avg"),
            "goodput_req_per_s": None}
