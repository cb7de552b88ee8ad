"""How many threads the engine computes with, while neighbours come and go.

The engine's parallel regions are OpenMP teams whose threads spin at every barrier: on an idle
host the fastest way to run many small regions (a decode step of the default model is ~300 of
them). When another process takes one of the team's cores, the thread that shares it runs only
in the time slices the kernel leaves it, and every region waits for it: beside one busy-loop
neighbour a two-thread decode step's p90 grows several-fold, past a one-thread step's. Passive
waits (OMP_WAIT_POLICY=passive) survive the neighbour as well but slow every step on an idle
host, where every region then wakes its threads from a futex sleep (docs/bench/README.md,
"Figures behind the code", has the measurements).

So the team keeps spinning, and its size follows the cores the engine actually gets, between one
thread and the ceiling the daemon's placement gave it (its CPUs, its cgroup's CPU quota):
- one thread fewer when, over a window of WINDOW_BUSY_S of steps, the team's threads were runnable but waiting
  for a CPU (their `run_delay`, /proc/<pid>/task/<tid>/schedstat), or their CPUs were taken away
  by the hypervisor (steal time, /proc/stat, counted for the share of the window the engine
  computed), for more than STOLEN_SHARE of their time: a neighbour holds one of the cores, in
  this machine or beside it. A virtual machine whose host runs short of cores steals its vCPUs'
  time, which the guest's run queues never show, and two threads then do the same work in more
  CPU time than one, and slower;
- one thread more when the CPUs the engine may run on were idle for at least SPARE_CORES of a
  core over the window (/proc/stat) and no thread was dropped in the last HOLD_S: the core is back.
  A thread taken back must pay: if steps of the same size (tokens) are not at least
  1 / TAKE_BACK_GAIN times as fast as just before, it is dropped again. That is how a heavy
  client on the same host shows (aiperf): it takes the CPU between the engine's steps
  more than inside them, so the team's threads wait little, yet two threads step no faster than
  one. A thread dropped again right after it was taken back (a neighbour that comes and goes)
  doubles that hold, up to MAX_HOLD_S; one that stays resets it.
The count is the engine thread's own OpenMP setting (`omp_set_num_threads` acts on the calling
thread only), which torch's operators and cpu/'s kernels both read, and its own MKL setting
(`MKL_Set_Num_Threads_Local`), which MKL's products read; no other thread's. The
results do not depend on it: every kernel splits its work over output rows, tokens or heads,
never inside a sum (tests/unit/test_compute_threads.py checks logits bit for bit).

The team's threads are found by name: the engine thread names itself TEAM_NAME before its first
parallel region, and the OpenMP workers it creates inherit the name from it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TEAM_NAME = "duet-compute"  # at most 15 characters: a Linux thread name
WINDOW_BUSY_S = 0.1  # decisions are made on windows holding this much step time
FAILED_RAISE_S = 1.0  # a drop this soon after a take-back means the neighbour is still there
TAKE_BACK_GAIN = 0.9  # a taken-back thread stays if same-size steps take at most this share of their time
VERIFY_WINDOWS = 5  # windows after a take-back in which to find steps of a size seen just before
STOLEN_SHARE = 0.15  # a team whose threads waited this share of their time for a CPU drops one
SPARE_CORES = 0.5  # idle capacity (in cores) over the window that takes a thread back
HOLD_S = 5.0  # no thread is taken back this soon after one was dropped ...
MAX_HOLD_S = 60.0  # ... nor, after drops that followed a take-back at once, this soon
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _loaded_libraries(*names: str) -> list[str]:
    """Paths of the shared libraries this process loaded whose path holds one of `names`."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if any(name in line for name in names)})


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (torch's libgomp or libiomp), or None."""
    paths = _loaded_libraries("libgomp", "libiomp")
    return ctypes.CDLL(paths[0]) if paths else None


def _mkl_thread_count() -> Callable[[int], int] | None:
    """MKL's setter of the calling thread's own count, where the process carries MKL (torch's
    x86 CPU build links it into libtorch_cpu), or None. MKL's products fork a team of MKL's
    count, not OpenMP's, so a team shrunk in OpenMP alone still ran its dropped thread in every
    float32 product MKL computes (a prefill chunk's attention): beside a neighbour that thread
    waited for a CPU, and the one-thread engine stepped several times slower than one started
    with a single thread."""
    for path in _loaded_libraries("libtorch_cpu", "libmkl_rt"):
        setter = getattr(ctypes.CDLL(path), "MKL_Set_Num_Threads_Local", None)  # the C interface, by value
        if setter is not None:
            return setter
    return None


def _name_this_thread(name: str) -> None:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(name)


class Team:
    """The threads named TEAM_NAME in this process (a thread's name is read when its id is first
    seen; ids of threads that ended are forgotten)."""

    def __init__(self, name: str = TEAM_NAME) -> None:
        self.name = name
        self._is_member: dict[int, bool] = {}

    def run_delay_ns(self) -> dict[int, int]:
        """Each member thread: nanoseconds it has waited, runnable, for a CPU."""
        known, self._is_member, delays = self._is_member, {}, {}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                member = known.get(tid)
                if member is None:
                    with open(f"/proc/self/task/{tid}/comm") as comm:
                        member = comm.read().rstrip("\n") == self.name
                self._is_member[tid] = member
                if member:
                    with open(f"/proc/self/task/{tid}/schedstat") as stat:
                        delays[tid] = int(stat.read().split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended, or no schedstats in this kernel
                continue
        return delays


def idle_and_steal_seconds(cpus: set[int]) -> tuple[float, float]:
    """Seconds `cpus` have been idle (idle + iowait) and stolen by the hypervisor since boot,
    each summed over them (/proc/stat)."""
    idle = steal = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                idle += int(values[3]) + int(values[4])
                steal += int(values[7]) if len(values) > 7 else 0
    return idle / _CLOCK_TICKS, steal / _CLOCK_TICKS


@dataclass
class _Window:
    began: float
    idle_s: float
    steal_s: float
    delays: dict[int, int]
    busy_s: float = 0.0
    step_s: dict[int, list[float]] = field(default_factory=dict)  # tokens of a step -> its durations

    def median_step_s(self) -> dict[int, float]:
        return {tokens: statistics.median(times) for tokens, times in self.step_s.items()}


@dataclass
class ComputeThreads:
    """The engine thread's team size. `start` and `after_step` are called from the engine
    thread only; `current` may be read from any thread (a metric)."""

    ceiling: int
    adaptive: bool = True
    clock: Callable[[], float] = time.monotonic
    cpu_times: Callable[[set[int]], tuple[float, float]] = idle_and_steal_seconds
    current: int = field(init=False)
    _set_threads: Callable[[int], None] | None = field(default=None, init=False)
    _window: _Window | None = field(default=None, init=False)
    _team: Team = field(default_factory=Team, init=False)
    _dropped_at: float = field(default=float("-inf"), init=False)
    _raised_at: float = field(default=float("-inf"), init=False)
    _hold_s: float = field(default=HOLD_S, init=False)
    _before_raise: dict[int, float] | None = field(default=None, init=False)  # median step time by size
    _verify_windows: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.current = self.ceiling

    def start(self) -> None:
        """In the engine thread, before its first parallel region: name it for its workers to
        inherit, and find the call that sets its thread count."""
        if not self.adaptive or self.ceiling < 2:
            return
        try:
            _name_this_thread(TEAM_NAME)
            runtime = _openmp_runtime()
        except OSError as exc:
            runtime, reason = None, str(exc)
        else:
            reason = "no OpenMP runtime loaded"
        if runtime is None:
            log.warning("compute threads stay at %d: %s", self.ceiling, reason)
            return
        openmp, mkl = runtime.omp_set_num_threads, _mkl_thread_count()

        def set_threads(threads: int) -> None:
            openmp(threads)
            if mkl is not None:
                mkl(threads)

        self._set_threads = set_threads

    def after_step(self, busy_s: float, tokens: int) -> None:
        """Account a step of `busy_s` seconds that computed `tokens` tokens (a step that computed
        none only waited for work); once a window is full, maybe resize the team."""
        if self._set_threads is None or tokens == 0:
            return
        window = self._window
        if window is not None:
            window.busy_s += busy_s
            window.step_s.setdefault(tokens, []).append(busy_s)
            if window.busy_s < WINDOW_BUSY_S:
                return
        now, delays = self.clock(), self._team.run_delay_ns()
        idle_s, steal_s = self.cpu_times(os.sched_getaffinity(0))
        self._window = _Window(now, idle_s, steal_s, delays)
        if window is not None:
            wall_s = max(now - window.began, 1e-3)
            waited_s = sum(delays[t] - window.delays[t] for t in delays.keys() & window.delays.keys()) / 1e9
            waited_s += (steal_s - window.steal_s) * min(1.0, window.busy_s / wall_s)
            self.decide(stolen=waited_s / (window.busy_s * self.current),
                        spare_cores=(idle_s - window.idle_s) / wall_s, step_s=window.median_step_s(), now=now)

    def decide(self, stolen: float, spare_cores: float, step_s: dict[int, float], now: float) -> None:
        """Resize the team from one window: `stolen`, the share of the team's busy time spent
        waiting for a CPU; `spare_cores`, the idle capacity of the engine's CPUs; `step_s`, the
        median step time by the step's tokens."""
        slower = self._take_back_did_not_pay(step_s)
        if slower is not None:
            self._drop(now, f"{slower:.2f}x the step time of one thread fewer", failed_take_back=True)
        elif self.current > 1 and stolen > STOLEN_SHARE:
            self._drop(now, f"its threads waited {stolen:.0%} of their time for a CPU",
                       failed_take_back=now - self._raised_at <= FAILED_RAISE_S or self._before_raise is not None)
        elif self.current < self.ceiling and spare_cores >= SPARE_CORES and now - self._dropped_at >= self._hold_s:
            self._resize(self.current + 1, f"{spare_cores:.1f} of its cores were idle")
            self._raised_at, self._before_raise, self._verify_windows = now, step_s, VERIFY_WINDOWS

    def _take_back_did_not_pay(self, step_s: dict[int, float]) -> float | None:
        """After a take-back: the step time against that of same-size steps just before, where
        that shows the take-back did not pay; None while it did or nothing compares yet."""
        if self._before_raise is None:
            return None
        common = step_s.keys() & self._before_raise.keys()
        self._verify_windows -= 1
        if not common:
            if self._verify_windows <= 0:
                self._before_raise = None
            return None
        before, self._before_raise = self._before_raise, None
        ratio = statistics.median(step_s[n] / before[n] for n in common)
        return ratio if ratio > TAKE_BACK_GAIN else None

    def _drop(self, now: float, why: str, failed_take_back: bool) -> None:
        self._hold_s = min(2 * self._hold_s, MAX_HOLD_S) if failed_take_back else HOLD_S
        self._before_raise = None
        self._resize(self.current - 1, f"{why}; none taken back for {self._hold_s:.0f} s")
        self._dropped_at = now

    def _resize(self, threads: int, why: str) -> None:
        log.info("compute threads %d -> %d: %s", self.current, threads, why)
        self.current = threads
        if self._set_threads is not None:
            self._set_threads(threads)
