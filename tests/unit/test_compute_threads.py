"""The engine's team size (common/engine/compute_threads.py) and its ceiling, the cgroup CPU quota
(common/serving/placement.py): when it drops or takes back a thread, that the count reaches torch and
the kernels in the engine thread only, and that logits do not depend on it."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from common.engine import compute_threads as ct
from common.engine.compute_threads import ComputeThreads, Team
from common.engine.core import Engine
from common.serving.placement import quota_cpus
from cpu import extension as cpu_extension
from harness.helpers import random_ids


def test_a_neighbour_takes_a_thread_and_a_free_core_gives_it_back() -> None:
    team = ComputeThreads(ceiling=3)
    team.decide(step_s={}, stolen=0.05, spare_cores=0.0, now=0.0)
    assert team.current == 3  # waiting a little is not a neighbour
    team.decide(step_s={}, stolen=ct.STOLEN_SHARE + 0.1, spare_cores=0.0, now=1.0)
    team.decide(step_s={}, stolen=ct.STOLEN_SHARE + 0.1, spare_cores=0.0, now=2.0)
    team.decide(step_s={}, stolen=0.9, spare_cores=0.0, now=3.0)
    assert team.current == 1  # never below one; the last drop was at 2.0
    team.decide(step_s={}, stolen=0.0, spare_cores=1.0, now=2.0 + ct.HOLD_S - 0.1)
    assert team.current == 1  # held a while after a drop
    team.decide(step_s={}, stolen=0.0, spare_cores=ct.SPARE_CORES - 0.1, now=3.0 + ct.HOLD_S)
    assert team.current == 1  # the core is not free yet
    team.decide(step_s={}, stolen=0.0, spare_cores=1.0, now=3.0 + ct.HOLD_S)
    team.decide(step_s={}, stolen=0.0, spare_cores=1.0, now=4.0 + ct.HOLD_S)
    team.decide(step_s={}, stolen=0.0, spare_cores=2.0, now=5.0 + ct.HOLD_S)
    assert team.current == 3  # never above the ceiling


def test_a_neighbour_that_comes_and_goes_is_given_longer_holds() -> None:
    team = ComputeThreads(ceiling=2)
    team.decide(step_s={}, stolen=0.5, spare_cores=0.0, now=0.0)  # dropped: held HOLD_S
    now, holds = ct.HOLD_S, []
    for _ in range(6):
        team.decide(step_s={}, stolen=0.0, spare_cores=1.0, now=now)  # taken back as soon as the hold ends
        assert team.current == 2
        team.decide(step_s={}, stolen=0.5, spare_cores=0.0, now=now + ct.FAILED_RAISE_S)  # and dropped at once
        holds.append(team._hold_s)
        now += ct.FAILED_RAISE_S + team._hold_s
        team.decide(step_s={}, stolen=0.0, spare_cores=1.0, now=now - 0.1)
        assert team.current == 1  # still held
    assert holds == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    team.decide(step_s={4: 0.03}, stolen=0.0, spare_cores=1.0, now=now)
    team.decide(step_s={4: 0.015}, stolen=0.0, spare_cores=1.0, now=now + 0.1)  # a take-back that paid
    team.decide(step_s={}, stolen=0.5, spare_cores=0.0, now=now + 10 * ct.FAILED_RAISE_S)  # and held a while
    assert team._hold_s == ct.HOLD_S


def test_a_take_back_that_does_not_make_same_size_steps_faster_is_dropped_again() -> None:
    team = ComputeThreads(ceiling=2)
    team.decide(step_s={}, stolen=0.5, spare_cores=0.0, now=0.0)
    team.decide(step_s={4: 0.030, 300: 0.2}, stolen=0.0, spare_cores=1.0, now=ct.HOLD_S)
    assert team.current == 2
    team.decide(step_s={5: 0.02}, stolen=0.0, spare_cores=1.0, now=ct.HOLD_S + 0.1)
    assert team.current == 2  # no step of a size seen before: nothing to compare yet
    team.decide(step_s={4: 0.029, 5: 0.02}, stolen=0.0, spare_cores=1.0, now=ct.HOLD_S + 0.2)
    assert team.current == 1 and team._hold_s == 2 * ct.HOLD_S  # 0.97x the time: it did not pay
    now = 3 * ct.HOLD_S + 1
    team.decide(step_s={4: 0.030}, stolen=0.0, spare_cores=1.0, now=now)
    team.decide(step_s={4: 0.018}, stolen=0.0, spare_cores=1.0, now=now + 0.1)
    team.decide(step_s={4: 0.018}, stolen=0.0, spare_cores=1.0, now=now + 10)
    assert team.current == 2  # 0.6x the time: it stays
    team.decide(step_s={4: 0.030}, stolen=0.0, spare_cores=1.0, now=now + 20)
    assert team.current == 2  # compared once, right after the take-back, not ever after


@pytest.mark.parametrize("steal_per_step_s, threads", [(0.0, 2), (0.04, 1)])
def test_time_the_hypervisor_steals_counts_as_waiting(steal_per_step_s: float, threads: int) -> None:
    clock, steal = [0.0], [0.0]
    team = ComputeThreads(ceiling=2, clock=lambda: clock[0], cpu_times=lambda cpus: (0.0, steal[0]))
    team._set_threads = lambda n: None
    for _ in range(3):  # steps back to back, 50 ms each; with steal, 40% of the team's time is gone
        clock[0] += 0.05
        steal[0] += steal_per_step_s
        team.after_step(0.05, 4)
    assert team.current == threads


def test_a_fixed_count_never_moves() -> None:
    team = ComputeThreads(ceiling=2, adaptive=False)
    team.start()
    for step in range(50):
        team.after_step(1.0, 4)
    assert team.current == 2 and team._set_threads is None


def _in_engine_thread(fn):
    """`fn()` in a thread of its own, as the engine loop runs; its result or exception here."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("fixture", ["model", "model_bf16"])
def test_the_count_reaches_the_engine_thread_alone_and_logits_do_not_depend_on_it(request, fixture: str) -> None:
    model = request.getfixturevalue(fixture)
    prompts = [random_ids(n, seed=n) for n in (37, 5, 120)]

    def logits() -> torch.Tensor:
        engine = Engine(model, num_pages=40, page_size=16)
        seqs = [engine.new_sequence(f"s{i}", p, use_prefix_cache=False) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.reserve(seq, len(seq.token_ids) + 1)
        prefill = engine.forward([(seq, len(seq.token_ids)) for seq in seqs])
        for seq, token in zip(seqs, prefill.argmax(-1).tolist()):
            seq.token_ids.append(token)
        return torch.cat([prefill, engine.forward([(seq, 1) for seq in seqs])])

    outside = torch.get_num_threads()

    def run() -> tuple[list[int], list[torch.Tensor], int]:
        torch.set_num_threads(2)
        team = ComputeThreads(cpu_extension.claim_intra_op_threads(torch.device("cpu")))
        team.start()
        counts, outs = [], []
        with torch.inference_mode():
            outs.append(logits())
            workers = len(Team().run_delay_ns())
            team.decide(step_s={}, stolen=0.9, spare_cores=0.0, now=0.0)
            counts.append(torch.get_num_threads())
            outs.append(logits())
            team.decide(step_s={}, stolen=0.0, spare_cores=2.0, now=ct.HOLD_S)
            counts.append(torch.get_num_threads())
            outs.append(logits())
        return counts, outs, workers

    torch.set_num_threads(1)  # as placement.serialize_other_threads leaves other threads
    try:
        counts, outs, workers = _in_engine_thread(run)
    finally:
        torch.set_num_threads(outside)
    assert counts == [1, 2]
    assert workers >= 2  # the engine thread and the OpenMP worker it started, found by name
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _other_threads_cpu_ms() -> float:
    """CPU time of every thread of this process but the calling one, in ms."""
    me, total = threading.get_native_id(), 0.0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0]) / 1e6
    return total


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a dropped thread needs a second CPU to run on")
def test_a_dropped_thread_stays_out_of_float32_matrix_products() -> None:
    """MKL's products (a float32 prefill chunk's attention) fork a team of MKL's own count: a
    team shrunk in OpenMP alone still ran its dropped thread there, and beside a neighbour the
    one-thread engine waited for it (several times slower under aiperf on 2 cores)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def products_ms() -> float:
        """CPU time the other threads spent while this one multiplied."""
        time.sleep(0.1)  # a worker that spun after its last region has gone to sleep
        before = _other_threads_cpu_ms()
        for _ in range(50):
            a @ b
        return _other_threads_cpu_ms() - before

    def run() -> tuple[float, float]:
        torch.set_num_threads(2)
        team = ComputeThreads(cpu_extension.claim_intra_op_threads(torch.device("cpu")))
        team.start()
        two = products_ms()
        team.decide(step_s={}, stolen=0.9, spare_cores=0.0, now=0.0)
        assert team.current == 1
        return two, products_ms()

    outside = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        two, one = _in_engine_thread(run)
    finally:
        torch.set_num_threads(outside)
    assert two > 20.0  # with two threads the worker computes half of each product
    assert one < 5.0


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return tmp_path, tmp_path / "membership"


def test_quota_v2_takes_the_tightest_of_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    root, membership = _cgroup(tmp_path, "0::/pod/app\n", {
        "cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n", "pod/app/cpu.max": "max 100000\n"})
    assert quota_cpus(root, membership) == 1.5


def test_quota_v1(tmp_path: Path) -> None:
    root, membership = _cgroup(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/job\n0::/\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert quota_cpus(root, membership) == 0.5


def test_no_quota(tmp_path: Path) -> None:
    root, membership = _cgroup(tmp_path, "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert quota_cpus(root, membership) is None
    assert quota_cpus(tmp_path / "missing", membership) is None
