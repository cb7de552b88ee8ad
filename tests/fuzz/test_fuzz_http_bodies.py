"""The HTTP request bodies fuzzed by their grammar: a seed body of each generating route
(tests/fuzz/corpus/http_body/), one to three of its values replaced by random JSON, deleted or
repeated, must map to a request or be refused with a 4xx ApiError, never fail otherwise.
Hypothesis draws the mutations (`make test`: a smoke of a few hundred; `make fuzz`: the
`fuzz` profile's budget)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from harness.fuzz_targets import GENERATING_ROUTES, map_or_refuse

SEEDS = {p.stem: json.loads(p.read_text()) for p in (Path(__file__).resolve().parent / "corpus" / "http_body").glob("*.json")
         if not p.name.startswith("finding-")}
WORDS = ["user", "assistant", "system", "tool", "function", "auto", "any", "none", "required", "text", "tool_use",
         "tool_result", "message", "function_call", "function_call_output", "c1", "t1", "f", "object", "json_schema"]
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(), st.text(max_size=5),
                   st.sampled_from(WORDS))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4) | st.sampled_from(["type", "name", "role"]),
                                                 inner, max_size=3)), max_leaves=8)


def _paths(value, path=()):
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _paths(inner, (*path, key))


@st.composite
def mutated_bodies(draw):
    route = draw(st.sampled_from(sorted(SEEDS)))
    body = copy.deepcopy(SEEDS[route])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "repeat"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "repeat" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = draw(VALUES)
    return route, body


def test_the_seeds_cover_every_generating_route():
    assert set(SEEDS) == set(GENERATING_ROUTES)


@given(mutated_bodies())
def test_a_mutated_body_maps_or_is_a_4xx(case):
    map_or_refuse(*case)
