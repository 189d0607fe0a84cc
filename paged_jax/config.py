"""The engine's configuration: scheduler limits, the preemption mode, prefix
caching and the contiguous baseline (:class:`paged_jax.engine.Engine`).

Contiguous baseline: with ``reserve_max_len=True`` every request reserves
``max_seq_len`` slots when admitted, as pre-paging servers reserved a
request's maximum length (PagedAttention, Kwon et al., SOSP 2023, section
3). The reservation is backed by pages, which removes external
fragmentation, so the comparison *understates* what paging gains over a
truly contiguous allocator. Attention work is the same in both modes: it is
bounded by each sequence's length, not by its reservation.
"""

from __future__ import annotations

import dataclasses

from paged_jax.batch import Tiling
from paged_jax.checks import check_bool, check_choice, check_instance, check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Scheduler limits.

    Attributes:
      max_seqs: most sequences running at once, >= 1.
      max_seq_len: most tokens per sequence, prompt plus output, >= 1.
      max_num_batched_tokens: tokens per model call, decode tokens and
        prefill chunks together (the token budget of chunked prefill);
        >= ``max_seqs`` so every running sequence can decode in one call.
      reserve_max_len: reserve ``max_seq_len`` slots per request at admission
        (the contiguous baseline) instead of paging on demand.
      tiling: how attention cuts a call into work, and how many prefill
        chunks one call carries (:class:`paged_jax.batch.Tiling`).
      async_scheduling: schedule and dispatch iteration ``i + 1`` before
        reading iteration ``i``'s sampled tokens (they reach ``i + 1``'s
        input on device), so the host's work overlaps the device's, as in
        vLLM's async scheduling. A sequence that stops on a stop token then
        computes one token more, which is discarded. Outputs are the same
        either way.
      enable_prefix_caching: keep full pages keyed by their tokens after
        their sequence ends, and let a new (or recomputed) sequence whose
        first pages equal them take them instead of prefilling
        (:mod:`paged_jax.prefix_cache`).
      preemption_mode: "recompute" (free a preempted group's pages and
        prefill its tokens again when resumed) or "swap" (copy its pages to
        host memory and back, :mod:`paged_jax.swap`; paper section 4.5). A
        group that does not fit in the swap space is recomputed.
      swap_space_pages: pages the swap space holds; default as many as the
        KV pool's usable pages.
    """

    max_seqs: int = 64
    max_seq_len: int = 2048
    max_num_batched_tokens: int = 256
    reserve_max_len: bool = False
    tiling: Tiling = Tiling()
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_pages: int | None = None

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "max_num_batched_tokens"):
            check_int(name, getattr(self, name))
        check_instance("tiling", self.tiling, Tiling, what="paged_jax.batch.Tiling")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_seqs (every running sequence decodes in each call), "
                f"got max_num_batched_tokens={self.max_num_batched_tokens} max_seqs={self.max_seqs}"
            )
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        if self.swap_space_pages is not None:
            check_int("swap_space_pages", self.swap_space_pages, 0)
        for name in ("reserve_max_len", "async_scheduling", "enable_prefix_caching"):
            check_bool(name, getattr(self, name))
