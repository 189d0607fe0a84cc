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
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


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
    cum_logprobs: Sequence[float],
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
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width=}")
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
