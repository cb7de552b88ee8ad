"""A cgroup with a CPU quota for a benchmark's server (a Kubernetes CPU limit is one): cgroup v2's
`cpu.max` where the unified hierarchy has the cpu controller, else cgroup v1's CFS quota (the
same CFS bandwidth control, as a hybrid host mounts it). Creating one takes root; `QuotaUnavailable`
says why not.

    with cpu_quota(1.0) as quota:
        with quota.joined():   # processes started in here are confined, with their children
            start the server
        run the client outside it
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.serving.placement import cgroup_memberships

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class QuotaUnavailable(Exception):
    """No cgroup with a CPU quota could be made here; the message says why."""


class CpuQuota:
    def __init__(self, directory: Path, home: Path) -> None:
        self.directory = directory  # the quota's cgroup
        self._home = home  # the cgroup this process came from, same hierarchy

    @contextmanager
    def joined(self) -> Iterator[None]:
        """This process inside the quota's cgroup, so that what it starts is born there; back home after."""
        _move_self(self.directory)
        try:
            yield
        finally:
            _move_self(self._home)


def _move_self(cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")


def _v2() -> tuple[Path, Path] | None:
    """(root, home) of the v2 hierarchy where it has the cpu controller, or None."""
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if not controllers.is_file() or "cpu" not in controllers.read_text().split():
        return None
    subtree = CGROUP_ROOT / "cgroup.subtree_control"
    if "cpu" not in subtree.read_text().split():
        subtree.write_text("+cpu\n")
    path = next((path for controllers, path in cgroup_memberships() if controllers == ""), None)
    if path is None:
        raise QuotaUnavailable("this process is in no cgroup v2")
    return CGROUP_ROOT, CGROUP_ROOT / path.lstrip("/")


def _v1() -> tuple[Path, Path] | None:
    """(root, home) of the v1 hierarchy holding the cpu controller, or None."""
    for controllers, path in cgroup_memberships():
        if "cpu" in controllers.split(","):
            root = CGROUP_ROOT / controllers
            if (root / "cpu.cfs_quota_us").is_file():
                return root, root / path.lstrip("/")
    return None


@contextmanager
def cpu_quota(cpus: float) -> Iterator[CpuQuota]:
    """A new cgroup allowing `cpus` CPUs per period, removed on exit (stop what runs in it first)."""
    name = f"duet-bench-{os.getpid()}"
    quota_us = int(cpus * PERIOD_US)
    try:
        if (v2 := _v2()) is not None:
            root, home = v2
            directory = root / name
            directory.mkdir()
            (directory / "cpu.max").write_text(f"{quota_us} {PERIOD_US}\n")
        elif (v1 := _v1()) is not None:
            root, home = v1
            directory = root / name
            directory.mkdir()
            (directory / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (directory / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
        else:
            raise QuotaUnavailable("neither cgroup v2 nor v1 has the cpu controller mounted here")
    except OSError as exc:
        raise QuotaUnavailable(f"cannot make a cgroup with a CPU quota: {exc}") from None
    try:
        yield CpuQuota(directory, home)
    finally:
        try:
            directory.rmdir()
        except OSError:
            pass
