"""The soak's verdict (scripts/soak.py): growth over the second half, failures, wrong tokens and
pages, judged from samples."""
from __future__ import annotations

from scripts.soak import GROWTH_LIMIT, Tally, growth, labelled, report, verdict


def _samples(rss: list[float]) -> list[dict]:
    return [{"t": 10.0 * i, "decode-a": {"rss_mib": v, "fds": 30, "threads": 20}} for i, v in enumerate(rss)]


def test_flat_series_and_one_spike_are_not_growth():
    assert growth([100.0] * 40) == 0.0
    assert growth([100.0] * 39 + [500.0]) == 0.0  # the median of the last tenth ignores one spike


def test_growth_is_second_half_against_its_start():
    first_half, second_half = [100.0] * 20, [100.0 + i for i in range(20)]
    assert 0.15 < growth(first_half + second_half) < 0.2
    assert growth([50.0 + 5 * i for i in range(10)] + [100.0] * 30) == 0.0  # a warm-up in the first half


def test_verdict_names_what_grew_failed_or_leaked():
    tally = Tally()
    tally.note("abort", "CANCELLED")
    tally.note("chat", "ok")
    assert verdict(_samples([1000.0] * 40), tally, None) == []

    rising = [1000.0] * 20 + [1000.0 * (1 + 2 * GROWTH_LIMIT * i / 19) for i in range(20)]
    tally.note("long", "UNAVAILABLE")
    tally.wrong.append("long: tokens [1, 2]")
    misses = verdict(_samples(rising), tally, "decode-a: reserved=3")
    assert [m.split(" ")[0] for m in misses] == ["decode-a", "long:UNAVAILABLE", "wrong", "pages"]
    assert "rss_mib grew" in misses[0]


def test_labelled_sums_by_label():
    page = ('# HELP duet_prompt_tokens_total x\nduet_prompt_tokens_total{source="disk"} 32.0\n'
            'duet_prompt_tokens_total{source="peer"} 16.0\nduet_migrations_total{reason="rpc",outcome="migrated"} 2.0\n'
            'duet_migrations_total{reason="drain",outcome="migrated"} 1.0\n')
    assert labelled(page, "duet_prompt_tokens_total", "source") == {"disk": 32.0, "peer": 16.0}
    assert labelled(page, "duet_migrations_total", "outcome") == {"migrated": 3.0}


def test_the_report_names_the_run_the_verdict_and_each_daemon():
    samples = _samples([1000.0] * 20)
    record = {"command": "python -m scripts.soak --minutes 1", "machine": {"cpu": "Test CPU", "flags": ["avx2"], "cpus": 2},
              "commit": "abc1234", "minutes": 1.0, "ok": {"chat:ok": 3}, "failed": {"long:UNAVAILABLE": 1},
              "checked": 2, "unchecked": 0, "wrong": [], "prompt_tokens": {"decode-a": {"pool": 16.0}},
              "growth_second_half": {"decode-a": {"rss_mib": 0.0, "fds": 0.0, "threads": 0.0}},
              "misses": ["long:UNAVAILABLE failed 1x"], "samples": samples}
    text = report(record)
    assert "Test CPU (avx2), 2 CPUs, commit abc1234" in text and "**Verdict: miss**: long:UNAVAILABLE" in text
    assert "| decode-a | 1000 / 1000 (+0.0%) | 30 / 30 (+0.0%) | 20 / 20 (+0.0%) |" in text
    assert "chat 3; failed: long:UNAVAILABLE 1" in text and "Every page back once the load stopped: yes." in text
