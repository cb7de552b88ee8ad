"""What the router has relayed of one request's stream, so that another decode node can continue
it when the first one dies mid-stream (router/router.py).

The continuing node gets the original prompt and a `pb.Continuation`: for each sample not yet
finished, the tokens the client has already received. It recomputes their KV, replays them
through its detokenizer, stop strings, grammar and (seeded) random stream, and streams only what
comes next, so the client's stream goes on as if nothing had happened: greedy and seeded samples
come out as an uninterrupted run's, and the final usage counts every token once.
"""
from __future__ import annotations

from common.errors import InvalidArgument
from protos.duet.v1 import duet_pb2 as pb


class Relayed:
    """The chunks of one request relayed to its client so far, per sample: their tokens, and which
    samples' last chunk (finish_reason set) went out."""

    def __init__(self, sampling: pb.SamplingParams) -> None:
        self._n = sampling.n if sampling.HasField("n") else 1
        self._tokens: dict[int, list[int]] = {i: [] for i in range(self._n)}
        self._finished: set[int] = set()
        self.chunks = 0
        self.continuations = 0  # times another decode node took the request over
        # Usage's cached_tokens for a continuation: the prompt tokens the router believed the first
        # node held (the node reports the true count only in the final chunk, which never came).
        self.cached_tokens = 0
        self.resumed = False  # the client brought a continuation: it holds chunks of another router's
        self._finished_before = 0  # tokens of the samples it had received whole

    @classmethod
    def resuming(cls, sampling: pb.SamplingParams, continuation: pb.Continuation) -> Relayed:
        """A stream whose client received part of it from another router (which went away) and
        asks for the rest with what it holds: `continuation`'s samples go on, the others are done."""
        relayed = cls(sampling)
        indices = [s.index for s in continuation.samples]
        if not indices or len(set(indices)) != len(indices) or not all(0 <= i < relayed._n for i in indices):
            raise InvalidArgument(f"continuation.samples: indices {indices} must be one or more, distinct, "
                                  f"in [0, n={relayed._n})")
        relayed._tokens |= {s.index: list(s.generated_token_ids) for s in continuation.samples}
        relayed._finished = set(range(relayed._n)) - {s.index for s in continuation.samples}
        relayed.cached_tokens = continuation.cached_tokens
        relayed._finished_before = continuation.finished_completion_tokens
        relayed.resumed = True
        return relayed

    @property
    def started(self) -> bool:
        """Whether the client has received anything: a break now is continued, not re-issued
        (a re-issue would send the first chunk, prompt logprobs included, a second time)."""
        return self.chunks > 0 or self.resumed

    @property
    def done(self) -> bool:
        """Whether every sample's last chunk went out (the last of them carries the usage)."""
        return not self.unfinished

    @property
    def unfinished(self) -> list[int]:
        """The samples still generating, by index."""
        return [i for i in range(self._n) if i not in self._finished]

    def record(self, chunk: pb.GenerationChunk) -> None:
        """Note one chunk as relayed to the client."""
        self.chunks += 1
        self._tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            self._finished.add(chunk.index)

    def continuation(self) -> pb.Continuation:
        """The unfinished samples with their tokens so far (none yet: empty), for the next node.
        Their random streams are replayed from the seed there: one draw per token relayed."""
        return pb.Continuation(
            samples=[pb.SampleContinuation(index=i, generated_token_ids=self._tokens[i]) for i in self.unfinished],
            cached_tokens=self.cached_tokens,
            finished_completion_tokens=self._finished_before + sum(len(self._tokens[i]) for i in self._finished))

    def continue_request(self, request_id: str, prompt: list[int], sampling: pb.SamplingParams) -> pb.GenerateRequest:
        """The Generate request that continues this stream on another decode node: the original
        prompt, the same request id and sampling, less prompt_logprobs (the first chunk carried
        them; a continuation may not ask again)."""
        request = pb.GenerateRequest(request_id=request_id, token_ids=prompt, continuation=self.continuation())
        request.sampling.CopyFrom(sampling)
        request.sampling.ClearField("prompt_logprobs")
        return request
