"""What goes into the engine and what comes out: requests and their outputs
(vLLM's ``Request`` / ``RequestOutput`` / ``CompletionOutput``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from paged_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request.

    Attributes:
      request_id: unique among the engine's requests.
      prompt_ids: prompt token ids, at least one.
      max_new_tokens: most tokens to generate, >= 1.
      sampling: greedy by default.
      ignore_eos: keep generating through stop tokens (fixed output lengths,
        as serving benchmarks do).
      cache_salt: requests with different salts never share a cached page,
        even with identical tokens (isolation between users or tenants);
        ``None`` is a salt like any other.
    """

    request_id: str | int
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    cache_salt: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a request (``SamplingParams.n`` of them).

    Attributes:
      index: its place among the request's samples (its random stream).
      output_ids: generated token ids (a stop token, if one ended it, last).
      finish_reason: "stop" (a stop token), "length" (max_new_tokens) or
        "abort" (:meth:`Engine.abort`).
      cumulative_logprob: the sum of its tokens' log-probabilities (beam
        search only; None otherwise).
    """

    index: int
    output_ids: list[int]
    finish_reason: str
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """What came of a request.

    Attributes:
      outputs: its continuations, by index (one unless ``SamplingParams.n``
        asked for more); for beam search its ``beam_width`` best
        hypotheses, best first.
      num_preemptions: times it was preempted and recomputed (all its
        sequences together).
      num_cached_tokens: prompt tokens served from the prefix cache when
        it was first admitted.
      first_token_s, finish_s: seconds from the start of :meth:`Engine.run`
        (or the first :meth:`Engine.step`).
    """

    request_id: str | int
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    num_preemptions: int
    first_token_s: float
    finish_s: float
    num_cached_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        """The first continuation's tokens."""
        return self.outputs[0].output_ids

    @property
    def finish_reason(self) -> str:
        """The first continuation's finish reason."""
        return self.outputs[0].finish_reason
