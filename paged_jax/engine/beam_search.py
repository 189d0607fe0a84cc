"""Beam search: which beams go on, which end, after each step.

The engine runs the beams of a request as a sequence group (PagedAttention,
Kwon et al., SOSP 2023, section 4.4 and Figure 17): every step each live
beam's logits give its ``K`` most likely next tokens (``K = min(2 * width,
vocab)``) with their log-probabilities; :func:`expand` picks the ``width``
best continuations over all beams by cumulative log-probability. A beam
with several chosen continuations forks (its pages are shared, and copied
only when a continuation writes into a partly filled shared page); a beam
with none dies and its pages are freed at once.

Finished hypotheses: a chosen candidate that is a stop token (ranked among
the first ``width`` candidates, as Hugging Face's ``BeamSearchScorer``
does), or any chosen continuation that reaches ``max_new_tokens``. A
hypothesis is ranked by ``cumulative_logprob / num_generated **
length_penalty`` (Wu et al., 2016, the form Hugging Face and vLLM use).
The search stops once ``width`` hypotheses have finished (early stopping)
or no beam is left; the request returns its ``width`` best hypotheses,
best first.

Everything here is host-side arithmetic on a few numbers per beam, in
float64; the device only supplies the top-``K`` log-probabilities.
:func:`advance` applies one step to a group's records and says what the
queues must do (prune, fork); the engine's scheduler does it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.checks import check_int
from paged_jax.engine.sequence import BeamHypothesis, Sequence, SequenceGroup


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A chosen candidate: beam ``parent`` followed by ``token``.

    Attributes:
      parent: index of the beam it extends (into the ``cum_logprobs`` given
        to :func:`expand`).
      token: the token id.
      cum_logprob: the beam's cumulative log-probability after it.
      finish_reason: "" while it goes on; "stop" or "length" once it is a
        finished hypothesis.
    """

    parent: int
    token: int
    cum_logprob: float
    finish_reason: str = ""


def expand(
    cum_logprobs: list[float] | np.ndarray,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    *,
    width: int,
    stop_ids: frozenset = frozenset(),
    at_max_len: bool = False,
) -> tuple[list[Continuation], list[Continuation]]:
    """One beam-search step.

    Args:
      cum_logprobs: f64[B] each live beam's cumulative log-probability.
      top_ids: i32[B, K] each beam's K most likely next tokens.
      top_logprobs: f32[B, K] their log-probabilities.
      width: beams to keep, >= 1.
      stop_ids: tokens that end a hypothesis.
      at_max_len: the next token is the last one allowed: every chosen
        continuation finishes ("length").

    Returns:
      ``(beams, finished)``: up to ``width`` continuations that go on, and
      the hypotheses that finish in this step. Candidates are ranked by
      cumulative log-probability, ties by beam, then by the beam's own rank
      of the token.

    Raises:
      ValueError: shapes that do not agree, or ``width`` < 1.
    """
    cum = np.asarray(cum_logprobs, np.float64)
    ids, lps = np.asarray(top_ids), np.asarray(top_logprobs, np.float64)
    check_int("width", width)
    if ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] != cum.shape[0]:
        raise ValueError(f"top_ids {ids.shape} and top_logprobs {lps.shape} must be [B={cum.shape[0]}, K]")
    scores = (cum[:, None] + lps).ravel()
    order = np.argsort(-scores, kind="stable")  # stable: ties by beam, then by rank
    beams: list[Continuation] = []
    finished: list[Continuation] = []
    k = ids.shape[1]
    for rank, flat in enumerate(order):
        parent, j = divmod(int(flat), k)
        token = int(ids[parent, j])
        if token in stop_ids:
            if rank < width:
                finished.append(Continuation(parent, token, float(scores[flat]), "stop"))
            continue
        beams.append(Continuation(parent, token, float(scores[flat])))
        if len(beams) == width:
            break
    if at_max_len:
        finished += [dataclasses.replace(b, finish_reason="length") for b in beams]
        beams = []
    return beams, finished


def score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """A finished hypothesis' rank: ``cum_logprob / num_generated **
    length_penalty`` (higher is better)."""
    return cum_logprob / max(num_generated, 1) ** length_penalty


@dataclasses.dataclass(frozen=True)
class BeamStep:
    """What one step of a group's beam search asks of the queues.

    Attributes:
      done: the search ended (``width`` hypotheses, or no beam left): every
        live beam is finished.
      pruned: beams with no continuation (finished as "pruned").
      forks: ``(parent, child)`` new beams, each sharing its parent's pages.
      num_tokens: tokens generated in the step (beams that go on and
        hypotheses that end).
    """

    done: bool
    pruned: list[Sequence]
    forks: list[tuple[Sequence, Sequence]]
    num_tokens: int


def advance(group: SequenceGroup, live: list[Sequence], stop_ids: frozenset) -> BeamStep:
    """One step of ``group``'s beam search from every live beam's
    candidates (``group.candidates``): keeps finished hypotheses, extends
    the beams that go on (the first continuation of each), creates the
    others as new sequences of the group, and marks the rest finished.
    Changes the group's records only; the caller moves the sequences.

    Returns:
      what the queues must do (:class:`BeamStep`).
    """
    sp = group.request.sampling
    ids = np.stack([group.candidates[s.index].ids for s in live])
    lps = np.stack([group.candidates[s.index].logprobs for s in live])
    group.candidates.clear()
    beams, ended = expand(
        [s.cum_logprob for s in live], ids, lps, width=sp.beam_width, stop_ids=stop_ids,
        at_max_len=live[0].num_generated + 1 >= group.request.max_new_tokens,
    )
    for c in ended:
        out = live[c.parent].tokens[live[c.parent].num_prompt :] + [c.token]
        group.hypotheses.append(BeamHypothesis(score(c.cum_logprob, len(out), sp.length_penalty), out, c.cum_logprob,
                                               c.finish_reason))
    if not beams or len(group.hypotheses) >= sp.beam_width:
        group.beam_done = True
        for seq in live:
            seq.finish("length")
        return BeamStep(done=True, pruned=[], forks=[], num_tokens=len(beams) + len(ended))
    kids: dict[int, list[Continuation]] = {i: [] for i in range(len(live))}
    for c in beams:
        kids[c.parent].append(c)
    pruned = [parent for i, parent in enumerate(live) if not kids[i]]
    for parent in pruned:
        parent.finish("pruned")
    forks = []
    for i, parent in enumerate(live):
        for c in kids[i][1:]:
            child = Sequence(group=group, index=len(group.seqs), tokens=parent.tokens + [c.token],
                             num_prompt=parent.num_prompt, num_computed=parent.num_computed, keys=list(parent.keys),
                             cum_logprob=c.cum_logprob)
            group.seqs.append(child)
            forks.append((parent, child))
        if kids[i]:
            parent.tokens.append(kids[i][0].token)
            parent.cum_logprob = kids[i][0].cum_logprob
    return BeamStep(done=False, pruned=pruned, forks=forks, num_tokens=len(beams) + len(ended))


def best_hypotheses(group: SequenceGroup) -> list[BeamHypothesis]:
    """The group's ``beam_width`` best hypotheses, best first; beams still
    searching when it was aborted count as hypotheses."""
    sp = group.request.sampling
    hyps = group.hypotheses + [
        BeamHypothesis(score(s.cum_logprob, s.num_generated, sp.length_penalty), s.tokens[s.num_prompt :],
                       s.cum_logprob, s.finish_reason)
        for s in group.seqs if s.finish_reason == "abort"
    ]
    return sorted(hyps, key=lambda h: -h.score)[: sp.beam_width]
