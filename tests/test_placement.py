"""Daemon placement (common/serving/placement.py): --cpus lists, thread pools sized from the affinity,
the prefill node's lower priority by default."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.serving.placement import parse_cpus
from decode_node.config import parse_args as decode_args
from prefill_node.config import parse_args as prefill_args

ROOT = Path(__file__).resolve().parent.parent


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
