"""scripts/chaos_load.py's pieces that need no daemons: the session plan, the tally of a pass,
the verdict against the goals."""
from __future__ import annotations

from scripts.chaos_load import Pass, Record, Run, sessions, summarize, verdict

ROUTERS, DECODES = ["r0", "r1"], ["d0", "d1"]


def test_sessions_add_up_to_the_requests_and_mix_single_and_multi_turn():
    plan = sessions(200, 5, 50, 3, 0.3, ROUTERS, DECODES)
    assert sum(len(s.questions) + 1 for s in plan) == 200
    turns = [len(s.questions) + 1 for s in plan]
    assert turns.count(1) > 10 and turns.count(3) > 10
    for s in plan:
        first, fallback = s.entry
        assert first != fallback and ({first, fallback} == set(ROUTERS) or {first, fallback} == set(DECODES))
        assert 128 <= len(s.prompt) <= 384 and all(16 <= len(q) <= 64 for q in s.questions)
    direct = sum(s.entry[0] in DECODES for s in plan) / len(plan)
    assert 0.15 < direct < 0.45


def test_two_passes_send_the_same_shapes_with_prompts_neither_shares():
    plan, same, other = (sessions(200, 5, p, 3, 0.3, ROUTERS, DECODES) for p in (50, 50, 51))
    assert [s.prompt for s in same] == [s.prompt for s in plan]
    shape = [(s.entry, len(s.prompt), [len(q) for q in s.questions]) for s in plan]
    assert [(s.entry, len(s.prompt), [len(q) for q in s.questions]) for s in other] == shape
    assert not {tuple(s.prompt) for s in other} & {tuple(s.prompt) for s in plan}


def test_a_pass_counts_statuses_wrong_tokens_hangs_and_router_retries():
    records = [Record(0, 0, "a", "r0", [1], "OK", tokens=[5, 6], start=0.0, end=8.0, retries=1, exact=True),
               Record(1, 0, "b", "r1", [1], "OK", tokens=[5, 7], start=1.0, end=9.0, exact=False),
               Record(2, 0, "c", "d0", [1], "UNAVAILABLE", "gone", [5], 2.0, 6.0, retries=1, exact=True),
               Record(3, 0, "d", "r1", [1], "HUNG", start=3.0, end=10.0),
               Record(3, 1, "e", "r1", [1], "NOT_SENT")]
    p = summarize("faulted", records, set(ROUTERS))
    assert (p.requests, p.completed, p.wrong, p.hung) == (5, 2, 1, 1)
    assert p.failed == {"UNAVAILABLE": 1, "HUNG": 1, "NOT_SENT": 1}
    assert p.seconds == 10.0 and p.goodput == 0.1  # one exact completion in 10 s
    assert (p.router_retries, p.router_retries_exact) == (1, 1)  # the decode node's retry is not a router's
    assert [f.split(" ")[0] for f in p.failures] == ["b", "c", "d"]  # wrong, failed, hung; not the unsent turn


def test_the_verdict_names_every_missed_goal():
    free = Pass("fault-free", 200, 200, {}, 0, 0, 100.0, 2.0, 0, 0)
    fine = Run("tcp", 1, 2.5, 2.0, [free, Pass("faulted", 200, 198, {"UNAVAILABLE": 2}, 0, 0, 105.0, 1.85, 4, 4)],
               [], {"d0": None, "d1": None})
    assert verdict(fine) == []
    bad = Run("nixl", 1, 2.5, 2.0, [free, Pass("faulted", 200, 190, {"UNAVAILABLE": 10}, 1, 2, 150.0, 1.2, 4, 3)],
              [], {"d0": "reserved=3", "d1": None})
    assert verdict(bad) == ["nixl: wrong tokens: 1", "nixl: hung requests: 2", "nixl: pages stranded on d0: reserved=3",
                            "nixl: completed 190/200 < 99%", "nixl: moved to the other router: 3/4 exact",
                            "nixl: goodput 0.60x < 0.9x"]
