"""Engine speed against transformers on the default model, side by side in one run.

What is measured (`--dtype`, default what a daemon's `--dtype auto` picks here, both sides in
it; CPU, torch's default thread count, `torch.inference_mode`, untimed warm-up calls first,
`time.perf_counter`, medians):

- prefill, batch 1, prompts of 128 / 512 / 2048 random tokens: tokens per second of one
  forward over the whole prompt.
    ours   = `Engine.forward([(seq, n)])` into a fresh sequence whose pages were reserved
             beforehand (batch building, K/V writes into the paged pool and the last
             token's logits included);
    theirs = `model(ids[1, n], use_cache=True, logits_to_keep=1)`, the prefill `generate()`
             runs (logits of the last position only, like ours).
- decode, batch 1 / 4 / 8 / 32, each sequence holding 128, 1000 or 4000 positions of K/V:
  milliseconds per step of one new token for every sequence. The K/V is zeros, written
  directly (a step's cost does not depend on the values; prefilling 32 x 4000 tokens would take
  minutes); a case whose K/V would take over half the available memory is skipped, and says so.
    ours   = `Engine.forward` with `(seq, 1)` per sequence, pages reserved beforehand;
    theirs = `model(ids[B, 1], cache=..., use_cache=True)` on a DynamicCache holding the
             context (`past_key_values=` before transformers 5).
  Both sides run the same number of steps, so their contexts grow alike.

Against the physical limit, for every decode case: the bytes one step must read (every weight
matrix, the lm_head included, and the K/V of every sequence's context) divided by our step
time, next to this machine's copy bandwidth (`torch` copying a 256 MiB buffer: reads and writes
counted once each, so the number is bytes moved per second). In bfloat16, also our own step
against our float32 step at batch 8 and a 1000-token context (goal: at most 0.6).

Ratios are ours/theirs: for prefill tok/s higher is better, for decode ms/step lower is
better. The sides alternate call by call and a ratio is the median of the per-pair ratios,
so it holds up while other processes load the machine; the absolute numbers do not.
Goals (informational; the exit status is 0 either way): decode at batch 8 at most 0.8x
transformers' step time, prefill at least 1.0x transformers' throughput.

With --quantization MODE, also ours with that `--quantization` (gguf: the embedded GGUF's own
Q4_1 projections and Q8_0 lm_head; int8, int4: quantized at load) against ours on the dequantized
weights, paired the same way: decode steps at QUANTIZATION_CASES and a 512-token prefill.

Set DUET_DISABLE_CPU_KERNELS=1 to measure the torch attention fallback instead of the CPU kernel.

Usage: python -m scripts.bench_engine [--quick] [--decode-only] [--dtype auto|float32|bfloat16] [--quantization gguf|int8|int4] [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from common.engine.core import Engine
from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.serving.dtype_choice import resolve_dtype
from loadgen.text_table import aligned_rows, text_table

PAGE_SIZE = 16
DECODE_CONTEXT = 128  # the context of the decode goal
# (context, batch) of the decode steps; 1000 and 4000 are the long contexts the colocated benchmark serves.
DECODE_CASES = [(c, b) for c in (DECODE_CONTEXT, 1000, 4000) for b in (1, 4, 8, 32)]
QUICK_DECODE_CASES = [(DECODE_CONTEXT, 1), (DECODE_CONTEXT, 8), (1000, 1), (1000, 8)]
PREFILL_GOAL = 1.0  # ours/theirs tok/s, at least
DECODE_GOAL = 0.8  # ours/theirs ms/step at batch 8, at most
DECODE_GOAL_BATCH = 8
DTYPE_CASE = (1000, 8)  # (context, batch) of the bf16 / fp32 step goal
QUANTIZATION_CASES = ((1, DECODE_CONTEXT), (4, DECODE_CONTEXT), (8, DECODE_CONTEXT), (8, 1000))  # (batch, context)
DTYPE_GOAL = 0.6  # bf16 step / fp32 step, at most


@dataclass
class Row:
    kind: str  # "prefill" or "decode"
    size: int  # prompt length (prefill) or batch size (decode)
    ours: float  # tok/s (prefill) or ms/step (decode)
    theirs: float
    ratio: float  # ours/theirs (tok/s for prefill, ms/step for decode): median over paired calls
    goal: str  # e.g. ">= 1.0x", "" when none applies
    verdict: str  # "PASS", "MISS" or ""
    context: int = 0  # decode: K/V positions each sequence holds
    bandwidth: float = 0.0  # decode: GB/s our step reads (weights + K/V), 0 elsewhere


class Timed:
    """A benchmark side: `fn` is timed, `before` (optional) runs untimed ahead of each call."""

    def __init__(self, fn: Callable[[], object], before: Callable[[], object] | None = None) -> None:
        self.fn, self.before, self.times = fn, before, []

    def once(self, record: bool) -> None:
        if self.before is not None:
            self.before()
        start = time.perf_counter()
        self.fn()
        if record:
            self.times.append(time.perf_counter() - start)


def paired_medians(ours: Timed, theirs: Timed, warmup: int, iters: int) -> tuple[float, float, float]:
    """Median seconds of each side and the median of the per-pair ratios ours/theirs. The sides
    alternate call by call, so load from other processes slows both calls of a pair alike and
    the paired ratio stays meaningful even when the absolute times are not."""
    for i in range(warmup + iters):
        ours.once(record=i >= warmup)
        theirs.once(record=i >= warmup)
    ratio = statistics.median(a / b for a, b in zip(ours.times, theirs.times))
    return statistics.median(ours.times), statistics.median(theirs.times), ratio


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def prefill_ours(model: DecoderModel, prompt: list[int]) -> Timed:
    engine = Engine(model, num_pages=-(-len(prompt) // PAGE_SIZE) + 1, page_size=PAGE_SIZE)
    seq = engine.new_sequence("bench", prompt, use_prefix_cache=False)

    def fresh() -> None:
        engine.release(seq, cache=False)
        engine.reserve(seq, len(prompt))

    return Timed(lambda: engine.forward([(seq, len(prompt))]), before=fresh)


def prefill_theirs(hf: torch.nn.Module, prompt: list[int]) -> Timed:
    ids = torch.tensor([prompt])
    return Timed(lambda: hf(ids, use_cache=True, logits_to_keep=1))


def decode_ours(model: DecoderModel, batch: int, context: int, steps: int) -> Timed:
    """One-token steps for every sequence, each holding `context` positions of K/V already (zeros:
    a step's cost does not depend on the values); pages for `steps` more tokens reserved up front."""
    per_seq = -(-(context + steps) // PAGE_SIZE)
    engine = Engine(model, num_pages=batch * per_seq, page_size=PAGE_SIZE)
    prompts = random_prompts(batch, context, model.config.vocab_size, seed=batch)
    seqs = [engine.new_sequence(f"s{i}", prompts[i].tolist(), use_prefix_cache=False) for i in range(batch)]
    for seq in seqs:
        engine.reserve(seq, context + steps)
        seq.num_computed = context
    logits = torch.zeros(batch, model.config.vocab_size)

    def append_next() -> None:
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.token_ids.append(token)

    def step() -> None:
        nonlocal logits
        logits = engine.forward([(seq, 1) for seq in seqs])

    return Timed(step, before=append_next)


def decode_theirs(hf: torch.nn.Module, batch: int, context: int) -> Timed:
    """One-token steps on a DynamicCache holding `context` positions of (zero) K/V per sequence."""
    from transformers import DynamicCache

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        kv = torch.zeros(batch, cfg.num_key_value_heads, context, head_dim, dtype=hf.dtype)
        cache.update(kv, kv.clone(), layer)
    logits = torch.zeros(batch, cfg.vocab_size)
    # transformers 5.x renamed the forward's `past_key_values` argument to `cache`.
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def step() -> None:
        nonlocal logits
        next_ids = logits.argmax(-1, keepdim=True)
        logits = hf(next_ids, use_cache=True, **{cache_arg: cache}).logits[:, -1]

    return Timed(step)


def kv_gib(model: DecoderModel, batch: int, context: int) -> float:
    """GiB of K/V that one side holds for `batch` sequences of `context` positions."""
    cfg = model.config
    return 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize / 2**30


def step_bytes(model: DecoderModel, batch: int, context: int) -> int:
    """Bytes a decode step must read at least: every weight matrix once, and every sequence's K/V."""
    linears = [model.lm_head, *(lin for layer in model.layers
                                for lin in (layer["qkv"], layer["o"], layer["mlp"].gate_up, layer["mlp"].down))]
    weights = sum(lin.weight_bytes for lin in linears)
    return weights + int(kv_gib(model, batch, context) * 2**30)


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB tensor copy (bytes read plus bytes written, per second), best of five."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def available_gib() -> float:
    """MemAvailable of /proc/meminfo (infinite where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) / 2**20
    except (OSError, StopIteration):
        return float("inf")


def load_models(dtype: torch.dtype) -> tuple[DecoderModel, torch.nn.Module]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = default_model_path()
    ours = DecoderModel(load_checkpoint(path), dtype=dtype)
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF de-quantization progress bar
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return ours, hf.eval()


def dtype_row(ours: DecoderModel, warmup: int, iters: int) -> Row:
    """Our bf16 step against our fp32 step, paired like the ours/theirs rows."""
    context, bsz = DTYPE_CASE
    fp32 = DecoderModel(load_checkpoint(default_model_path()))
    t16, t32, ratio = paired_medians(decode_ours(ours, bsz, context, warmup + iters),
                                     decode_ours(fp32, bsz, context, warmup + iters), warmup, iters)
    verdict = "PASS" if ratio <= DTYPE_GOAL else "MISS"
    print(f"  decode  B={bsz:3d} ctx {context:5d}: bf16 {1e3 * t16:8.2f} ms/step, fp32 {1e3 * t32:8.2f} ms/step", flush=True)
    return Row("dtype", bsz, 1e3 * t16, 1e3 * t32, ratio, f"<= {DTYPE_GOAL}x", verdict, context)


def quantization_rows(ours: DecoderModel, dtype: torch.dtype, warmup: int, iters: int, mode: str) -> list[Row]:
    """Ours with `--quantization mode` against ours on the dequantized weights, paired like the
    ours/theirs rows: decode steps at QUANTIZATION_CASES, a prefill."""
    kept = DecoderModel(load_checkpoint(default_model_path(), mode), dtype=dtype)
    rows = []
    for bsz, context in QUANTIZATION_CASES:
        t_kept, t_ours, ratio = paired_medians(decode_ours(kept, bsz, context, warmup + iters),
                                               decode_ours(ours, bsz, context, warmup + iters), warmup, iters)
        gbs = step_bytes(kept, bsz, context) / t_kept / 1e9
        rows.append(Row(f"{mode} decode", bsz, 1e3 * t_kept, 1e3 * t_ours, ratio, "", "", context, gbs))
        print(f"  decode  B={bsz:3d} ctx {context:5d}: {mode} {1e3 * t_kept:8.2f} ms/step, none {1e3 * t_ours:8.2f} ms/step",
              flush=True)
    prompt = random_prompts(1, 512, ours.config.vocab_size)[0].tolist()
    t_kept, t_ours, ratio = paired_medians(prefill_ours(kept, prompt), prefill_ours(ours, prompt), 1, 3)
    rows.append(Row(f"{mode} prefill", 512, 512 / t_kept, 512 / t_ours, 1 / ratio, "", ""))
    print(f"  prefill  512 tok: {mode} {512 / t_kept:8.1f} tok/s, none {512 / t_ours:8.1f} tok/s", flush=True)
    return rows


def run(quick: bool, decode_only: bool = False, dtype: torch.dtype = torch.float32,
        quantization: str | None = None) -> list[Row]:
    prefill_lengths = [] if decode_only else [128, 512] if quick else [128, 512, 2048]
    decode_cases = QUICK_DECODE_CASES if quick else DECODE_CASES
    warmup, iters = (1, 3) if quick else (2, 5)
    decode_warmup, decode_iters = (2, 8) if quick else (3, 15)

    ours, hf = load_models(dtype)
    vocab = ours.config.vocab_size
    print(f"  attention: {'CPU kernel' if ours.attention_kernel else 'torch fallback'}", flush=True)
    rows = []
    with torch.inference_mode():
        for n in prefill_lengths:
            prompt = random_prompts(1, n, vocab)[0].tolist()
            w, it = (1, 3) if n >= 2048 else (warmup, iters)  # long prompts: fewer, slow iterations
            t_ours, t_theirs, time_ratio = paired_medians(prefill_ours(ours, prompt), prefill_theirs(hf, prompt), w, it)
            a, b, ratio = n / t_ours, n / t_theirs, 1 / time_ratio
            verdict = "PASS" if ratio >= PREFILL_GOAL else "MISS"
            rows.append(Row("prefill", n, a, b, ratio, f">= {PREFILL_GOAL}x", verdict))
            print(f"  prefill {n:5d} tok: ours {a:8.1f} tok/s, transformers {b:8.1f} tok/s", flush=True)
        for context, bsz in decode_cases:
            need = 2 * kv_gib(ours, bsz, context)  # both sides hold it
            if need > available_gib() / 2:
                print(f"  decode  B={bsz:3d} ctx {context:5d}: skipped, the K/V of both sides needs {need:.1f} GiB", flush=True)
                continue
            w, it = (1, 4) if bsz * context > 32 * 1000 else (decode_warmup, decode_iters)  # slow steps: fewer
            sides = decode_ours(ours, bsz, context, w + it), decode_theirs(hf, bsz, context)
            t_ours, t_theirs, ratio = paired_medians(*sides, w, it)
            del sides  # free both sides' K/V before the next case
            a, b = 1e3 * t_ours, 1e3 * t_theirs
            goal, verdict = "", ""
            if bsz == DECODE_GOAL_BATCH and context == DECODE_CONTEXT:
                goal, verdict = f"<= {DECODE_GOAL}x", "PASS" if ratio <= DECODE_GOAL else "MISS"
            gbs = step_bytes(ours, bsz, context) / t_ours / 1e9
            rows.append(Row("decode", bsz, a, b, ratio, goal, verdict, context, gbs))
            print(f"  decode  B={bsz:3d} ctx {context:5d}: ours {a:8.2f} ms/step ({gbs:5.1f} GB/s read), "
                  f"transformers {b:8.2f} ms/step", flush=True)
        if dtype == torch.bfloat16:
            rows.append(dtype_row(ours, decode_warmup, decode_iters))
        if quantization:
            rows += quantization_rows(ours, dtype, decode_warmup, decode_iters, quantization)
    return rows


def format_table(rows: list[Row], bandwidth: float) -> str:
    table = []
    for r in rows:
        if r.kind == "prefill":
            label, ours, theirs = f"prefill {r.size} tok, B=1 (tok/s)", f"{r.ours:.1f}", f"{r.theirs:.1f}"
        elif r.kind == "dtype":
            label, ours, theirs = f"bf16 / fp32 B={r.size}, ctx {r.context}", f"{r.ours:.2f}", f"{r.theirs:.2f}"
        elif r.kind.endswith(" decode"):
            mode = r.kind.split()[0]
            label, ours, theirs = f"{mode} / none B={r.size}, ctx {r.context} (ms/step)", f"{r.ours:.2f}", f"{r.theirs:.2f}"
        elif r.kind.endswith(" prefill"):
            mode = r.kind.split()[0]
            label, ours, theirs = f"{mode} / none prefill {r.size} tok (tok/s)", f"{r.ours:.1f}", f"{r.theirs:.1f}"
        else:
            label, ours, theirs = f"decode B={r.size}, ctx {r.context} (ms/step)", f"{r.ours:.2f}", f"{r.theirs:.2f}"
        table.append([label, ours, theirs, f"{r.ratio:.3f}x", r.goal, r.verdict])
    lines = text_table(["measure", "ours", "transformers", "ratio", "goal", "result"], table, "<>>><<")
    lines.append("ratio = ours/transformers (median of paired calls); prefill: higher is better, decode: lower;")
    lines.append("the bf16 / fp32 row is ours in bf16 against ours in fp32 (ms/step)")
    lines.append("<mode> / none rows: ours with --quantization <mode> against ours on the dequantized weights")
    lines.append("(the transformers column holds the latter)")
    lines.append("")
    lines.append(f"decode against the copy bandwidth ({bandwidth:.1f} GB/s here): bytes a step reads / step time")
    decodes = [[r.kind, f"B={r.size}", f"ctx {r.context}", f"{r.bandwidth:.1f} GB/s",
                f"{r.bandwidth / bandwidth:.1%} of the limit"] for r in rows if r.kind.endswith("decode")]
    lines += ["  " + line for line in aligned_rows(decodes, "<<<>>")]
    return "\n".join(lines)


def busy_fraction(seconds: float = 1.0) -> float:
    """How busy the machine's CPUs are over `seconds` (Linux /proc/stat; 0.0 elsewhere)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill measurements")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="both sides' dtype; auto = what a daemon's --dtype auto picks here (default)")
    parser.add_argument("--quantization", choices=["gguf", "int8", "int4"],
                        help="also ours with this --quantization against ours on the dequantized weights")
    args = parser.parse_args()
    dtype = getattr(torch, resolve_dtype("cpu", args.dtype))

    started = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}; measuring...", flush=True)
    busy_before = busy_fraction()
    bandwidth = copy_bandwidth()
    rows = run(args.quick, args.decode_only, dtype, args.quantization)
    load_after = os.getloadavg()[0]  # ours counts for up to one per thread
    print()
    print(format_table(rows, bandwidth))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if busy_before > 0.25 or load_after > torch.get_num_threads() + 1:
        print(f"warning: other processes were busy on this machine (CPUs {busy_before:.0%} busy before the run, "
              f"load average {load_after:.1f} after); absolute numbers are noisy, the paired ratios less so")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
                       "copy_gbs": bandwidth, "decode_context": DECODE_CONTEXT,
                       "busy_before": busy_before, "load_after": load_after,
                       "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
