"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): which rows
of a call score which prompt tokens, and the records their results go into.

What RL and evaluation loops use to score a text under the model (vLLM's
``prompt_logprobs``; an OpenAI ``echo`` with ``logprobs``): for every prompt
token after the first, the float32 log-softmax log-probability of that
token given the tokens before it, and the ``k`` most likely tokens at its
position.

Which rows. The logits at a sequence's position ``q`` predict the token at
``q + 1``. A prefill chunk computing positions ``[start, start + n)`` of an
``m``-token prompt therefore scores tokens ``start + 1`` to ``min(start +
n, m - 1)``; the token at the chunk's boundary (``start``) was scored by the
previous chunk's last row. These rows are extra logits rows of the same
jitted call (:func:`paged_jax.engine.step.device_step`,
``BatchShape.num_prompt_logits``), so chunks concatenate in order and a call
without any keeps its shape and program.

Once each. A record holds each prompt token's entry by position, and a
chunk asks only for tokens its request has not had scored. A sequence
preempted by recompute computes its prompt again without asking for them
again (an entry scored twice, when a chunk's call was still in flight at
the preemption, is overwritten, never reported twice: entries are reported
only once the first token arrives); one swapped out keeps its record and
computes nothing again.

Why no prefix-cache hit for such a request: a hit would leave the tokens
it covers unscored (:meth:`paged_jax.engine.kv_manager.KVCacheManager.admission`
skips the lookup, as vLLM v1 does).
"""

from __future__ import annotations

import dataclasses

from paged_jax.engine.sequence import Sequence, SequenceGroup


@dataclasses.dataclass(eq=False)
class PromptLogprobs:
    """One request's prompt log-probabilities as calls score them.

    Attributes:
      k: top log-probabilities per position (``SamplingParams.prompt_logprobs``).
      entries: per prompt position, ``{token_id: logprob}`` (the ``k`` most
        likely tokens' and the prompt token's own); None for position 0
        (nothing before it to condition on) and until scored.
      num_scored: leading positions final (position 0 counted): the
        entries a report may hold.
      num_reported: leading entries already reported (streamed outputs).
    """

    k: int
    entries: list[dict[int, float] | None]
    num_scored: int = 1
    num_reported: int = 0

    def store(self, position: int, entry: dict[int, float]) -> None:
        """Sets ``position``'s entry; advances ``num_scored`` over the
        positions now known."""
        self.entries[position] = entry
        while self.num_scored < len(self.entries) and self.entries[self.num_scored] is not None:
            self.num_scored += 1


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """A logits row of a call that scores a prompt token.

    Attributes:
      record: the request's record the result goes into.
      position: the prompt position it scores (the one after the row's).
      token: the prompt token there.
    """

    record: PromptLogprobs
    position: int
    token: int


class PromptLogprobsBook:
    """The engine's prompt log-prob records, one per unfinished request
    that asks for them, by sequence group."""

    def __init__(self):
        self._records: dict[SequenceGroup, PromptLogprobs] = {}

    def rows(self, seq: Sequence, num_tokens: int) -> list[PromptRow]:
        """The rows ``seq``'s chunk of ``num_tokens`` (from
        ``seq.num_computed`` on) scores: one per prompt token in it, the
        chunk's first excepted, not yet scored. Empty unless its request
        asks for prompt log-probs."""
        k = seq.request.sampling.prompt_logprobs
        if k is None:
            return []
        record = self._records.get(seq.group)
        if record is None:
            record = self._records[seq.group] = PromptLogprobs(k=k, entries=[None] * seq.num_prompt)
        start = max(seq.num_computed, record.num_scored - 1)
        end = min(seq.num_computed + num_tokens, seq.num_prompt - 1)
        return [PromptRow(record, q + 1, seq.tokens[q + 1]) for q in range(start, end)]

    @staticmethod
    def record(rows: list[PromptRow], results) -> None:
        """Stores a call's results: ``results`` as
        :func:`paged_jax.engine.step.device_step` returns them, read back to the
        host (``(f32[P] the scored token's log-prob, i32[P, K] top ids,
        f32[P, K] their log-probs)``, row ``j`` for ``rows[j]``; None when
        the call scored nothing)."""
        if not rows:
            return
        lps, top_ids, top_lps = results
        for j, row in enumerate(rows):
            k = row.record.k
            entry = {int(t): float(v) for t, v in zip(top_ids[j, :k], top_lps[j, :k])}
            entry[row.token] = float(lps[j])  # as CompletionOutput.logprobs: the top k, then the token's own
            row.record.store(row.position, entry)

    def report(self, group: SequenceGroup, *, delta: bool, final: bool) -> list[dict[int, float] | None] | None:
        """What ``group`` reports as ``RequestOutput.prompt_logprobs``: the
        scored entries (position 0's None first), or with ``delta`` those
        not reported before; None when its request does not ask for them.
        ``final``: its last report (the record is dropped)."""
        k = group.request.sampling.prompt_logprobs
        if k is None:
            return None
        record = self._records.pop(group, None) if final else self._records.get(group)
        if record is None:  # never scheduled (aborted while waiting): position 0 alone
            record = PromptLogprobs(k=k, entries=[None])
        start = record.num_reported if delta else 0
        record.num_reported = record.num_scored
        return record.entries[start: record.num_scored]
