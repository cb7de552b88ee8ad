"""Daemon flags and the optional JSON config file."""
from __future__ import annotations

import json

import pytest

from decode_node.config import parse_args as decode_args
from prefill_node.config import parse_args as prefill_args


def test_config_file_values_are_overridden_by_flags(tmp_path):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"page-size": 8, "kv_pages": 64, "prefill": ["p1:1"], "transport": "tcp"}))
    c = decode_args(["--config", str(path), "--kv-pages", "128"])
    assert (c.page_size, c.kv_pages, c.prefill, c.transport) == (8, 128, ("p1:1",), "tcp")


def test_defaults():
    d, p = decode_args([]), prefill_args([])
    assert d.page_size == p.page_size == 16 and d.kv_pages * d.page_size >= 16_000
    assert d.lease_seconds == 30.0 and d.transport == p.transport == "nixl" and d.prefill == ()
    assert d.drain_seconds == p.drain_seconds == 10.0
    assert d.verify_kv == "on" and decode_args(["--verify-kv", "off"]).verify_kv == "off"
    assert d.routing_policy.mode == "prefix" and decode_args(["--routing", "load"]).routing_policy.mode == "load"
    assert d.drain_to == () and decode_args(["--drain-to", "h:1", "--drain-to", "g:2"]).drain_to == ("h:1", "g:2")
    assert d.kv_offload_dir is p.kv_offload_dir is None and d.kv_offload_gib == 16.0 and d.prefix_fetch == "on"
    # A hybrid model's sliding group: as many pages as --kv-pages, none beside the disk tier.
    assert d.sliding_pages is p.sliding_pages is None and decode_args(["--kv-sliding-pages", "8"]).sliding_pages == 8
    assert prefill_args(["--kv-offload-dir", "/tmp/tier"]).sliding_pages == 0


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "--page-size"),
    (["--lease-seconds", "-1"], "--lease-seconds"),
    (["--pd-balance", "1.5"], "--pd-balance"),
    (["--transport", "carrier-pigeon"], "invalid choice"),
    (["--drain-seconds", "0"], "--drain-seconds"),
    (["--routing", "nearest"], "invalid choice"),
    (["--load-weight", "-1"], "--load-weight"),
    (["--verify-kv", "maybe"], "invalid choice"),
    (["--drain-to", "no-port"], "--drain-to"),
    (["--drain-to", "host:http"], "--drain-to"),
    (["--kv-events-topic", "kv@x"], "--kv-events-endpoint"),
    (["--kv-events-replay-endpoint", "tcp://*:5558"], "--kv-events-endpoint"),
    (["--kv-offload-gib", "0"], "--kv-offload-gib"),
    (["--kv-offload-dir", __file__], "is not a directory"),
    (["--prefix-fetch", "maybe"], "invalid choice"),
    (["--kv-sliding-pages", "-1"], "--kv-sliding-pages must be >= 0"),
    (["--kv-sliding-pages", "8", "--kv-offload-dir", "/tmp/tier"], "--kv-sliding-pages 0"),
    (["--api-server-count", "0"], "--api-server-count: must be at least 1"),
    (["--anthropic-billing-header", "drop"], "invalid choice"),
    (["--quantization", "int3"], "invalid choice"),
    (["--quantization", "gguf", "--model", "/tmp"], "is not a .gguf file"),
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        decode_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("config_text, message", [
    ('{"api-server-count": 0}', "--api-server-count must be an integer >= 1"),
    ('{"anthropic-billing-header": "drop"}', "--anthropic-billing-header must be one of strip, keep"),
])
def test_a_config_files_http_front_values_are_checked_too(tmp_path, capsys, config_text, message):
    config = tmp_path / "decode.json"
    config.write_text(config_text)
    with pytest.raises(SystemExit) as info:
        decode_args(["--config", str(config)])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_unknown_config_file_key_is_an_error(tmp_path, capsys):
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps({"page_sise": 8}))
    with pytest.raises(SystemExit):
        prefill_args(["--config", str(path)])
    assert "unknown setting 'page_sise'" in capsys.readouterr().err
