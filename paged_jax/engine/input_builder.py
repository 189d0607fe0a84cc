"""The flat batch of one call: every scheduled token, packed, the rows that
sample, and the rows that score prompt tokens
(:class:`paged_jax.engine.step.StepInputs`, :mod:`paged_jax.engine.prompt_logprobs`).

The scheduler decides who runs (:mod:`paged_jax.engine.scheduler`), the KV manager
which pages move (:mod:`paged_jax.engine.kv_manager`), the engine which sequences
are forked in the call; this module only lays their tokens out. It creates
no sequence and changes none.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.attention.batch import BatchShape, Tiling, batch_shape
from paged_jax.engine.kv_manager import CallPages
from paged_jax.engine.prompt_logprobs import PromptLogprobsBook, PromptRow
from paged_jax.engine.scheduler import ScheduledSeq
from paged_jax.engine.sequence import Sequence
from paged_jax.engine.step import StepInputs, StepOptions


@dataclasses.dataclass(frozen=True)
class StepCall:
    """One call, built: what :func:`paged_jax.engine.step.device_step` takes and
    what the host needs to read its results.

    Attributes:
      inputs: the arrays.
      shape: the static sizes.
      samplers: the sequences that sample in the call, in logits-row order.
      prompt_rows: the rows that score prompt tokens, in order.
      options: ``device_step``'s other static arguments.
      verifiers: speculative decoding: ``(sequence, its proposals in the
        call, its first verification row)`` for each sequence that
        verifies proposals, in batch order; its rows follow one another.
    """

    inputs: StepInputs
    shape: BatchShape
    samplers: list[Sequence]
    prompt_rows: list[PromptRow]
    options: StepOptions
    verifiers: list[tuple[Sequence, list[int], int]] = dataclasses.field(default_factory=list)


def _bucket(k: int) -> int:
    """``k`` rounded up to a power of two (0 stays 0): fewer programs."""
    return 1 << (k - 1).bit_length() if k else 0


def samples_in_call(seq: Sequence, num_tokens: int) -> bool:
    """Whether ``seq``'s chunk of ``num_tokens`` reaches its end, so the call
    samples its next token (a prefill chunk short of the end does not; a
    sequence's proposals count among its tokens)."""
    return seq.num_computed + num_tokens >= seq.num_tokens


def build_step_inputs(
    scheduled: list[ScheduledSeq],
    children: dict[int, list[Sequence]],
    forks_pre: list[Sequence],
    pages: CallPages,
    *,
    tiling: Tiling,
    prompt_book: PromptLogprobsBook | None = None,
) -> StepCall:
    """The call's inputs.

    Args:
      scheduled: the sequences that compute tokens, in batch order.
      children: parallel samples forked in the call, by their parent's row
        (they sample their first token from the parent's logits).
      forks_pre: beams that fork their parent's pages (``fork_pre``) before
        anything grows.
      pages: the KV manager's part (frees, shares, each growing row's
        reservation).
      tiling: the bucketing of tokens and chunks.
      prompt_book: the records of requests asking for prompt log-probs
        (their rows are added); None: none asks.
    """
    S = len(pages.ahead)  # sequence slots (the page state has a row per slot and layer group)
    q_lens = np.zeros(S, np.int32)
    q_starts = np.zeros(S, np.int32)
    fork_src = np.full(S, -1, np.int32)
    fork_pre = np.full(S, -1, np.int32)
    for seq in forks_pre:
        fork_pre[seq.slot] = seq.fork_pre.slot
    samplers: list[tuple[Sequence, int]] = []  # (sequence, flat row of its logits)
    scored: list[tuple[PromptRow, int]] = []  # (prompt row, flat row of its logits)
    verifiers: list[tuple[Sequence, list[int], int]] = []  # (sequence, its proposals, its first verification row)
    verify: list[tuple[int, int, int, int]] = []  # (flat row, proposal, its sampler's index, step)
    offset = 0
    for e in scheduled:
        seq, n = e.seq, e.num_tokens
        q_lens[seq.slot], q_starts[seq.slot] = n, offset
        if prompt_book is not None:  # position q's logits sit at flat row offset + q - num_computed
            scored += [(r, offset + r.position - 1 - seq.num_computed) for r in prompt_book.rows(seq, n)]
        if seq.draft:  # the rows of its last known token and its proposals but the last judge the proposals
            verifiers.append((seq, list(seq.draft), len(verify)))
            verify += [(offset + j, tok, len(samplers), seq.num_generated + j) for j, tok in enumerate(seq.draft)]
        offset += n
        if not samples_in_call(seq, n):
            continue
        samplers.append((seq, offset - 1))
        for child in children.get(seq.slot, ()):
            fork_src[child.slot] = seq.slot
            samplers.append((child, offset - 1))
    shape = batch_shape(q_lens, num_seq_rows=S, tiling=tiling, num_samples=len(samplers),
                        num_prompt_rows=len(scored), num_verify_rows=len(verify))
    T, R, P = shape.num_tokens, shape.num_logits, shape.num_prompt_logits
    tokens = np.zeros(T, np.int32)
    from_prev = np.zeros(T, bool)
    positions = np.zeros(T, np.int32)
    token_rows = np.full(T, -1, np.int32)
    for e in scheduled:
        seq, n = e.seq, e.num_tokens
        start, o = seq.num_computed, q_starts[seq.slot]
        ids = seq.tokens + seq.draft if seq.draft else seq.tokens  # proposals and a token in flight never meet
        known = min(start + n, len(ids))  # the rest is the token in flight
        tokens[o : o + known - start] = ids[start:known]
        from_prev[o + known - start : o + n] = True
        positions[o : o + n] = np.arange(start, start + n)
        token_rows[o : o + n] = seq.slot
    logits_rows = np.zeros(R, np.int32)
    logits_slots = np.full(R, -1, np.int32)
    temperature = np.zeros(R, np.float32)
    top_p = np.ones(R, np.float32)
    seeds = np.zeros(R, np.uint32)
    streams = np.zeros(R, np.int32)
    steps = np.zeros(R, np.int32)
    for r, (seq, row) in enumerate(samplers):
        p = seq.request.sampling
        logits_rows[r], logits_slots[r] = row, seq.slot
        temperature[r], top_p[r], seeds[r] = p.temperature, p.top_p, p.seed
        # The step of the token it samples: after its proposals (a bonus token when all are accepted).
        streams[r], steps[r] = seq.index, seq.num_generated + seq.pending + len(seq.draft)
    prompt_rows, prompt_targets = np.zeros(P, np.int32), np.zeros(P, np.int32)
    for j, (r, row) in enumerate(scored):
        prompt_rows[j], prompt_targets[j] = row, r.token
    V = shape.num_verify_logits
    verify_arrays = np.zeros((4, V), np.int32)  # rows, proposals, sampler rows, steps
    if verify:
        verify_arrays[:, : len(verify)] = np.array(verify, np.int32).T
    inputs = StepInputs(
        first_kept=pages.first_kept, free_mask=pages.free_mask, num_hit=pages.num_hit, hit_pages=pages.hit_pages, hit_tokens=pages.hit_tokens,
        num_new=q_lens - pages.ahead, q_lens=q_lens, min_pages=pages.min_pages, fork_pre=fork_pre,
        fork_src=fork_src, tokens=tokens, from_prev=from_prev, positions=positions, token_rows=token_rows,
        q_starts=q_starts, logits_rows=logits_rows, logits_slots=logits_slots, temperature=temperature, top_p=top_p,
        seeds=seeds, streams=streams, steps=steps, prompt_rows=prompt_rows, prompt_targets=prompt_targets,
        verify_rows=verify_arrays[0], verify_proposals=verify_arrays[1], verify_params=verify_arrays[2],
        verify_steps=verify_arrays[3],
    )
    params = [s.request.sampling for s, _ in samplers]
    want = max([2 * p.beam_width for p in params] + [p.logprobs or 0 for p in params], default=0)
    options = StepOptions(greedy_only=all(p.greedy for p in params), top_k=_bucket(want),
                          logprobs=any(p.logprobs is not None for p in params),
                          prompt_top_k=_bucket(max((r.record.k for r, _ in scored), default=0)))
    return StepCall(inputs=inputs, shape=shape, samplers=[seq for seq, _ in samplers],
                    prompt_rows=[r for r, _ in scored], options=options, verifiers=verifiers)
