"""The engine's records of a request in flight: its sequences and its
sequence group (PagedAttention, Kwon et al., SOSP 2023, section 4.5), and
the typed pieces of beam search.

These are plain host records. The scheduler (:mod:`paged_jax.engine.scheduler`)
moves them between queues, the KV manager (:mod:`paged_jax.engine.kv_manager`)
gives their slots pages, and the engine (:mod:`paged_jax.engine.core`) appends
the tokens a call samples. Nothing here reads page internals.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.engine.detokenizer import IncrementalDetokenizer
from paged_jax.engine.requests import Request

NO_SLOT = -1
"""``Sequence.slot`` of a sequence that holds no page-state row (waiting)."""


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sequence: a request's prompt and one continuation of it.

    Attributes:
      group: the request's group.
      index: its place among the group's sequences (its random stream).
      tokens: prompt + generated token ids.
      num_prompt: prompt tokens.
      slot: its page-state row while running, ``NO_SLOT`` otherwise.
      num_computed: tokens whose K/V are in the cache or being computed by a
        dispatched call.
      pending: tokens sampled on device and not yet read by the host (0 or 1).
      stale: of them, those to discard when read: computed on pages a KV
        connector sent that proved bad, so the sequence is recomputed.
      done: finished; a token still in flight for it is discarded when read.
      finish_reason: "stop", "length", "abort" or "pruned" once done.
      keys: prefix-cache key per full page of its tokens.
      num_keyed: leading pages offered to the prefix cache.
      cum_logprob: its cumulative log-probability (beam search, or when
        ``SamplingParams.logprobs`` is set).
      fork_pre: beam search: the beam whose pages it forks in the next call.
      token_times: engine-clock seconds at which each generated token
        reached the host.
      logprobs: per generated token, ``{token_id: logprob}`` (when
        ``SamplingParams.logprobs`` is set; None otherwise).
      detok: its incremental detokenizer (an engine with a tokenizer).
      stop_reason: the stop string or stop token id that ended it.
      num_reported: generated tokens already reported (streamed outputs).
      text_out: text already reported.
      final_reported: its end has been reported.
      draft: speculative decoding: the tokens proposed after ``tokens``
        for the next call to verify (:mod:`paged_jax.speculative`); they
        count among :attr:`num_tokens` (the scheduler reserves their slots:
        vLLM's lookahead slots) and are never in ``tokens``, the prefix
        cache's keys or an output until accepted. Empty otherwise.
      num_proposed: proposals it has had verified (speculative decoding).
      num_accepted: of them, accepted.
    """

    group: SequenceGroup
    index: int
    tokens: list[int]
    num_prompt: int
    slot: int = NO_SLOT
    num_computed: int = 0
    pending: int = 0
    stale: int = 0
    done: bool = False
    finish_reason: str = ""
    keys: list[bytes] = dataclasses.field(default_factory=list)
    num_keyed: int = 0
    cum_logprob: float = 0.0
    fork_pre: Sequence | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    detok: IncrementalDetokenizer | None = None
    stop_reason: str | int | None = None
    num_reported: int = 0
    text_out: str = ""
    final_reported: bool = False
    draft: list[int] = dataclasses.field(default_factory=list)
    num_proposed: int = 0
    num_accepted: int = 0

    @property
    def request(self) -> Request:
        return self.group.request

    @property
    def extra_key(self) -> tuple:
        """What makes equal tokens unequal in the prefix cache."""
        return (self.request.cache_salt,)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        """Tokens it has, the one in flight and its proposals included."""
        return len(self.tokens) + self.pending + len(self.draft)

    @property
    def running(self) -> bool:
        return self.slot != NO_SLOT

    def finish(self, reason: str) -> None:
        self.done, self.finish_reason = True, reason


@dataclasses.dataclass(frozen=True)
class BeamCandidates:
    """A beam's most likely next tokens, as one call sampled them.

    Attributes:
      ids: i32[K] token ids, most likely first.
      logprobs: f32[K] their log-probabilities.
    """

    ids: np.ndarray
    logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam.

    Attributes:
      score: its rank (:func:`paged_jax.engine.beam_search.score`; higher is better).
      output_ids: its generated token ids.
      cum_logprob: the sum of their log-probabilities.
      finish_reason: "stop", "length" or "abort".
    """

    score: float
    output_ids: list[int]
    cum_logprob: float
    finish_reason: str


@dataclasses.dataclass(eq=False)
class SequenceGroup:
    """A request's sequences (the paper's sequence group, section 4.5):
    admitted, preempted and resumed together.

    Parallel sampling: until its prompt is prefilled a group has one
    sequence and holds ``child_slots`` for the others; the call that samples
    the first token forks them from it (they share its pages). Beam search:
    the group holds a slot for each of its ``beam_width`` beams; beams that
    die give theirs back to ``child_slots``, forks take from it.

    Attributes:
      request: what was asked.
      seqs: its sequences, by index.
      child_slots: page-state rows reserved for sequences still to come.
      num_preemptions: times it was preempted.
      first_token_s: seconds from the engine's start to its first token;
        None until then.
      num_cached_tokens: prompt tokens served from the prefix cache at its
        first admission, every tier's; None until admitted.
      num_host_cached_tokens: of them, those loaded from the host tier.
      num_disk_cached_tokens: of them, those loaded from the disk tier.
      num_remote_cached_tokens: of them, those a KV connector brought from
        another engine.
      remote_pages: pages a KV connector sent that its sequences read
        (page -> chain key): a non-finite value in its calls then costs
        those pages and a recompute, never the engine.
      candidates: beam search: each live beam's candidates from the last
        call, by sequence index.
      hypotheses: beam search: the finished beams.
      beam_done: beam search: no further beams are wanted.
      reported: its final output has been returned.
      arrival_s: engine-clock seconds when it was added.
      step_times: beam search: engine-clock seconds of each beam step (its
        hypotheses' token times).
      blocked_by_fragmentation: its admission waited at least once with
        pages enough but no contiguous run to hold them
        (``EngineConfig.allocator``).
    """

    request: Request
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    child_slots: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    first_token_s: float | None = None
    num_cached_tokens: int | None = None
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    num_remote_cached_tokens: int = 0
    remote_pages: dict[int, bytes] = dataclasses.field(default_factory=dict)
    candidates: dict[int, BeamCandidates] = dataclasses.field(default_factory=dict)
    hypotheses: list[BeamHypothesis] = dataclasses.field(default_factory=list)
    beam_done: bool = False
    reported: bool = False
    arrival_s: float = 0.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    blocked_by_fragmentation: bool = False

    @classmethod
    def from_request(cls, request: Request, *, arrival_s: float = 0.0) -> SequenceGroup:
        """A new group holding one sequence of ``request``'s prompt."""
        prompt = request.token_ids()
        group = cls(request=request, arrival_s=arrival_s)
        group.seqs.append(Sequence(group=group, index=0, tokens=prompt, num_prompt=len(prompt),
                                   logprobs=[] if request.sampling.logprobs is not None else None))
        return group

    @property
    def beam(self) -> bool:
        return self.request.sampling.beam_width > 0

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.done]

    @property
    def spare_slots(self) -> int:
        """Rows it needs beyond its live sequences' (children to fork,
        beams to come)."""
        if self.beam:
            return 0 if self.beam_done else self.request.sampling.beam_width - len(self.live)
        return self.request.sampling.n - len(self.seqs)

    @property
    def finished(self) -> bool:
        if self.beam:
            return self.beam_done and not self.live
        return len(self.seqs) == self.request.sampling.n and not self.live

    def wants_children(self, seq: Sequence) -> bool:
        """Parallel sampling: ``seq`` (its first sequence) samples its first
        token in the next call, and the others fork from it then."""
        return bool(self.child_slots) and not self.beam and seq.num_generated + seq.pending == 0

    def spawn_children(self, parent: Sequence) -> list[Sequence]:
        """The group's other samples, one per child slot, copies of
        ``parent`` that will share its pages (not yet in ``seqs``: they join
        when the call that forks them is dispatched)."""
        return [
            Sequence(group=self, index=k, tokens=list(parent.tokens), num_prompt=parent.num_prompt, slot=slot,
                     keys=list(parent.keys), logprobs=None if parent.logprobs is None else [])
            for k, slot in enumerate(self.child_slots, start=1)
        ]
