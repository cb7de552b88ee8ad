"""Daemon placement (common/serving/placement.py): --cpus lists, thread pools sized from the affinity,
the prefill node's lower priority by default, one OpenMP pool per daemon (the engine thread's)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.serving.placement import parse_cpus
from decode_node.config import parse_args as decode_args
from prefill_node.config import parse_args as prefill_args
from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import decode_node
from harness.helpers import drain, greedy, random_ids, started_pair

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "cpus"), [("0", (0,)), ("1,0", (0, 1)), ("0-2,5", (0, 1, 2, 5)), ("3-3", (3,))])
def test_parse_cpus(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "2-1", "-1", "0,,1"])
def test_parse_cpus_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--cpus"):
        parse_cpus(text)


def test_flags_and_defaults() -> None:
    assert prefill_args([]).nice == 10 and decode_args([]).nice == 0  # the prefill node yields
    config = decode_args(["--cpus", "0", "--nice", "3"])
    assert config.cpus == (0,) and config.nice == 3
    with pytest.raises(SystemExit):
        decode_args(["--nice", "20"])


def _placed(*args: str) -> list[str]:
    """apply(...) in a fresh interpreter: its affinity, torch threads and niceness."""
    code = ("import os, sys, torch; from common.serving.placement import apply; "
            f"apply({', '.join(args)}); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.nice(0))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split("]")


def test_threads_follow_the_affinity() -> None:
    first = min(os.sched_getaffinity(0))
    cpus, rest = _placed(f"({first},)", "None", "2")
    assert cpus == f"[{first}" and rest.split() == ["1", str(os.nice(0) + 2)]
    everything = len(os.sched_getaffinity(0))
    assert _placed("None", "None", "0")[1].split()[0] == str(everything)
    assert _placed("None", "3", "0")[1].split()[0] == "3"  # --threads wins


def _openmp_workers(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process `pid` that sleeps inside libgomp: an idle OpenMP
    worker waits on a futex it calls from libgomp's own code; every other thread blocks in libc."""
    spans = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and "libgomp" in fields[5] and "x" in fields[1]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            spans.append((low, high))
    workers = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        call = (task / "syscall").read_text().split()
        if len(call) > 2 and any(low <= int(call[-1], 16) < high for low, high in spans):
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            workers[task.name] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return workers


def _generate(dn, prompt_len: int, max_tokens: int) -> None:
    drain(dn.stub.Generate(pb.GenerateRequest(token_ids=random_ids(prompt_len, prompt_len), sampling=greedy(max_tokens))))
    time.sleep(0.5)  # idle workers have stopped spinning and sleep


def _threads_after(work: str) -> list[int]:
    """Thread counts of a fresh interpreter with 2 torch threads: before, and (once a worker
    leaving would have left) after `work` ran a parallel op."""
    code = ("import os, time, torch; from common.serving.placement import in_passing_thread; "
            "torch.set_num_threads(2); count = lambda: len(os.listdir('/proc/self/task')); before = count(); "
            "op = lambda: torch.ones(1 << 22).mul_(2); "
            f"{work}; time.sleep(0.5); print(before, count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()]


def test_a_passing_thread_takes_its_openmp_pool_with_it() -> None:
    before, after = _threads_after("op()")
    assert after == before + 1  # a parallel op in a lasting thread leaves its worker behind
    before, after = _threads_after("in_passing_thread(op)")
    assert after == before


def test_a_serving_daemon_computes_in_one_openmp_pool(tmp_path: Path) -> None:
    """Model loading and the KV pool's allocation ran in parallel on another thread than the
    engine's; a second pool makes libgomp stop spinning at every barrier of every step. And the
    engine keeps both threads through the kernels' first call in it (cpu/intra_op_threads.cpp)."""
    with decode_node(tmp_path, "--threads", "2") as dn:
        _generate(dn, 200, 2)  # a prefill and a decode step
        (worker, busy), = _openmp_workers(dn.proc.pid).items()  # the engine thread's one worker
        _generate(dn, 8, 48)  # decode steps
        assert _openmp_workers(dn.proc.pid)[worker] > busy + 0.05  # it took part in them


def test_transports_and_checksums_compute_on_their_own_threads_alone(tmp_path: Path) -> None:
    """KV sent over TCP and checked on arrival (--verify-kv on) by gRPC and transport threads
    opens no pool of their own on either node."""
    args = ("--threads", "2", "--transport", "tcp")
    with started_pair(tmp_path, args, args) as (dn, pn):
        for _ in range(2):
            _generate(dn, 300, 4)
        assert len(_openmp_workers(dn.proc.pid)) == 1 and len(_openmp_workers(pn.proc.pid)) == 1
