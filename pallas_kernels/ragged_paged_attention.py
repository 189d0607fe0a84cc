"""Ragged paged attention: one kernel call for a mixed batch of prefilling and
decoding sequences, causal within each sequence.

The batch is "padded ragged" (``pallas_kernels.common``): ``q`` is ``[B, T,
N, H]`` and sequence ``b`` uses its first ``q_lens[b]`` rows, the last
``q_lens[b]`` of its ``kv_lens[b]`` cached tokens. A decoding sequence has
``q_lens = 1``, a prefilling one ``q_lens = kv_lens``, a chunk of a chunked
prefill anything in between.

The kernel is the GPU kernel of ``pallas_kernels.paged_attention_gpu`` (Triton
lowering) with a query-block grid axis: grid ``(B, K, cdiv(T, block_q),
1)``; a program attends ``block_q`` query tokens times the ``G`` heads of one
KV group over the pages those tokens can see (causal limit, length, sliding
window) and nothing else. Query blocks past ``q_lens[b]`` exit at once, so a
decoding sequence padded to ``T`` rows costs one program per KV head.

Sources: PagedAttention (Kwon et al., SOSP 2023); the ragged batches of vLLM
v1 and JAX's TPU ``ragged_paged_attention`` (which packs tokens instead of
padding them; padded rows keep this kernel's indexing static).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels import common
from pallas_kernels.paged_attention_gpu import flash_paged_call


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedBlockSizes:
    """Tiling of :func:`ragged_paged_attention`.

    Attributes:
      block_q: query tokens per program (power of two); with the padded
        query group ``G_pad`` a program holds ``block_q * G_pad`` rows.
      pages_per_compute_block: pages per loop step (power of two).
      num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 16
    pages_per_compute_block: int = 4
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        common.check_block_sizes(
            self,
            positive=("block_q", "pages_per_compute_block", "num_warps", "num_stages"),
            pow2=("block_q", "pages_per_compute_block"),
        )

    def check_page_size(self, page_size: int) -> None:
        """Raises ValueError unless ``pages_per_compute_block * page_size`` is
        a power of two >= 16 (Triton tiles)."""
        keys = self.pages_per_compute_block * page_size
        if keys < 16 or keys & (keys - 1):
            raise ValueError(
                "pages_per_compute_block * page_size must be a power of two >= 16 (Triton tiles), got "
                f"{self.pages_per_compute_block} * {page_size} = {keys}"
            )


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_sizes", "interpret")
)
def _ragged(q, k_pages, v_pages, layer, block_tables, kv_lens, q_lens, k_scales, v_scales, *,
            scale, soft_cap, sliding_window, block_sizes, interpret):
    return flash_paged_call(
        q, k_pages, v_pages, layer, block_tables, kv_lens, q_lens, k_scales, v_scales,
        block_q=min(block_sizes.block_q, 1 << (q.shape[1] - 1).bit_length()),
        pages_per_compute_block=block_sizes.pages_per_compute_block,
        k_splits=1,
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret,
    )


def ragged_paged_attention(
    q: jax.Array,  # [B, T, N, H] float
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [K, P, L, H] same dtype as k_pages
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    k_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    v_scales: jax.Array | None = None,  # f32[K, P, L] with quantized pages
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: RaggedBlockSizes = RaggedBlockSizes(),
    interpret: bool | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Causal GQA paged attention for a mixed prefill/decode batch.

    Args:
      q: [B, T, N, H] unscaled queries; rows ``t >= q_lens[b]`` are padding.
      k_pages, v_pages: [K, P, L, H] one layer's pages (query tokens' K/V
        already written), float or quantized; or, with ``layer``, the stacked
        pool [layers, K, P, L, H], read in place.
      block_tables: i32[B, pages_per_seq] page ids; entries past a
        sequence's length may be any valid page id.
      kv_lens: i32[B] cached tokens per sequence, query tokens included
        (``<= pages_per_seq * L``).
      q_lens: i32[B] query tokens per sequence, ``0 <= q_lens <= min(T,
        kv_lens)``.
      k_scales, v_scales: f32[K, P, L] per-token scales for quantized pages
        (f32[layers, K, P, L] with ``layer``).
      scale, soft_cap, sliding_window: as in ``pallas_kernels.common``.
      block_sizes: tiling; ``block_q`` is capped at ``T`` rounded up to a
        power of two.
      interpret: Pallas interpret mode; default: unless running on a GPU.
      layer: the layer of a stacked pool (integer scalar, traced or not);
        None for one layer's pages.

    Returns:
      [B, T, N, H] in ``q.dtype``; zeros for padding rows and for sequences
      with ``kv_lens = 0``, non-finite where a logit or value a row sees is.

    Raises:
      ValueError: inputs failing ``common.validate_inputs`` /
        ``common.validate_options``, a page size that does not tile, or
        (eager) lengths past a row's table or a layer outside the pool.
    """
    common.validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, layer)
    common.validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    block_sizes.check_page_size(k_pages.shape[-2])
    kv_lens, q_lens = common.checked_lengths(block_tables, k_pages.shape[-3], k_pages.shape[-2], kv_lens, q_lens, q.shape[1])
    layer = None if layer is None else common.checked_layer(layer, k_pages.shape[0])[0]
    return unchecked_ragged_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, block_sizes=block_sizes, interpret=interpret, layer=layer,
    )


def unchecked_ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales=None,
                                     v_scales=None, *, scale=None, soft_cap=None, sliding_window=None,
                                     block_sizes: RaggedBlockSizes = RaggedBlockSizes(), interpret=None,
                                     layer=None) -> jax.Array:
    """:func:`ragged_paged_attention` trusting its inputs: no check, and no
    clamp of lengths or layer. For callers that validated at their door
    (``paged_jax.attention.paged.paged_attention``); same arguments and result."""
    layer_index = common.layer_index(layer)
    k_pages, v_pages, k_scales, v_scales = common.stack_layer(k_pages, v_pages, k_scales, v_scales, layer=layer)
    return _ragged(
        q, k_pages, v_pages, layer_index, block_tables, kv_lens, q_lens, k_scales, v_scales,
        scale=common.resolve_scale(scale, q.shape[-1]), soft_cap=soft_cap, sliding_window=sliding_window,
        block_sizes=block_sizes, interpret=common.interpret_default(interpret, "gpu"),
    )


def ref_ragged_paged_attention(
    q: jax.Array,  # [B, T, N, H] float
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    k_scales: jax.Array | None = None,  # f32[K, P, L]
    v_scales: jax.Array | None = None,  # f32[K, P, L]
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    **unused_kernel_options,
) -> jax.Array:
    """The truth for :func:`ragged_paged_attention`: a per-sequence loop of
    plain causal attention over each sequence's owned slots
    (``common.ref_ragged_loop``). Same arguments and result; kernel-only
    options ignored. Not jittable.

    Raises:
      ValueError: as the kernel, and lengths out of range.
    """
    common.validate_inputs(q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales, layer)
    common.validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return common.ref_ragged_loop(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, k_scales, v_scales,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, layer=layer,
    )
