"""A decode node run with --speculative ngram, as real daemons: after a disaggregated hand-off,
through the router and through the OpenAI front, its greedy output is the non-speculative one."""
from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from harness.local_daemons import free_port, router
from harness.helpers import started_pair, wait_for
from harness.reference import FP32, engine_greedy

FLAGS = (*FP32, "--transport", "tcp", "--threads", "1", "--kv-pages", "160")
CODE = "".join(f"def f{i}(x, y):\n    return x * {i} + y\n\n" for i in range(4))
MAX_TOKENS = 40


def test_speculative_decode_node_equals_non_speculative_across_hand_off_router_and_http(
        tmp_path, model, tokenizer):
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Repeat this exactly:\n" + CODE}]))
    want = engine_greedy(model, prompt, MAX_TOKENS)
    port = free_port()
    with started_pair(tmp_path, FLAGS, (*FLAGS, "--min-remote-prefill-tokens", "8", "--speculative", "ngram",
                                        "--num-speculative-tokens", "4", "--ngram-max", "3",
                                        "--openai-port", str(port))) as (dn, pn):
        members = tmp_path / "members.json"
        members.write_text(json.dumps({"decode": [dn.address], "prefill": [pn.address]}))
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        chunks = list(dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=sampling), timeout=300))
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert pn.metrics()["duet_prefill_computed_tokens_total"] > 0  # the prompt was handed off
        m = dn.metrics()
        assert 0 < m["duet_spec_accepted_tokens_total"] <= m["duet_spec_draft_tokens_total"]
        assert m["duet_spec_acceptance_length_count"] < MAX_TOKENS  # fewer verify steps than tokens

        with router(tmp_path, "--members", str(members), "--poll-seconds", "0.2",
                    "--min-remote-prefill-tokens", "8") as rt:
            wait_for(lambda: rt.metrics().get("duet_router_healthy_prefill_nodes") == 1)
            routed = rt.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=sampling), timeout=300)
            assert [t for c in routed for t in c.token_ids] == want

        body = {"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "num_speculative_tokens": 2}
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10))
        body["model"] = models["data"][0]["id"]
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        answer = json.load(urllib.request.urlopen(request, timeout=300))
        assert answer["choices"][0]["text"] == tokenizer.decode(want)
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS

        too_many = pb.SamplingParams(max_tokens=4, num_speculative_tokens=5)
        with pytest.raises(grpc.RpcError) as refused:
            list(dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=too_many), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "maximum of 4" in refused.value.details()
