"""Continuous-batching scheduler: the single-node engine loop the decode node runs.

Every step runs one forward that holds one token for each decoding request and, within the
token budget, prefill chunks of requests still prefilling (oldest first), so a long prompt
never stalls the running decodes for more than one chunk. With `max_step_ms` set, the chunks a
step carries next to decodes are sized from measured step costs to keep the step within it
(common/engine/step_budget.py). Requests join and leave between
steps. When the pool runs out of pages mid-decode, the newest request is preempted: its
pages go to the prefix cache and it is recomputed later (usually from those cached pages).

Parallel sampling (`n > 1`): the request prefills once; when its prompt is computed, samples
1..n-1 fork its KV (`Engine.fork`: full pages shared, the last partial page copied) and each of
the n samples draws its first token from the same logits, then decodes as a sequence of its own
(preempted, recomputed and finished on its own). A sample's tokens are the prompt plus its own
output, so it can always be recomputed. The n samples share one output stream (chunks carry the
sample's index); it ends after the last sample finishes.

Prompt logprobs (`prompt_logprobs`): such a request computes its whole prompt here, never from
the prefix cache (cached positions have no logits), and every position of its prompt chunks
yields logits; they come back in the request's first chunk. `max_tokens` 0 ends the request
once its prompt is computed, without drawing a token.

Speculative decoding (`--speculative ngram`, common/engine/speculative.py): a decoding sequence may
append a draft to its pending token when its pages fit without preempting anyone; the step
computes them all with logits at each, and the verifier emits the agreeing prefix plus one.

Migration (decode_node/migration.py): `detach` takes a decoding request out of the loop at a step
boundary with its pages, for another node to continue; `resume` puts it back when that fails.
`submit_continuation` is the other side: a generation begun elsewhere continues here, each
sample first catching up on its output so far (common/engine/generation.py `Sample.catch_up`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from common.engine.core import Engine, Sequence, locked
from common.engine.generation import Chunk, Continuation, FinishReason, Group, RequestHandle, Sample, Usage
from common.engine.guided import GrammarDeadEnd
from common.engine.loop import EngineLoop
from common.engine.sampling import Draw, PositionLogprobs, PromptLogprobs, Sampler, SamplingParams
from common.engine.speculative import SpeculativeConfig, Speculator
from common.engine.step_budget import StepBudget, attended_positions
from common.errors import ErrorCode, FailedPrecondition, NotFound, Unavailable
from common.kv.page_allocator import OutOfPages
from common.model.detokenizer import IncrementalDetokenizer
from common.model.tokenizer import Tokenizer
from common.tracing import Tracer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Detached:
    """A request taken out of the step loop at a step boundary, its unfinished samples holding
    their pages: what a migration moves. Its stream stays open (`group.send` feeds it)."""

    group: Group
    samples: list[Sample]


class Scheduler(EngineLoop):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch_tokens: int = 512,
                 tracer: Tracer | None = None, max_step_ms: float | None = None,
                 speculative: SpeculativeConfig | None = None,
                 on_finished: Callable[[Group, FinishReason], None] = lambda group, reason: None,
                 adaptive_threads: bool = False) -> None:
        """`on_finished(group, finish_reason)` runs, with the lock held, when a request's last
        sample ends (`group`: the instance, as its `RequestHandle.group`). `adaptive_threads`: see EngineLoop."""
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        super().__init__(engine, name="scheduler", adaptive_threads=adaptive_threads)
        self.tracer = tracer or Tracer("scheduler")
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.step_budget = StepBudget(max_step_ms)  # bounds the prompt tokens a step carries next to decodes
        self.speculator = Speculator(speculative or SpeculativeConfig())
        self._on_finished = on_finished
        self._active: list[Sample] = []  # admission order
        self._aborts: set[Group] = set()
        self._detaches: dict[Group, Future[Detached]] = {}

    # ---- public API (any thread) ----

    def _on_stop(self) -> None:
        """Abort everything still running."""
        for r in list(self._active):
            self._finish(r, [], "", FinishReason.ABORT)
        for done in self._detaches.values():
            done.set_exception(Unavailable("the node is shutting down"))
        self._detaches.clear()

    def submit(self, request_id: str, seq: Sequence, params: SamplingParams) -> RequestHandle:
        """Queue `seq` (its first `num_computed` positions already in the pool) for generation."""
        group = Group(request_id, params, len(seq.token_ids), seq.num_cached, unforked=params.n > 1)
        if params.prompt_logprobs is not None:
            assert seq.num_computed == 0, "prompt logprobs need the whole prompt computed here"
            group.prompt_logprobs = PromptLogprobs(list(seq.token_ids), params.prompt_logprobs)
        return self._start([self._sample(group, 0, seq)], seq.num_computed)

    def submit_continuation(self, request_id: str, seqs: list[Sequence], params: SamplingParams,
                            continuation: Continuation) -> RequestHandle:
        """Continue a generation begun elsewhere: `seqs[i]` holds the prompt and the output so far of
        `continuation.samples[i]` (its first `num_computed` positions already in the pool)."""
        first = continuation.samples[0]
        group = Group(request_id, params, len(seqs[0].token_ids) - len(first.generated), continuation.cached_tokens,
                      running=len(seqs), completion_tokens=continuation.finished_completion_tokens)
        samples = []
        for seq, state in zip(seqs, continuation.samples):
            r = self._sample(group, state.index, seq, state.seed)
            r.catch_up(list(state.generated), self.engine.model.config.vocab_size, self.engine.pool.data.device,
                       state.random_state)
            samples.append(r)
        return self._start(samples, min(seq.num_computed for seq in seqs))

    def _start(self, samples: list[Sample], computed: int) -> RequestHandle:
        group = samples[0].group
        with self._wakeup:
            if self._stopped:
                raise RuntimeError("the scheduler is shutting down")
            self._active.extend(samples)
            self.notify()
        self.tracer.event(group.request_id, "generation_start", computed_tokens=computed)
        return RequestHandle(group)

    def detach(self, handle: RequestHandle) -> Detached:
        """Take a decoding request out of the loop at the next step boundary, pages and all (to
        migrate it). Raises NotFound when it is not generating here (or finishes first), and
        FailedPrecondition while a sample of it is not decoding (its prompt is being computed,
        or its context recomputed after a preemption)."""
        done: Future[Detached] = Future()
        group = handle.group
        with self._wakeup:
            if not any(r.group is group for r in self._active):
                raise NotFound(f"request {group.request_id!r} is not generating on this node")
            if group in self._detaches:
                raise FailedPrecondition(f"request {group.request_id!r} is already being migrated")
            self._detaches[group] = done
            self.notify()
        return done.result()

    def resume(self, detached: Detached) -> None:
        """Put a detached request back into the loop (its migration failed). It decodes on from its
        pages, or, once they were released, first recomputes its context, usually from the prefix
        cache."""
        with self._wakeup:
            self._active.extend(detached.samples)
            self.notify()

    @locked
    def release(self, detached: Detached) -> None:
        """Give a detached request's pages back, into the prefix cache (its new node has it)."""
        for r in detached.samples:
            self.engine.release(r.seq)

    @locked
    def end_detached(self, detached: Detached, reason: FinishReason) -> None:
        """End a detached request here (aborted during its migration): each sample's last chunk."""
        self._active.extend(detached.samples)
        for r in list(detached.samples):
            self._finish(r, [], "", reason)

    @locked
    def absorb(self, detached: Detached, chunk: Chunk) -> None:
        """Bring a detached request up to a chunk its new node streamed, so that it can still be
        resumed here from exactly that point."""
        r = next((r for r in detached.samples if r.index == chunk.index), None)
        if r is None:
            return
        r.seq.token_ids.extend(chunk.token_ids)
        r.catch_up(chunk.token_ids, self.engine.model.config.vocab_size, self.engine.pool.data.device)
        if chunk.finish_reason is not None:
            detached.samples.remove(r)
            self.engine.release(r.seq, cache=False)
            r.group.running -= 1
            r.group.completion_tokens += r.num_generated

    def abort(self, handle: RequestHandle) -> bool:
        """Stop the request instance `handle` and free its pages; False if it is not running here."""
        with self._wakeup:
            if not any(r.group is handle.group for r in self._active):
                return False
            self._aborts.add(handle.group)
            self.notify()
            return True

    @locked
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens of admitted requests not yet computed."""
        return sum(r.seq.num_pending for r in self._active if r.seq.num_pending > 1)

    @locked
    def total_tokens(self) -> int:
        """Prompt plus generated tokens of every admitted request (the decode node's
        --max-total-tokens load)."""
        return sum(len(r.seq.token_ids) for r in self._active)

    # ---- the loop ----

    def _has_work(self) -> bool:
        return bool(self._active or self._detaches)

    def _step(self) -> int:
        with self.lock:
            self._apply_aborts()
            self._apply_detaches()
            work = self._plan_step()
        if not work:
            time.sleep(0.001)
            return 0
        scoring = {i for i, (r, _) in enumerate(work) if r.group.scoring_prompt or r.spec.tokens}
        # A decode's speculative draft counts in the decode part of the step, not as prompt tokens.
        decodes = [n == 1 or bool(r.spec.tokens) for r, n in work]
        chunks = [(r.seq.num_computed, n) for (r, n), decode in zip(work, decodes) if not decode]
        prompt_tokens = sum(n for _, n in chunks)
        attended = sum(attended_positions(start, n) for start, n in chunks)
        started = time.perf_counter()
        try:
            logits = self.engine.forward([(r.seq, n) for r, n in work], every_position=scoring)
        except Exception as exc:  # a bug or a bad model state must not kill the daemon
            log.exception("forward failed")
            with self.lock:
                for r, _ in work:
                    self._fail(r, ErrorCode.INTERNAL, f"internal error in the model forward: {exc}")
            return 0
        self.step_budget.record(sum(decodes), prompt_tokens, 1e3 * (time.perf_counter() - started), attended)
        with self.lock:
            at = 0
            for i, (r, n) in enumerate(work):
                rows = logits[at : at + (n if i in scoring else 1)]
                at += len(rows)
                if r.spec.tokens:
                    self._verify(r, rows)
                    continue
                self.engine.trim_to_window(r.seq)
                if r.seq.num_pending == 0 and r in self._active:
                    try:
                        if i in scoring:
                            r.group.prompt_logprobs.add(rows, r.seq.num_computed - n)
                        if r.params.max_tokens == 0:
                            r.group.unforked = False
                            self._finish(r, [], "", FinishReason.LENGTH)
                            continue
                        for sample in [r, *self._fork_samples(r)]:
                            self._emit_token(sample, sample.sampler.draw(rows[-1]))
                    except Exception as exc:  # one request's bad sample must not stop the loop
                        self._sampling_failed(r, exc)
                elif i in scoring:
                    r.group.prompt_logprobs.add(rows, r.seq.num_computed - n)
        return sum(n for _, n in work)

    def _sampling_failed(self, r: Sample, exc: Exception) -> None:
        """End `r` after its sampling raised: INVALID_ARGUMENT where its grammar cannot go on with
        this model's tokens, else INTERNAL (a bug, logged with its traceback)."""
        if isinstance(exc, GrammarDeadEnd):
            self._fail(r, ErrorCode.INVALID_ARGUMENT, f"guided decoding cannot go on with this model's tokens: {exc}")
            return
        log.exception("sampling failed", extra={"fields": {"request_id": r.request_id}})
        self._fail(r, ErrorCode.INTERNAL, f"sampling failed: {exc}")

    def _apply_aborts(self) -> None:
        for r in [r for r in self._active if r.group in self._aborts]:
            self._finish(r, [], "", FinishReason.ABORT)
        self._aborts.clear()

    def _apply_detaches(self) -> None:
        for group, done in self._detaches.items():
            samples = [r for r in self._active if r.group is group]
            if not samples:
                done.set_exception(NotFound(f"request {group.request_id!r} finished before it could be migrated"))
            elif not all(r.decoding for r in samples):
                done.set_exception(FailedPrecondition(
                    f"request {group.request_id!r} is still being prefilled (or recomputed after a preemption): "
                    "migrate it once it decodes"))
            else:
                self._active = [r for r in self._active if r.group is not group]
                done.set_result(Detached(group, samples))
        self._detaches.clear()

    @locked
    def _plan_step(self) -> list[tuple[Sample, int]]:
        """Pick this step's work and reserve its pages."""
        work: list[tuple[Sample, int]] = []
        budget = self.max_batch_tokens
        decoding = [r for r in self._active if r.seq.num_pending == 1]
        prefilling = [r for r in self._active if r.seq.num_pending > 1]
        for r in decoding:
            if budget == 0 or r.seq.num_pending != 1:  # preempted by an earlier reservation
                continue
            if self._reserve(r, 1, work):
                n = 1 + self._draft(r, budget - 1)
                work.append((r, n))
                budget -= n
        budget = self.step_budget.prefill_tokens(len(work), budget, prefilling[0].seq.num_computed if prefilling else 0)
        for r in prefilling:
            n = min(r.seq.num_pending, budget)
            if n == 0:
                break
            if r not in self._active:
                continue
            if not r.seq.pages and not r.group.scoring_prompt:  # preempted earlier
                self.engine.attach_cached_prefix(r.seq)
                n = min(r.seq.num_pending, budget)
            if self._reserve(r, n, work, preempt=False):
                work.append((r, n))
                budget -= n
        if not work and self._active:
            # Nothing fits: the oldest request prefills on, taking the pages newer ones hold
            # (those that arrived holding a cached prefix); if even that fails, nothing runs that
            # could free pages, and it is refused.
            oldest = self._active[0]
            if not oldest.seq.pages and oldest.seq.num_pending > 1 and not oldest.group.scoring_prompt:
                self.engine.attach_cached_prefix(oldest.seq)
            n = min(oldest.seq.num_pending, max(budget, 1))
            if oldest.seq.num_pending > 1 and self._reserve(oldest, n, work):
                work.append((oldest, n))
            else:
                self._fail(oldest, ErrorCode.RESOURCE_EXHAUSTED,
                           "the KV pool cannot hold this request; send a shorter prompt or fewer max_tokens")
        return work

    def _reserve(self, r: Sample, n: int, planned: list[tuple[Sample, int]], preempt: bool = True) -> bool:
        """Reserve pages for `n` more positions of `r`, preempting the newest requests not
        `planned` for this step if allowed."""
        while True:
            try:
                self.engine.reserve(r.seq, r.seq.num_computed + n)
                return True
            except OutOfPages:
                busy = {id(p) for p, _ in planned}
                victims = [v for v in self._active if v is not r and v.seq.pages and id(v) not in busy]
                if not preempt or not victims:
                    return False
                self._preempt(victims[-1])

    def _draft(self, r: Sample, budget: int) -> int:
        """Append a speculative draft of at most `budget` tokens to decoding `r` if its pages fit
        without preempting anyone; returns its length."""
        seq, group = r.seq, r.group
        if group.unforked or group.scoring_prompt:  # the first draw forks samples / scores the prompt
            return 0
        limit = min(budget, r.params.max_tokens - r.num_generated - 1,
                    self.engine.model.config.max_position_embeddings - len(seq.token_ids) - 1)
        long_rope_from = self.engine.long_rope_from
        if long_rope_from is not None and not seq.long_rope:  # drafts stay short: the switch recomputes
            limit = min(limit, long_rope_from - len(seq.token_ids))
        draft = self.speculator.propose(seq.token_ids, r.params, limit, r.spec)
        if not draft:
            return 0
        try:
            self.engine.reserve(seq, seq.num_computed + 1 + len(draft))
        except OutOfPages:
            return 0
        seq.token_ids.extend(draft)
        r.spec.tokens = draft
        return len(draft)

    def _verify(self, r: Sample, rows: torch.Tensor) -> None:
        """Emit what `r`'s verified draft yields and give back its rejected positions' pages."""
        if r not in self._active:
            return

        def emit(draw: Draw) -> bool:
            self._emit_token(r, draw)
            return r in self._active

        try:
            self.speculator.verify(r.seq, r.sampler, rows, r.spec, emit)
        except Exception as exc:  # one request's bad sample must not stop the loop
            self._sampling_failed(r, exc)
            return
        if r in self._active:
            self.engine.truncate(r.seq)
            self.engine.trim_to_window(r.seq)

    def _preempt(self, r: Sample) -> None:
        log.info("preempting %s: KV pool full", r.request_id)
        # Its pages stay in the prefix cache; it re-attaches them when it is scheduled again.
        self.engine.release(r.seq)
        self.tracer.event(r.request_id, "preempted")
        self._active.remove(r)
        self._active.append(r)

    def _sample(self, group: Group, index: int, seq: Sequence, seed: int | None = None) -> Sample:
        params = group.params.for_sample(index)
        if seed is not None:
            params = replace(params, seed=seed)
        return Sample(group, index, seq, params, Sampler(params), IncrementalDetokenizer(self.tokenizer, params.stop))

    def _fork_samples(self, r: Sample) -> list[Sample]:
        """Samples 1..n-1 of `r`'s request, once its prompt is computed (none otherwise), placed
        after it in admission order. A sample that gets no page for its copy of the prompt's
        partial last page starts without KV and is recomputed, as a preempted one is."""
        group = r.group
        if not group.unforked:
            return []
        group.unforked = False
        samples = []
        for index in range(1, group.params.n):
            seq_id = f"{group.request_id}#{index}"
            try:
                seq = self.engine.fork(r.seq, seq_id)
            except OutOfPages:
                seq = Sequence(seq_id, list(r.seq.token_ids))
            samples.append(self._sample(group, index, seq))
        at = self._active.index(r) + 1
        self._active[at:at] = samples
        group.running += len(samples)
        return samples

    def _emit_token(self, r: Sample, draw: Draw) -> None:
        token = draw.token
        logprobs = () if draw.logprobs is None else (draw.logprobs,)
        r.seq.token_ids.append(token)
        r.num_generated += 1
        if r.num_generated == 1 and r.index == 0:
            self.tracer.event(r.request_id, "first_token")
        p = r.params
        eos = not p.ignore_eos and token == self.tokenizer.eos_token_id
        text = "" if eos else r.detok.push(token)
        reason = None
        if eos or token in p.stop_token_ids or r.detok.finished_by_stop is not None:
            reason = FinishReason.STOP
        elif r.num_generated >= p.max_tokens or len(r.seq.token_ids) >= self.engine.model.config.max_position_embeddings:
            reason = FinishReason.LENGTH
        if reason is None:
            r.group.send(Chunk([token], text, index=r.index, logprobs=logprobs,
                                  prompt_logprobs=r.group.take_prompt_logprobs()))
            if self.engine.outgrow_short_rope(r.seq):  # it prefills again, as a preempted sample does
                self.tracer.event(r.request_id, "long_rope_recompute", tokens=len(r.seq.token_ids))
        else:
            self._finish(r, [token], text + r.detok.flush(), reason, logprobs=logprobs,
                         stop_string=r.detok.finished_by_stop)

    def _finish(self, r: Sample, tokens: list[int], text: str, reason: FinishReason,
                error_code: ErrorCode | None = None, error: str | None = None,
                logprobs: tuple[PositionLogprobs, ...] = (), stop_string: str | None = None) -> None:
        """End one sample and free its pages (exactly once: it leaves `_active` here). The
        request's last sample to end sends the final chunk, with everyone's usage."""
        if r not in self._active:
            return  # already ended: a failure ends every sample of its request
        self._active.remove(r)
        self.engine.release(r.seq, cache=reason is not FinishReason.ERROR)
        group = r.group
        group.running -= 1
        group.completion_tokens += r.num_generated
        usage = None
        if group.running == 0:
            usage = Usage(group.prompt_len, group.completion_tokens, group.cached_tokens)
            self.tracer.event(r.request_id, "finished", finish_reason=reason,
                              completion_tokens=group.completion_tokens)
            self._on_finished(group, reason)
        group.send(Chunk(tokens, text, reason, usage, error_code, error, r.index, logprobs,
                         group.take_prompt_logprobs(), stop_string))

    def _fail(self, r: Sample, code: ErrorCode, message: str) -> None:
        """Fail `r`'s request: every sample of it ends with the error."""
        for sample in [s for s in self._active if s.group is r.group]:
            self._finish(sample, [], "", FinishReason.ERROR, code, message)

