"""A chat template is untrusted code (common/model/chat_template.py): one that would run for
minutes or take gigabytes stops at once at a bound, as a SecurityError naming it; the real
templates render as before (tests/unit/test_tokenizer.py compares them with transformers)."""
from __future__ import annotations

import time

import pytest
from jinja2.exceptions import SecurityError

from common.model.chat_template import MAX_RANGE_ITEMS, MAX_RENDERED_CHARS, ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, bound", [
    ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", "ranges of more than"),
    ("{{ 'a' * 2000000000 }}", "builds a value of"),
    ("{{ [1] * 2000000000 }}", "builds a value of"),
    ("{{ 10 ** 100000000 }}", "to the power"),
    ("{% for a in range(99999) %}{{ 'x' * 999 }}{% endfor %}", "renders more than"),
])
def test_a_runaway_template_stops_at_a_bound(source, bound):
    started = time.monotonic()
    with pytest.raises(SecurityError, match=bound):
        ChatTemplate(source).render(messages=MESSAGES)
    assert time.monotonic() - started < 10


def test_within_the_bounds_a_template_renders_and_each_render_has_its_own_budget():
    template = ChatTemplate("{% for i in range(N) %}.{% endfor %}{{ messages[0]['content'] * 3 }}"
                            .replace("N", str(MAX_RANGE_ITEMS)))
    for _ in range(2):  # the second render is not charged for the first's ranges
        assert template.render(messages=MESSAGES) == "." * MAX_RANGE_ITEMS + "hihihi"
    assert len(ChatTemplate(f"{{{{ 'a' * {MAX_RENDERED_CHARS} }}}}").render()) == MAX_RENDERED_CHARS
