"""Logprobs, echo + max_tokens 0 (lm-evaluation-harness's loglikelihood request) and structured
outputs through the OpenAI front of a real prefill + decode pair, against transformers."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch

from common.openai_http.logprob_shaping import token_text
from protos.duet.v1 import duet_pb2 as pb
from common.engine.guided import GrammarCompiler, GuidedSpec
from common.engine.json_grammar import MAX_JSON_INDENT
from scripts.json_object_share import MAX_TOKENS, json_object_answers
from harness.local_daemons import free_port
from harness.helpers import started_pair
from harness.reference import JSON_PROMPTS, hf_greedy
from harness.openai_front import DAEMON_FLAGS, MESSAGES, Front

NAMES = ("duet-smol", "smol-alias")
PROMPT = "The lighthouse keeper climbed the spiral stairs every night to light the great lamp, and"
TOLERANCE = 1e-4
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill node and a decode node handing prompts to it, serving HTTP under two names."""
    tmp = tmp_path_factory.mktemp("openai_structured")
    port = free_port()
    with started_pair(tmp, DAEMON_FLAGS, (*DAEMON_FLAGS, "--min-remote-prefill-tokens", "8", "--openai-port",
                                          str(port), *(f"--served-model-name={n}" for n in NAMES))) as (dn, pn):
        yield dn, pn, Front(port)


@torch.inference_mode()
def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """Row i: transformers' log-softmax over the token after `tokens[:i + 1]`."""
    return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def test_greedy_token_logprobs_equal_transformers(pair, hf_model, tokenizer):
    dn, _, front = pair
    prompt = tokenizer.encode(PROMPT)
    r = front.client.completions.create(model=NAMES[1], prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    generated = hf_greedy(hf_model, prompt, 6)
    want = hf_logprobs(hf_model, prompt + generated)[len(prompt) - 1 : -1]
    lp = r.choices[0].logprobs
    assert [m.id for m in front.client.models.list().data] == list(NAMES)
    assert front.client.models.retrieve(NAMES[1]).id == NAMES[1]
    assert r.model == NAMES[0] and lp.tokens == [token_text(tokenizer.token_bytes(t)) for t in generated]
    for got, top, row, token in zip(lp.token_logprobs, lp.top_logprobs, want, generated):
        assert abs(got - float(row[token])) < TOLERANCE
        best = row.topk(3)
        assert {token_text(tokenizer.token_bytes(t)) for t in best.indices.tolist()} <= set(top)
        assert abs(max(top.values()) - float(best.values[0])) < TOLERANCE
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    chat = front.client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=2)
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    generated = hf_greedy(hf_model, chat_prompt, 5)
    want = hf_logprobs(hf_model, chat_prompt + generated)[len(chat_prompt) - 1 : -1]
    content = chat.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [tokenizer.token_bytes(t) for t in generated]
    for entry, row, token in zip(content, want, generated):
        assert abs(entry.logprob - float(row[token])) < TOLERANCE
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tokenizer.token_bytes(t) for t in row.topk(2).indices]

    streamed_chat = front.client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=5,
                                                         temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed_content = [c for e in streamed_chat if e.choices and e.choices[0].logprobs
                        for c in e.choices[0].logprobs.content]
    assert [c.token for c in streamed_content] == [c.token for c in content]

    streamed = front.client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=6, temperature=0,
                                               logprobs=3, stream=True)
    pieces = [e.choices[0].logprobs for e in streamed if e.choices and e.choices[0].logprobs]
    # (the prompt's pages come from the prefix cache now: the same values up to float rounding)
    streamed_logprobs = [t for p in pieces for t in p.token_logprobs]
    assert streamed_logprobs == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=TOLERANCE)
    assert [o for p in pieces for o in p.text_offset] == r.choices[0].logprobs.text_offset


def test_echo_with_max_tokens_0_scores_every_prompt_token(pair, hf_model, tokenizer):
    """lm-evaluation-harness's loglikelihood request: the prompt comes back with each token's
    logprob (the first has none); the decode node computes such a prompt itself."""
    dn, pn, front = pair
    prompt = tokenizer.encode(PROMPT + " then")
    want = hf_logprobs(hf_model, prompt)
    computed_before = pn.metrics()["duet_prefill_computed_tokens_total"]
    for sent in (prompt, PROMPT + " then"):
        r = front.client.completions.create(model=NAMES[0], prompt=sent, max_tokens=0, echo=True, logprobs=1,
                                            temperature=0)
        choice = r.choices[0]
        assert choice.text == PROMPT + " then" and choice.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
        lp = choice.logprobs
        assert lp.tokens == [token_text(tokenizer.token_bytes(t)) for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for position in range(1, len(prompt)):
            row = want[position - 1]
            assert abs(lp.token_logprobs[position] - float(row[prompt[position]])) < TOLERANCE
            assert abs(max(lp.top_logprobs[position].values()) - float(row.max())) < TOLERANCE
    assert pn.metrics()["duet_prefill_computed_tokens_total"] == computed_before
    # With a generated token after the prompt (what the harness sends): one more entry.
    r = front.client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)
    assert len(r.choices[0].logprobs.token_logprobs) == len(prompt) + 1
    assert r.choices[0].text.startswith(PROMPT + " then")
    # Streamed, the prompt comes first, then the completion's tokens with offsets that continue it.
    events = [e.choices[0] for e in front.client.completions.create(
        model=NAMES[0], prompt=prompt, max_tokens=2, echo=True, logprobs=0, temperature=0, stream=True)]
    assert events[0].text == PROMPT + " then" and events[0].logprobs.token_logprobs[0] is None
    offsets = [o for e in events if e.logprobs for o in e.logprobs.text_offset]
    assert len(offsets) == len(prompt) + 2 and offsets[len(prompt)] == len(PROMPT + " then")
    # echo without logprobs, and max_tokens 0 without echo
    plain = front.client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=2, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT + " then") and plain.choices[0].logprobs is None
    empty = front.client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=0)
    assert empty.choices[0].text == "" and empty.usage.completion_tokens == 0


def test_start_generation_refuses_prompt_logprobs(pair):
    dn, _, _ = pair
    with pytest.raises(grpc.RpcError) as refused:
        list(dn.stub.StartGeneration(pb.StartGenerationRequest(
            request_id="scored", kv_window_begin=1, sampling=pb.SamplingParams(prompt_logprobs=0))))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Generate" in refused.value.details()


def test_json_schema_outputs_parse_and_validate(pair):
    """20 seeded samples (5 requests of n=4, running side by side) all follow the schema."""
    _, _, front = pair
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int):
        return front.client.chat.completions.create(
            model=NAMES[0], messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=response_format, temperature=1.0, seed=seed, n=4, max_tokens=80)

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(ask, range(5)))
    outputs = [c.message.content for a in answers for c in a.choices]
    assert len(outputs) == 20
    for answer in answers:
        assert {c.finish_reason for c in answer.choices} == {"stop"}
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(outputs)) > 1  # sampled, not one forced answer

    ask = "Give the name and age of a person as a JSON object."
    json_object = {"type": "json_object"}
    r = front.client.completions.create(model=NAMES[0], prompt=ask, max_tokens=100, temperature=0,
                                        extra_body={"response_format": json_object})
    chat = front.client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": ask}],
                                                max_tokens=100, temperature=0, response_format=json_object)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    # In chat the model writes a longer, indented object (street, city, ...): JSON up to max_tokens.
    text = chat.choices[0].message.content
    assert text.startswith("{\n") and (chat.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_json_object_has_whitespace_and_ends(pair):
    """JSON's whitespace, bounded, keeps the embedded model on what it learned: "Give a person as
    JSON." answers pretty-printed keys and values instead of one key nested until max_tokens
    (`{"name":{"description":{"description":...`). Over the reference prompts and requests for
    JSON, every answer that ends by stop parses (scripts/json_object_share.py reports the share)."""
    _, _, front = pair
    person = front.client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": JSON_PROMPTS[0]}], temperature=0, max_tokens=60,
        response_format={"type": "json_object"}).choices[0].message.content
    keys = re.findall(r'"(\w+)":', person)
    assert person.startswith("{\n") and len(keys) >= 4 and len(set(keys)) == len(keys), person
    answers = json_object_answers(front.client, NAMES[0], max_tokens=MAX_TOKENS)
    stopped = [a for a in answers if a.finish_reason == "stop"]
    assert stopped and all(a.parses for a in stopped), answers


@pytest.mark.parametrize("text, allowed", [
    ('{"a":1}', True), ('{\n  "a": [1,\n    2]\n}', True), ("{\r\n\t\"a\" :\t1 }", True),
    ('{\n\n"a": 1}', False), ("{" + " " * (MAX_JSON_INDENT + 1) + '"a": 1}', False), (' {"a": 1}', False)])
def test_json_whitespace_is_bounded(tokenizer, text, allowed):
    """Wherever JSON allows whitespace: one line break at most, then MAX_JSON_INDENT blanks at most."""
    grammar = GrammarCompiler(tokenizer, tokenizer.vocab_size).compile(GuidedSpec("json_object", True))
    matcher = grammar.matcher()
    try:
        for token in [*tokenizer.encode(text), tokenizer.eos_token_id]:
            matcher.accept(token)
    except RuntimeError:
        assert not allowed
    else:
        assert allowed


def test_grpc_guided_regex_and_choice(pair):
    dn, _, _ = pair
    regex = r"[0-9]{3}-[a-z]{2}"
    for seed in range(3):
        sampling = pb.SamplingParams(max_tokens=20, temperature=1.0, seed=seed, guided=pb.GuidedDecoding(regex=regex))
        chunks = list(dn.stub.Generate(pb.GenerateRequest(prompt="A code:", sampling=sampling), timeout=120))
        assert re.fullmatch(regex, "".join(c.text for c in chunks)) and chunks[-1].finish_reason == "stop"
    choices = ["yes", "no", "maybe later"]
    sampling = pb.SamplingParams(max_tokens=20, temperature=1.0, seed=0, n=3, logprobs=True, top_logprobs=20,
                                 guided=pb.GuidedDecoding(choice=pb.GuidedDecoding.Choices(choices=choices)))
    chunks = list(dn.stub.Generate(pb.GenerateRequest(prompt="Will it rain?", sampling=sampling), timeout=120))
    texts = {i: "".join(c.text for c in chunks if c.index == i) for i in range(3)}
    assert set(texts.values()) <= set(choices)
    first = [c.logprobs[0] for c in chunks if c.index == 0][0]  # only tokens the grammar allows are possible
    assert 0 < len(first.top) < 20 and all(t.logprob > float("-inf") for t in first.top)
    with pytest.raises(grpc.RpcError) as refused:
        list(dn.stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
            guided=pb.GuidedDecoding(regex="((")))))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided.regex" in refused.value.details()
