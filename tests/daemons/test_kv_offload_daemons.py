"""A decode node with --kv-offload-dir, as a user runs it: a conversation whose prefix the pool
evicted is read back from disk, and after a restart on the same directory its next turn is too
(the trace says so, the KV events announce the tier), with tokens identical to a node without a
tier; the metrics count where each prompt token came from, and no page is left held."""
from __future__ import annotations

import json
import re
import time

from protos.duet.v1 import duet_pb2 as pb
from harness.helpers import Started, drain, greedy, random_ids, wait_clean

FLAGS = ("--dtype", "float32", "--threads", "1", "--page-size", "16")
TIERED = (*FLAGS, "--kv-pages", "40")  # 640 tokens: three 200-token prompts push a fourth out


def _sample(d, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", d.metrics_text(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _generate(d, request_id: str, prompt: list[int]) -> list[int]:
    tokens, last = drain(d.stub.Generate(pb.GenerateRequest(request_id=request_id, token_ids=prompt,
                                                            sampling=greedy(8)), timeout=120))
    assert last.finish_reason and len(tokens) == 8
    return tokens


def _read_back_tokens(d, request_id: str) -> int:
    events = d.stub.GetTrace(pb.GetTraceRequest(request_ids=[request_id]), timeout=10).events
    return sum(json.loads(e.args_json)["tokens"] for e in events if e.name == "kv_read_back")


def _wait_written(d, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while _sample(d, 'duet_kv_tier_blocks{tier="disk"}') < blocks:
        assert time.monotonic() < deadline, "the tier never took the prompt's pages"
        time.sleep(0.05)


def test_evicted_and_restarted_conversations_come_back_from_disk(tmp_path):
    tier_dir = tmp_path / "tier"
    with Started(tmp_path) as s:
        tiered = s.spawn("decode_node", *TIERED, "--kv-offload-dir", str(tier_dir))
        plain = s.spawn("decode_node", *FLAGS)
        s.wait()
        turn1 = random_ids(200, seed=1)
        out1 = _generate(tiered, "t1", turn1)
        assert out1 == _generate(plain, "p1", turn1)
        _wait_written(tiered, 12)
        for i in range(3):  # other conversations push the first out of the pool
            _generate(tiered, f"fill{i}", random_ids(200, seed=10 + i))

        turn2 = turn1 + out1 + random_ids(40, seed=2)
        out2 = _generate(tiered, "t2", turn2)
        assert out2 == _generate(plain, "p2", turn2)
        assert _read_back_tokens(tiered, "t2") >= 192  # the first turn's 12 full pages, at least
        assert _sample(tiered, 'duet_prompt_tokens_total{source="disk"}') >= 192
        wait_clean(tiered)

        tiered.stop()  # a restart on the same directory
        again = s.spawn("decode_node", *TIERED, "--kv-offload-dir", str(tier_dir))
        s.wait()
        watch = again.stub.WatchKvEvents(pb.WatchKvEventsRequest(), timeout=30)
        pool_snapshot, disk_snapshot = next(watch), next(watch)
        watch.cancel()
        assert pool_snapshot.snapshot and not pool_snapshot.medium and not pool_snapshot.stored_blocks
        assert disk_snapshot.snapshot and disk_snapshot.medium == "disk" and len(disk_snapshot.stored_blocks) >= 24

        turn3 = turn2 + out2 + random_ids(30, seed=3)
        assert _generate(again, "t3", turn3) == _generate(plain, "p3", turn3)
        assert _read_back_tokens(again, "t3") >= (len(turn2) // 16) * 16
        assert _sample(again, 'duet_kv_tier_pages_total{direction="read",tier="disk"}') >= len(turn2) // 16
        wait_clean(again, plain)
