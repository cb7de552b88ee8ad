"""When a writer's run is provably over without its word (common/serving/incarnation.py): only for
a process of this host and this pid namespace that no longer runs."""
from __future__ import annotations

import subprocess

from common.serving.incarnation import INCARNATION, process_start_ticks, provably_gone, writer_identity


def test_a_running_process_is_not_gone_and_an_ended_one_is():
    with subprocess.Popen(["sleep", "60"]) as child:
        writer = writer_identity("127.0.0.1:1")
        writer.pid, writer.process_start_ticks = child.pid, process_start_ticks(child.pid)
        assert writer.incarnation == INCARNATION and not provably_gone(writer)
        child.kill()
        child.wait()
    assert provably_gone(writer)


def test_a_reused_pid_is_a_new_process():
    writer = writer_identity("127.0.0.1:1")
    writer.process_start_ticks -= 1  # our pid, started at another time: not the writer's process
    assert provably_gone(writer)


def test_nothing_is_proven_about_another_host_or_another_containers_pids():
    for field, value in (("boot_id", "another-host"), ("pid_namespace", "pid:[1]"), ("boot_id", "")):
        writer = writer_identity("127.0.0.1:1")
        writer.pid = 2**22 + 12345  # no such process here
        setattr(writer, field, value)
        assert not provably_gone(writer), field
