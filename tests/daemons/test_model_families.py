"""Every supported family against transformers, on tiny random checkpoints that transformers
builds and saves in the test (nothing downloaded): logits and greedy tokens in float32 on one
node and across the hand-off between daemons, bfloat16 agreement as tests/daemons/test_bf16.py states it.

Llama (with llama3 rope scaling), Mistral and Qwen2 have their own tests in
tests/unit/test_model_vs_transformers.py and tests/daemons/test_sliding_window.py; the families'
GGUF files theirs in tests/unit/test_gguf_families.py.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from common.model.mlp import GatedMlp
from protos.duet.v1 import duet_pb2 as pb
from harness.helpers import Started, greedy, no_leak, random_ids, started_pair
from harness.reference import FP32, engine_greedy, hf_greedy
from harness.engine_checks import bf16_ulp, full_logits, teacher_forced
from harness.tiny_families import COMMON as _COMMON
from harness.tiny_families import FULL, PROMPT, SLIDING, VOCAB, WINDOW, assert_as_transformers
from harness.tiny_families import configs as _configs
from harness.tiny_families import save_tiny as _save
from harness.tiny_families import tiny_prompt as _prompt

transformers = pytest.importorskip("transformers")

FAMILIES = list(_configs())
HYBRID = {"gemma2", "gemma3_text", "gpt_oss"}  # sliding and full layers mixed
MOE = {"mixtral", "qwen3_moe", "gpt_oss"}
# Tokens a migrated request streams: a tiny model makes a token in about a millisecond, so a short
# stream can end before Migrate arrives when the host is busy (seen beside another test process).
STREAMED = 160


_BUILT: dict[str, tuple] = {}


def _built(name: str, tmp_path_factory) -> tuple:
    """(family name, checkpoint directory, the transformers model), built once per session."""
    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        _BUILT[name] = name, path, _save(name, path)
    return _BUILT[name]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(HYBRID))
def hybrid(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(MOE))
def moe(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


def test_logits_and_greedy_tokens_match_transformers(family):
    name, path, hf = family
    model = DecoderModel(load_checkpoint(path))
    assert model.config.architecture == name
    assert (model.config.layer_windows is not None) == (name in HYBRID)
    assert (model.config.moe is not None) == (name in MOE)
    assert_as_transformers(model, hf)


def test_hybrid_layers_keep_their_own_windows(hybrid):
    """Gemma 2/3 and gpt-oss mix sliding and full layers: each layer attends its own span, and
    the windows change the output (so the test above checks them)."""
    _, path, hf = hybrid
    ckpt = load_checkpoint(path)
    assert ckpt.config.layer_windows == tuple(WINDOW if kind == SLIDING else None for kind in hf.config.layer_types)
    assert ckpt.config.sliding_window is None  # the full layers read every page
    ids = _prompt(4, 60)
    unwindowed = DecoderModel(replace(ckpt, config=replace(ckpt.config, layer_windows=None)))
    assert (full_logits(DecoderModel(ckpt), ids) - full_logits(unwindowed, ids)).abs().max().item() > 1e-2


def test_experts_run_only_on_their_rows(moe, monkeypatch):
    """A mixture runs k experts per token, not every expert, and only on its sparse layers."""
    _, path, _ = moe
    model = DecoderModel(load_checkpoint(path))
    experts = model.config.moe
    rows: list[int] = []
    call = GatedMlp.__call__
    monkeypatch.setattr(GatedMlp, "__call__", lambda self, h: rows.append(h.shape[0]) or call(self, h))
    full_logits(model, _prompt(5, 30))
    sparse = model.config.num_layers - len(experts.dense_layers)
    assert sum(rows) == 30 * (experts.top_k * sparse + len(experts.dense_layers))
    assert len(rows) <= sparse * experts.num_experts + len(experts.dense_layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_rows_do_not_depend_on_their_batch(moe, dtype):
    """As a dense layer's rows (tests/unit/test_continuation.py): a prompt's last token, computed inside
    a chunk on one node and alone after a hand-off, must come out alike."""
    _, path, _ = moe
    model = DecoderModel(load_checkpoint(path), dtype=dtype)
    experts = model.layers[0]["mlp"]
    rows = torch.randn(17, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    alone = torch.cat([experts(rows[i : i + 1]) for i in range(17)])
    for batch in (2, 5, 17):
        assert torch.equal(experts(rows[:batch]), alone[:batch]), batch


def test_bf16_agrees_with_transformers_bf16(family):
    """Teacher-forced on transformers' bf16 greedy continuation, as tests/daemons/test_bf16.py states it:
    our next token is transformers' bf16 one at >= 98% of positions (a position counts as agreeing
    where the two tokens lie within one bf16 step of transformers' top logit, or where ours is
    the float32 model's own token), and where ours is not float32's token, float32's logits nearly
    tie the two: closer than bf16's own error. 98%, not test_bf16's 99%: a random model's logits
    are flat, so near-ties come several times as often as in a trained one (qwen3: 3 of 336
    positions, each tied in float32 closer than bf16's error), and in a mixture of experts a
    near-tie in the router sends a row to another expert."""
    name, path, hf32 = family
    model = DecoderModel(load_checkpoint(path), dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                           attn_implementation="eager").eval()
    agree = total = 0
    for seed in range(6, 14):
        ids = _prompt(seed)
        continuation = hf_greedy(hf, ids, 24)
        forced = torch.tensor([ids + continuation[:-1]])
        with torch.inference_mode():
            ref = hf(forced).logits[0, len(ids) - 1 :].float()
            exact = hf32(forced).logits[0, len(ids) - 1 :].float()
        mine = teacher_forced(model, ids, continuation).argmax(-1)
        top, truth = ref.max(-1).values, exact.argmax(-1)
        agree += int(((top - ref.gather(1, mine[:, None])[:, 0] <= bf16_ulp(top)) | (mine == truth)).sum())
        total += len(continuation)
        fp32_gap = exact.max(-1).values - exact.gather(1, mine[:, None])[:, 0]
        assert fp32_gap.max().item() <= (ref - exact).abs().max().item(), name
    print(f"{name}: bf16 agreement {agree}/{total}")
    assert agree / total >= 0.98, f"{name}: {agree}/{total}"


# Each family across the hand-off, the transports taking turns (hybrid and expert families on both).
_HAND_OFFS = [(name, transport) for i, name in enumerate(FAMILIES) for transport in ("nixl", "tcp")
              if name in HYBRID | MOE or transport == ("nixl", "tcp")[i % 2]]


# A hybrid model's sliding groups (--kv-sliding-pages) on (prefill node, decode node): 6 pages
# hold a window of 8 and a chunk of 8 at page size 4, against 40-token prompts. Mixed both ways,
# small on both, the default (as many as --kv-pages) and none.
_SLIDING_GROUPS = {("gemma2", "nixl"): ("0", "6"), ("gemma2", "tcp"): ("6", "0"), ("gemma3_text", "nixl"): ("6", "6"),
                   ("gemma3_text", "tcp"): ("6", "6"), ("gpt_oss", "nixl"): (None, None), ("gpt_oss", "tcp"): ("0", "0")}


def _sliding_flags(pages: str | None) -> tuple[str, ...]:
    return () if pages is None else ("--kv-sliding-pages", pages, "--max-batch-tokens", "8")


@pytest.mark.parametrize(("name", "transport"), _HAND_OFFS)
def test_hand_off_matches_transformers(name, transport, tmp_path):
    """Generate prefilled by the prefill node; for a hybrid model also the three calls by hand: the
    sliding layers get only their window (RemoteSend's bytes_sent, the decode node's byte count),
    into the decode node's sliding group where it has one (the two-group metadata), and the decode
    node serves those partial pages only to prompts whose window stays clear of them. A model
    without sliding layers refuses the two-group form."""
    hf = _save(name, tmp_path / "model")
    common = (*FP32, "--model", str(tmp_path / "model"), "--transport", transport, "--threads", "1",
              "--page-size", "4")
    prefill_group, decode_group = _SLIDING_GROUPS.get((name, transport), (None, None))
    with started_pair(tmp_path, (*common, *_sliding_flags(prefill_group)),
                      (*common, *_sliding_flags(decode_group), "--min-remote-prefill-tokens", "1")) as (dn, pn):
        for seed in (9, 10):
            prompt = _prompt(seed)
            assert _generate(dn, f"{name}-{seed}", prompt) == hf_greedy(hf, prompt, 12)
        assert pn.metrics()["duet_prefill_computed_tokens_total"] == 2 * (PROMPT - 1)  # prefilled remotely
        if name in HYBRID:
            _check_windowed_hand_off(dn, pn, hf, two_groups=decode_group != "0")
        else:
            _check_two_groups_refused(dn, pn)
        for node, group in ((pn, prefill_group), (dn, decode_group)):
            assert no_leak(node)
            assert (node.metrics()["duet_kv_sliding_pages_total"] > 0) == (name in HYBRID and group != "0")


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_bf16_hand_off_equals_one_node_where_the_prefill_kernel_takes_every_layer(name, tmp_path):
    """bf16, head_dim 64, full attention: the prefill node chunking the prompt 24 tokens at a time,
    the decode node alone computing it in one chunk, give the same tokens (docs/models.md)."""
    _save(name, tmp_path / "model", hidden_size=256, head_dim=64)
    flags = ("--dtype", "bfloat16", "--model", str(tmp_path / "model"), "--transport", "tcp", "--threads", "1",
             "--page-size", "4")
    prompts = [_prompt(seed, 70) for seed in range(30, 36)]
    with Started(tmp_path) as s:
        alone = s.spawn("decode_node", *flags)
        s.wait()
        reference = [_generate(alone, f"alone-{i}", p, 16) for i, p in enumerate(prompts)]
    with started_pair(tmp_path, (*flags, "--max-batch-tokens", "24"),
                      (*flags, "--min-remote-prefill-tokens", "1")) as (dn, pn):
        assert [_generate(dn, f"handed-{i}", p, 16) for i, p in enumerate(prompts)] == reference
        assert pn.metrics()["duet_prefill_computed_tokens_total"] == len(prompts) * 69


def _generate(dn, request_id: str, prompt: list[int], n: int = 12) -> list[int]:
    stream = dn.stub.Generate(pb.GenerateRequest(request_id=request_id, token_ids=prompt, sampling=greedy(n)))
    return [t for chunk in stream for t in chunk.token_ids]


def _check_two_groups_refused(dn, pn) -> None:
    """Two-group metadata names a sliding group this model has not: FAILED_PRECONDITION, and the
    prefill node serves on."""
    prompt = _prompt(11)
    with pytest.raises(grpc.RpcError) as refused:
        pn.stub.RemoteSend(pb.RemoteSendRequest(
            request_id="two-groups", token_ids=prompt, kv_window_begin=0, kv_window_end=PROMPT - 1,
            kv_append_metadata=[-2, 1, 0, PROMPT - 1, 1, 0, WINDOW - 1], decode_address=dn.address, transfer_nonce=1))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "two-group form" in refused.value.details()
    assert _generate(dn, "after-refusal", prompt) == _generate(dn, "after-refusal-again", prompt)


def _check_windowed_hand_off(dn, pn, hf, two_groups: bool) -> None:
    prompt = _prompt(11)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="windowed", token_ids=prompt))
    assert (r.kv_window_begin, r.kv_window_end) == (0, PROMPT - 1)  # the full layers need every position
    assert (r.kv_append_metadata[0] == -2) == two_groups
    received = dn.metrics()["duet_kv_transfer_bytes_total"]
    sent = pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id="windowed", token_ids=prompt, kv_window_begin=0, kv_window_end=PROMPT - 1,
        kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce))
    cfg = hf.config
    slot_bytes = 4 * cfg.num_key_value_heads * cfg.head_dim  # float32
    # Full layers move the prompt's KV; a sliding layer the positions the query at PROMPT - 1 attends.
    positions = sum(PROMPT - 1 if kind == FULL else WINDOW - 1 for kind in cfg.layer_types)
    assert sent.bytes_sent == 2 * positions * slot_bytes < 2 * (PROMPT - 1) * cfg.num_hidden_layers * slot_bytes
    assert dn.metrics()["duet_kv_transfer_bytes_total"] - received == sent.bytes_sent
    stream = dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="windowed", kv_window_begin=PROMPT - 1, sampling=greedy(12)))
    generated = [t for chunk in stream for t in chunk.token_ids]
    assert generated == hf_greedy(hf, prompt, 12)
    # The decode node cached those pages as partial. A later turn continues from all of them (its
    # window reaches only whole pages); a shorter prompt sharing most of the prompt would read the
    # sliding layers' missing positions, so its match is cut back to nothing.
    for request_id, later, reused in (("next-turn", prompt + generated + _prompt(12, 6), PROMPT + 11),
                                      ("shorter", prompt[:30], 0)):
        hits = dn.metrics()["duet_prefix_cache_hit_tokens_total"]
        assert _generate(dn, request_id, later, 8) == hf_greedy(hf, later, 8), request_id
        assert dn.metrics()["duet_prefix_cache_hit_tokens_total"] - hits == reused, request_id


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[..., n]` rounded to MXFP4 as gpt-oss ships it: (blocks `[..., n/32, 16]`,
    scales `[..., n/32]`), each group of 32 scaled by a power of two so its largest value fits 6."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    nibble = (scaled.abs()[..., None] - values).abs().argmin(-1) + 8 * (scaled < 0)
    return (nibble[..., 0::2] | nibble[..., 1::2] << 4).to(torch.uint8), (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """The published gpt-oss checkpoints pack their experts in MXFP4 (`*_blocks`, `*_scales`,
    `[experts, out, in]`): read, they give transformers' own dequantization, bit for bit, and
    the model then matches transformers holding those weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _save("gpt_oss", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(tensors.pop(name).transpose(1, 2))  # packed as [experts, out, in]
        tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        hf.get_parameter(name).data.copy_(dequantized)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(tmp_path)
    layer0 = hf.model.layers[0].mlp.experts
    assert torch.equal(ckpt.tensors["model.layers.0.mlp.experts.1.down_proj.weight"], layer0.down_proj[1].T)
    assert torch.equal(ckpt.tensors["model.layers.0.mlp.experts.1.up_proj.weight"], layer0.gate_up_proj[1, :, 1::2].T)
    model = DecoderModel(ckpt)
    prompt = _prompt(13)
    assert engine_greedy(model, prompt, 12, page_size=4) == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize(("name", "transport", "groups", "admission"), [("gpt_oss", "tcp", (None, "0"), "reject"),
                                                                          ("gemma3_text", "nixl", ("6", "6"), "queue")])
def test_hybrid_request_migrates_mid_stream(name, transport, groups, admission, tmp_path):
    """Live migration of a hybrid model's request moves each sliding layer its window only (from a
    sliding group to none, between small ones: `groups`, the source's and the target's
    --kv-sliding-pages), and the stream goes on as transformers' greedy continuation; the partial
    KV the target received serves no later request whose window reaches it (the same prompt again
    is still exact). Admitted by a queue, a prompt longer than a small group holds is prefilled
    chunk by chunk (its pages reserved up front, their sliding pages a chunk at a time)."""
    hf = _save(name, tmp_path / "model")
    flags = (*FP32, "--model", str(tmp_path / "model"), "--transport", transport, "--threads", "1",
             "--page-size", "4", "--admission", admission)
    prompt = _prompt(16)
    with Started(tmp_path) as s:
        a, b = (s.spawn("decode_node", *flags, *_sliding_flags(group)) for group in groups)
        s.wait()
        tokens, moved = [], None
        for i, chunk in enumerate(a.stub.Generate(pb.GenerateRequest(request_id="moving", token_ids=prompt,
                                                                     sampling=greedy(STREAMED)))):
            tokens += chunk.token_ids
            if i == 3:
                moved = a.stub.Migrate(pb.MigrateRequest(request_id="moving", target_address=b.address))
        assert moved is not None and moved.tokens_moved > 0
        assert tokens == hf_greedy(hf, prompt, STREAMED)
        context = moved.tokens_moved  # the positions before the target's first step
        cfg = hf.config
        full_bytes = 2 * context * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * cfg.head_dim
        assert 0 < b.metrics()["duet_kv_transfer_bytes_total"] < full_bytes
        assert _generate(b, "again", prompt) == hf_greedy(hf, prompt, 12)
        assert b.metrics()["duet_prefix_cache_hit_tokens_total"] == 0
        assert no_leak(a) and no_leak(b)


def test_partial_rotary_factor_matches_transformers(tmp_path):
    """Phi-3 with `partial_rotary_factor` 0.5 (as Phi-4-mini has 0.75): rope turns the first half
    of each head only, which changes the output, and matches transformers."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf = _save("phi3", tmp_path, rope_parameters=rope)
    ckpt = load_checkpoint(tmp_path)
    model = DecoderModel(ckpt)
    assert model.config.rotary_dim == 8
    ids = _prompt(17, 60)
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(model, ids) - reference).abs().max().item() <= 1e-4
    whole = DecoderModel(replace(ckpt, config=replace(ckpt.config, partial_rotary_factor=1.0)))
    assert (full_logits(whole, ids) - reference).abs().max().item() > 1e-2
    assert engine_greedy(model, ids[:20], 12, page_size=4) == hf_greedy(hf, ids[:20], 12)


LONG_ROPE_FROM = 24  # the longrope model's original context: a 20-token prompt crosses it while decoding


def _save_longrope(path: Path, original: int = LONG_ROPE_FROM):
    """Phi-3 with longrope, as Phi-3.5-mini and the Phi-3 128k models ship, its original context
    `original` tokens: short and long factors far apart, so computing with the wrong set shows."""
    half = _COMMON["hidden_size"] // _COMMON["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.7 * i for i in range(half)]}
    return _save("phi3", path, rope_parameters=rope, original_max_position_embeddings=original)


def _hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate`: Phi-3's drops its cache and computes the sequence again
    with the long factors when it outgrows the original context (a plain cache loop does not)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_longrope_matches_transformers_on_both_sides_of_the_original_context(tmp_path):
    """Up to the original context every position computes with the short factors, past it with
    the long ones; a sequence that crosses it while decoding is computed again, as transformers'
    Phi-3 does, and the tokens show that this matters."""
    hf = _save_longrope(tmp_path)
    model = DecoderModel(load_checkpoint(tmp_path))
    short, long = _prompt(20, 20), _prompt(21, 30)
    for prompt, past_it in ((short, False), (long, True)):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0]
        assert (full_logits(model, prompt, long_rope=past_it) - reference).abs().max().item() <= 1e-4
        assert (full_logits(model, prompt, long_rope=not past_it) - reference).abs().max().item() > 1e-2
        assert engine_greedy(model, prompt, 12, page_size=4) == _hf_generate(hf, prompt, 12)
    assert hf_greedy(hf, short, 12) != _hf_generate(hf, short, 12)  # the cache kept short would part


def test_longrope_config_as_phi_3_5_ships_it(tmp_path):
    """Phi-3.5's config.json (transformers 4.x): `rope_scaling` {"type": "longrope", factors}
    with `original_max_position_embeddings` beside it; loads as transformers 5 reads it."""
    _save_longrope(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "longrope", "short_factor": rope["short_factor"],
                                                               "long_factor": rope["long_factor"]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = DecoderModel(load_checkpoint(tmp_path))
    assert model.config.long_rope_from == LONG_ROPE_FROM
    prompt = _prompt(22, 30)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    assert (full_logits(model, prompt, long_rope=True) - reference).abs().max().item() <= 1e-4


def test_longrope_across_the_hand_off_and_the_prefix_cache(tmp_path):
    """Both nodes pick the factors from the whole prompt's length; long-factor K/V is cached
    apart from short-factor K/V: the long prompt again reuses its long pages, its head (short
    factors) must not, and reuses its own once computed."""
    hf = _save_longrope(tmp_path / "model")
    common = (*FP32, "--model", str(tmp_path / "model"), "--transport", "tcp", "--threads", "1", "--page-size", "4")
    long = _prompt(21, 30)
    short = long[:20]
    with started_pair(tmp_path, common, (*common, "--min-remote-prefill-tokens", "1")) as (dn, pn):
        computed = []  # by the prefill node, of each request
        for request_id, prompt in (("long", long), ("long-again", long), ("short", short), ("short-again", short)):
            before = pn.metrics()["duet_prefill_computed_tokens_total"]
            assert _generate(dn, request_id, prompt) == _hf_generate(hf, prompt, 12), request_id
            computed.append(pn.metrics()["duet_prefill_computed_tokens_total"] - before)
        assert computed[0] == len(long) - 1 and computed[2] == len(short) - 1
        assert computed[1] < len(long) - 1 - 8 and computed[3] < len(short) - 1 - 8  # each from its own pages
        assert no_leak(dn) and no_leak(pn)


@pytest.mark.parametrize(("original", "prompt_len", "max_tokens", "migrate_at"),
                         [(LONG_ROPE_FROM, 22, STREAMED, 5), (48, 8, STREAMED, 0)])  # outgrown on the source; on the target
def test_longrope_request_migrates_mid_stream(original, prompt_len, max_tokens, migrate_at, tmp_path):
    """A migrated longrope request goes on as transformers' `generate`, whichever node it
    outgrows the original context on: the target takes the factors from the sequence's length,
    as the source held them."""
    hf = _save_longrope(tmp_path / "model", original)
    flags = (*FP32, "--model", str(tmp_path / "model"), "--transport", "tcp", "--threads", "1", "--page-size", "4")
    prompt = _prompt(23, prompt_len)
    with Started(tmp_path) as s:
        a, b = s.spawn("decode_node", *flags), s.spawn("decode_node", *flags)
        s.wait()
        tokens, moved = [], None
        for i, chunk in enumerate(a.stub.Generate(pb.GenerateRequest(request_id="moving", token_ids=prompt,
                                                                     sampling=greedy(max_tokens)))):
            tokens += chunk.token_ids
            if i == migrate_at:
                moved = a.stub.Migrate(pb.MigrateRequest(request_id="moving", target_address=b.address))
        assert moved is not None and moved.tokens_moved > 0
        assert (moved.tokens_moved > original) == (migrate_at > 0)  # the positions moved
        assert tokens == _hf_generate(hf, prompt, max_tokens)
        assert no_leak(a) and no_leak(b)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as `gemma3` (a vision tower beside the text model): the text model
    loads, its config defaults filled as transformers fills them, and matches transformers'
    multimodal model on text."""
    text = transformers.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW,
                                         layer_types=[SLIDING, FULL, SLIDING])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=VOCAB - 3,
                                       boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 1)
    torch.manual_seed(1)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rms_norm_eps", "query_pre_attn_scalar", "rope_parameters"):  # at their defaults: left out,
        del raw["text_config"][key]  # as Google's own configs leave them
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = DecoderModel(load_checkpoint(tmp_path))
    assert model.config.architecture == "gemma3_text" and model.config.attention_scale == 256**-0.5
    prompt = random_ids(PROMPT, 15, low=3, high=VOCAB - 3)
    assert engine_greedy(model, prompt, 12, page_size=4) == hf_greedy(hf, prompt, 12)


def test_refused_model_type_names_the_supported_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'; supported: llama, mistral, qwen2, qwen3, "
                                         "gemma2, gemma3_text, phi3, granite, olmo2, mixtral, qwen3_moe, gpt_oss"):
        load_checkpoint(tmp_path)
