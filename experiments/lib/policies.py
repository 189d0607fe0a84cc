"""The serving comparison's policies: a KV reservation policy
(``EngineConfig.reservation``, paper section 6.1), the allocator that
places its reservations (``EngineConfig.allocator``), and optionally
automatic prefix caching turned off.

A policy name is ``<reservation>[-<allocator>][-nocache]``:

- the reservation (:data:`POLICIES`): ``paged`` is vLLM; ``max``, ``pow2``
  and ``oracle`` the paper's Orca baselines, each reservation one run
  placed by the buddy allocator, as the paper built them;
- an allocator suffix, for the Orca policies only (:data:`ALLOCATOR_SUFFIXES`):
  ``-firstfit`` places exact runs first fit; ``-pages`` makes a reservation
  a count of pages (no external fragmentation, no rounding: the kinder
  Orca this project ran before it had the paper's allocator);
- :data:`NO_CACHE`: always serves without the prefix cache (otherwise the
  comparison's prefix-caching setting holds: on unless
  ``--no-prefix-caching``). The paper's Figure 16 needs both in one sweep:
  vLLM sharing the few-shot prefix against Orca-Oracle, which shares
  nothing; ``paged-nocache`` separates what paging gains from what sharing
  gains.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from paged_jax.checks import check_int
from paged_jax.engine.config import RESERVATIONS, reserved_tokens
from paged_jax.paging.page_state import pages_for_tokens

POLICIES = RESERVATIONS
"""The reservation policies: ``paged``, ``max``, ``pow2``, ``oracle``."""
NO_CACHE = "-nocache"
"""Appended to a policy: the same policy without prefix caching."""
ALLOCATOR_SUFFIXES = {"": "buddy", "-firstfit": "first_fit", "-pages": "pages"}
"""A policy name's allocator suffix -> ``EngineConfig.allocator`` (Orca only)."""
_BASE_LABELS = {"paged": "paged (vLLM)", "max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}
_ALLOCATOR_LABELS = {"": "", "-firstfit": ", first fit", "-pages": ", page-backed"}
_BASES = {"paged": ("paged", None, _BASE_LABELS["paged"]), **{
    r + suffix: (r, allocator, _BASE_LABELS[r] + _ALLOCATOR_LABELS[suffix])
    for r in POLICIES if r != "paged" for suffix, allocator in ALLOCATOR_SUFFIXES.items()}}
ALL_POLICIES = tuple(_BASES) + tuple(p + NO_CACHE for p in _BASES)
"""Every policy name a comparison accepts."""
POLICY_LABELS = {**{p: label for p, (_, _, label) in _BASES.items()},
                 **{p + NO_CACHE: f"{label}, no prefix cache" for p, (_, _, label) in _BASES.items()}}
"""Each policy's name in tables and plots (the paper's names for the
reservation policies)."""


PAPER_FIG12 = {"oracle": "1.7-2.7x", "max": "2.7-8x", "pow2": "-"}
"""Paper section 6.2, ShareGPT: how much higher a request rate vLLM sustains
than each baseline at similar latency (the text gives no Pow2 range)."""
PAPER_FIG13 = {"max": 7.00, "pow2": 9.81, "oracle": 13.62, "paged": 30.42}
"""Paper Figure 13, ShareGPT at 2 requests/s with OPT-13B: mean batched
requests per policy, as read from the figure's bars."""
PAPER_OVER_ORACLE = {"basic": 1.3, "beam-6": 2.3}
"""Section 6.3: vLLM's improvement over Orca (Oracle), OPT-13B on Alpaca,
at the two ends the text names (basic sampling, beam search of width 6)."""
PAPER_SAVING = {"parallel": "6.1-9.8% (Alpaca), 16.2-30.5% (ShareGPT)",
                "beam": "37.6-55.2% (Alpaca), 44.3-66.3% (ShareGPT)"}
"""Figure 15 and section 6.3: KV blocks saved by sharing / blocks without
sharing, over the widths 2 to 6."""
PAPER_SAVING_RANGE = {"parallel": (6.1, 9.8, 16.2, 30.5), "beam": (37.6, 55.2, 44.3, 66.3)}
""":data:`PAPER_SAVING` as numbers (%): Alpaca low, high, ShareGPT low, high."""
PAPER_FIG16 = {1: "1.67x", 5: "3.58x"}
"""Paper section 6.4 (LLaMA-13B, WMT16 translation): vLLM's throughput over
Orca-Oracle's with a one-shot and a five-shot prefix shared."""
PAPER_FIG17 = {"max": "2x", "pow2": "2x", "oracle": "2x"}
"""Paper section 6.5 (OPT-13B, ShareGPT chats): vLLM sustains 2x the request
rate of each Orca baseline, whose buddy allocator reserves 1,024 output
tokens whatever the prediction."""


def paper_ratio(workload: str, policy: str) -> str:
    """What the paper says vLLM sustains over ``policy`` on ``workload``
    (a :func:`experiments.lib.workloads.workload` name), as text: Figure 12
    (``basic``), section 6.3 (``beam-6``, on Alpaca), Figure 16 (``prefix-1``,
    ``prefix-5`` against Orca-Oracle without sharing), Figure 17
    (``chatbot``); ``"-"`` where it gives none (paged itself, page-backed
    Orca, which the paper did not run, widths and shots it does not name).

    Raises:
      ValueError: ``policy`` is not one of :data:`ALL_POLICIES`.
    """
    options = engine_options(policy)
    reservation = options["reservation"]
    if reservation == "paged" or options["allocator"] == "pages":
        return "-"
    kind, _, k = workload.partition("-")
    if workload == "basic":
        return PAPER_FIG12.get(reservation, "-")
    if kind in ("parallel", "beam") and reservation == "oracle" and workload in PAPER_OVER_ORACLE:
        return f"{PAPER_OVER_ORACLE[workload]:g}x (Alpaca)"
    if kind == "prefix" and reservation == "oracle" and k.isdigit():
        return PAPER_FIG16.get(int(k), "-")
    if workload == "chatbot":
        return PAPER_FIG17.get(reservation, "-")
    return "-"


def split_policy(policy: str) -> tuple[str, bool]:
    """``(reservation, prefix caching allowed)`` of a policy name:
    ``"oracle-nocache"`` -> ``("oracle", False)``, ``"paged"`` ->
    ``("paged", True)``, ``"max-pages"`` -> ``("max", True)``.

    Raises:
      ValueError: ``policy`` is not one of :data:`ALL_POLICIES`.
    """
    options = engine_options(policy)
    return options["reservation"], options["enable_prefix_caching"]


def engine_options(policy: str) -> dict:
    """The ``EngineConfig`` fields of a policy name: ``reservation``,
    ``allocator`` and ``enable_prefix_caching`` (False for ``-nocache``;
    True means the comparison's own setting holds).

    Raises:
      ValueError: ``policy`` is not one of :data:`ALL_POLICIES`.
    """
    if not isinstance(policy, str) or policy not in ALL_POLICIES:
        raise ValueError(f"policy must be a reservation policy (one of {list(POLICIES)}), for Orca optionally "
                         f"followed by an allocator ({', '.join(repr(s) for s in ALLOCATOR_SUFFIXES if s)}), then "
                         f"optionally by {NO_CACHE!r}, got policy={policy!r}")
    caching = not policy.endswith(NO_CACHE)
    reservation, allocator, _ = _BASES[policy if caching else policy[: -len(NO_CACHE)]]
    return dict(reservation=reservation, allocator=allocator, enable_prefix_caching=caching)


def paging_gain(lengths: Iterable[tuple[int, int]], *, page_size: int = 16, max_seq_len: int = 2048,
                output_cap: int | None = None) -> dict[str, float]:
    """How many more requests paging holds than each reservation policy,
    counted rather than measured: at equal memory and a decode step whose
    time does not grow with the batch (an accelerator's regime), the
    requests a pool holds scale with the inverse of a request's KV
    page-steps (pages held, summed over its decode steps). Paged holds
    ``pages_for_tokens(prompt + t)`` at step ``t``; a reservation policy
    holds its reservation (:func:`paged_jax.engine.config.reserved_tokens`, the
    paper's section 6.1) from the first step.

    Args:
      lengths: ``(prompt tokens, output tokens)`` per request, ints (e.g.
        the packaged ShareGPT requests' columns, or a NumPy array of
        them); a prompt in ``[1, max_seq_len)``, its output cut to fit
        ``max_seq_len``; a request without output tokens holds nothing.
      page_size: tokens per page.
      max_seq_len: Orca-Max's reservation, and every sequence's bound.
      output_cap: outputs capped at this many tokens (None: their full
        lengths).

    Returns:
      ``{policy: its page-steps / paged's}`` for every policy of
      :data:`POLICIES` (``paged``: 1.0).

    Raises:
      ValueError: a length that is not such a pair of ints, a bad
        ``page_size`` / ``max_seq_len`` / ``output_cap``, or no request
        with an output token (naming the argument and its value).
    """
    page_size, max_seq_len = check_int("page_size", page_size), check_int("max_seq_len", max_seq_len, 2)
    if output_cap is not None:
        output_cap = check_int("output_cap", output_cap)
    held = dict.fromkeys(POLICIES, 0)
    for i, pair in enumerate(lengths):
        if not (isinstance(pair, Sequence) or hasattr(pair, "__len__")) or len(pair) != 2:
            raise ValueError(f"lengths[{i}] must be a (prompt tokens, output tokens) pair, got {pair!r}")
        prompt = check_int(f"lengths[{i}] prompt tokens", pair[0], 1, max_seq_len)  # room for one output token
        out = check_int(f"lengths[{i}] output tokens", pair[1], 0)
        out = min(out if output_cap is None else min(out, output_cap), max_seq_len - prompt)
        if out < 1:  # no output: nothing held while decoding
            continue
        for policy in POLICIES:
            if policy == "paged":
                held[policy] += sum(pages_for_tokens(prompt + t, page_size) for t in range(1, out + 1))
            else:
                held[policy] += out * pages_for_tokens(reserved_tokens(policy, prompt, out, max_seq_len), page_size)
    if not held["paged"]:
        raise ValueError("lengths must hold at least one request with an output token")
    return {policy: held[policy] / held["paged"] for policy in POLICIES}
