"""Every fuzz target (harness/fuzz_targets.py) over its corpus: the seeds, and each input a fuzzer
once found (`finding-*`, fixed since), keeps the target's contract: it works or raises the
target's documented error, in time. A finding of `make fuzz` is fixed, then its input is added
here."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.fuzz_targets import TARGETS

CORPUS = Path(__file__).resolve().parent / "corpus"
INPUTS = sorted((target, path) for target in TARGETS for path in (CORPUS / target).iterdir())


def test_every_target_has_seeds_and_every_corpus_a_target():
    assert {p.name for p in CORPUS.iterdir()} == set(TARGETS)
    assert all(any((CORPUS / t).iterdir()) for t in TARGETS)


@pytest.mark.parametrize("target, path", INPUTS, ids=[f"{t}/{p.name}" for t, p in INPUTS])
def test_each_input_keeps_the_contract(target, path):
    started = time.monotonic()
    TARGETS[target].run(path.read_bytes())
    assert time.monotonic() - started < TARGETS[target].seconds * 10


def test_the_seeds_are_valid_inputs():
    """The seeds themselves are accepted: the fuzzer starts from inputs that reach deep."""
    for target, path in INPUTS:
        if not path.name.startswith("finding-"):
            TARGETS[target].one_input(path.read_bytes())
