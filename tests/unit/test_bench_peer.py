"""The parts of `make bench-peer` that need no peer: the Hugging Face export every system loads,
the `vllm` version stub wheel, the ratio table, and what aiperf is given and gives back.
(Neither the peer nor aiperf is installed here.)"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.gguf_loader import load_gguf
from common.model.tokenizer import load_tokenizer
from scripts.bench_peer import spec_counts_in
from scripts.export_hf_model import export_hf_model
from scripts.peer_aiperf import AiperfWorkload, summary_of, tokenizer_cache
from scripts.peer_report import format_table, record
from scripts.peer_vllm import VLLM_VERSION, write_version_stub_wheel
from harness.reference import engine_greedy, hf_greedy

TEXT = "Prefill and decode, 1234 tokens: naïve café — 日本語."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, model_path):
    return export_hf_model(tmp_path_factory.mktemp("hf_export"), model_path)


def test_export_holds_the_gguf_weights_and_tokenizer(hf_dir, model_path):
    exported, original = load_checkpoint(hf_dir), load_gguf(model_path)
    assert exported.config == original.config
    assert exported.tensors.keys() <= original.tensors.keys()
    assert all(torch.equal(t, original.tensors[name]) for name, t in exported.tensors.items())
    ours, theirs = load_tokenizer(hf_dir), load_tokenizer(model_path)
    assert ours.encode(TEXT) == theirs.encode(TEXT) and ours.decode(ours.encode(TEXT)) == TEXT
    assert (ours.eos_token_id, ours.bos_token_id, ours.chat_template) == \
        (theirs.eos_token_id, theirs.bos_token_id, theirs.chat_template)


def test_transformers_reads_the_export_and_greedy_matches_duet(hf_dir, model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    prompt = tokenizer(TEXT, add_special_tokens=True)["input_ids"]
    assert prompt == load_tokenizer(hf_dir).encode(TEXT)  # no BOS/EOS added: the same prompt for every server
    assert hf_greedy(hf, prompt, 12) == engine_greedy(model, prompt, 12)


def test_version_stub_wheel_installs_as_a_vllm_distribution(tmp_path):
    wheel = write_version_stub_wheel(tmp_path)
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(target)]))
    assert dist.version == VLLM_VERSION and "+cpu" in dist.version
    assert sorted(p.name for p in target.iterdir()) == [f"vllm-{VLLM_VERSION}.dist-info"]  # metadata only


def test_table_puts_duet_over_vllm_under_each_duet_row():
    def rec(workload, system, ttft, tok_s):
        return {"workload": workload, "system": system, "completed": 4, "failed": 0, "ttft_p50_ms": ttft,
                "ttft_p99_ms": ttft, "itl_p50_ms": None, "itl_p99_ms": 10.0, "tpot_p99_ms": 10.0,
                "output_tokens_per_s": tok_s, "goodput_req_per_s": 0.0}

    table = format_table([rec("w", "vllm", 200.0, 10.0), rec("w", "duet-colocated", 100.0, 30.0)])
    ratios = [line.split() for line in table.splitlines() if line.lstrip().startswith("duet / vLLM")]
    assert [r[3:] for r in ratios] == [["0.50x", "0.50x", "n/a", "1.00x", "1.00x", "3.00x", "n/a"]]


def test_speculating_systems_are_compared_with_vllm_ngram_and_with_themselves_without_speculation():
    def rec(system, tok_s, itl, rate=None):
        return {"workload": "copy-heavy", "system": system, "completed": 4, "failed": 0, "ttft_p50_ms": 1.0,
                "ttft_p99_ms": 1.0, "itl_p50_ms": itl, "itl_p99_ms": itl, "tpot_p99_ms": itl,
                "output_tokens_per_s": tok_s, "goodput_req_per_s": 0.0, "acceptance_rate": rate}

    table = format_table([rec("vllm", 10.0, 40.0), rec("vllm-ngram", 20.0, 20.0, 0.5),
                          rec("duet-colocated", 12.0, 30.0), rec("duet-ngram", 30.0, 10.0, 0.75)]).splitlines()
    ratios = [line.split() for line in table if line.lstrip().startswith("duet / ")]
    assert [(r[2], r[-2]) for r in ratios] == [("vLLM", "1.20x"), ("vllm-ngram", "1.50x")]  # out tok/s
    speculation = [line for line in table if line.startswith("speculation")]
    assert speculation == [
        "speculation, copy-heavy: vllm-ngram / vllm out tok/s = 2.00x, ITL p50 = 0.50x, drafted tokens accepted: 50%",
        "speculation, copy-heavy: duet-ngram / duet-colocated out tok/s = 2.50x, ITL p50 = 0.33x, "
        "drafted tokens accepted: 75%"]


def test_speculative_counters_of_both_engines_are_read_and_summed_over_labels():
    vllm = "\n".join([
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 8.0',
        'vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 85.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 25.0'])
    duet = "\n".join(["# HELP duet_spec_draft_tokens_total x", "duet_spec_draft_tokens_total 40.0",
                      "duet_spec_accepted_tokens_total 31.0"])
    assert spec_counts_in(vllm) == (128.0, 85.0)
    assert spec_counts_in(duet) == (40.0, 31.0)
    assert spec_counts_in("process_cpu_seconds_total 3.0\n") == (0.0, 0.0)


def test_duet_disaggregated_gets_a_ratio_to_each_of_vllms_disaggregations():
    def rec(system, tok_s):
        return {"workload": "short-chat", "system": system, "completed": 4, "failed": 0, "ttft_p50_ms": 1.0,
                "ttft_p99_ms": 1.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0, "tpot_p99_ms": 1.0,
                "output_tokens_per_s": tok_s, "goodput_req_per_s": None}

    table = format_table([rec("vllm", 10.0), rec("vllm-disaggregated", 5.0), rec("vllm-disaggregated-bound", 8.0),
                          rec("duet-disaggregated", 20.0)]).splitlines()
    ratios = [line.split() for line in table if line.lstrip().startswith("duet / ")]
    assert [(r[2], r[-2]) for r in ratios] == [("vLLM", "2.00x"), ("vllm-disaggregated", "4.00x"),
                                               ("vllm-disaggregated-bound", "2.50x")]


def test_aiperf_export_becomes_a_record(tmp_path):
    export = {"request_count": {"avg": 16.0}, "benchmark_duration": {"avg": 8.5}, "total_osl": {"avg": 512.0},
              "total_isl": {"avg": 3680.0}, "output_token_throughput": {"avg": 60.2},
              "time_to_first_token": {"p50": 300.0, "p99": 900.0},
              "inter_token_latency": {"p50": 50.0, "p99": 80.0}, "error_request_count": {"avg": 2.0}}
    r = record("aiperf short-chat", "duet-colocated", summary_of(export), summary_of({}), dtype="bfloat16")
    assert (r["completed"], r["failed"], r["output_tokens_per_s"], r["ttft_p50_ms"], r["itl_p99_ms"]) == \
        (16, 2, 60.2, 300.0, 80.0)
    assert r["same_text_as_vllm"] is None and r["goodput_req_per_s"] is None  # aiperf returns no answers here
    assert summary_of({})["output_tokens_per_s"] is None and summary_of({})["completed"] == 0


def test_tokenizer_is_laid_out_as_a_hugging_face_cache(tmp_path, hf_dir):
    transformers = pytest.importorskip("transformers")
    repo = tokenizer_cache(hf_dir, tmp_path / "hf")
    assert repo == f"duet/{hf_dir.name}"
    cached = transformers.AutoTokenizer.from_pretrained(repo, cache_dir=str(tmp_path / "hf" / "hub"),
                                                        local_files_only=True)
    assert cached(TEXT)["input_ids"] == load_tokenizer(hf_dir).encode(TEXT)
    assert tokenizer_cache(hf_dir, tmp_path / "hf") == repo  # again: the same revision, no error


def test_aiperf_arguments_are_fixed_lengths_and_a_multi_turn_run_names_its_conversations():
    single = AiperfWorkload("short-chat", 200, 32, 4, 16).arguments()
    assert single[single.index("--prompt-input-tokens-mean") + 1] == "200" and "--conversation-num" not in single
    assert single[single.index("--prompt-output-tokens-stddev") + 1] == "0" and "ignore_eos:true" in single
    multi = AiperfWorkload("multi-turn", 300, 32, 4, 32, conversations=8, turns=4).arguments()
    assert multi[multi.index("--conversation-num") + 1] == "8"
    assert multi[multi.index("--conversation-turn-mean") + 1] == "4"
