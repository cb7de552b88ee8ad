"""Daemons the HTTP test modules share, started once per session."""
from __future__ import annotations

import pytest

from common.openai_http.api_keys import ENV_VAR
from harness.helpers import Started
from harness.local_daemons import free_port
from harness.openai_front import API_KEYS as KEYS
from harness.openai_front import DAEMON_FLAGS, Front


@pytest.fixture(scope="session")
def keyed(tmp_path_factory):
    """A prefill node and a decode node handing prompts to it, the decode node serving HTTP under
    two API keys (one by flag, one by DUET_API_KEY), and a router over them serving HTTP too."""
    tmp = tmp_path_factory.mktemp("keyed")
    port, router_port = free_port(), free_port()
    with Started(tmp) as s:
        pn = s.spawn("prefill_node", *DAEMON_FLAGS)
        dn = s.spawn("decode_node", *DAEMON_FLAGS, "--prefill", pn.address, "--min-remote-prefill-tokens", "8",
                     "--openai-port", str(port), "--api-key", KEYS[0], env={ENV_VAR: KEYS[1]})
        s.wait()
        rt = s.spawn("router", "--decode", dn.address, "--prefill", pn.address, "--poll-seconds", "0.2",
                     "--openai-port", str(router_port), "--api-key", KEYS[0])
        s.wait()
        yield dn, rt, Front(port, api_key=KEYS[0]), Front(router_port, api_key=KEYS[0])
