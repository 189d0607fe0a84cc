"""One model call's flat token batch: mixed prefill chunks and decode tokens.

The engine packs every token of an iteration into one flat array (vLLM v1's
layout): sequence ``s`` (a page-state row) owns rows ``[q_starts[s],
q_starts[s] + q_lens[s])``, the last ``q_lens[s]`` of its ``kv_lens[s]``
cached tokens. A decoding sequence brings one token, a prefill chunk any
number up to the token budget, a sequence not in the call none. Padding rows
(past the last real token) write nothing and are never read.

Static sizes. ``jit`` compiles one program per distinct :class:`BatchShape`,
and a shape depends only on the number of tokens (rounded up to a power of
two) and on which attention classes the call has: how long the sequences
are is not part of it, because attention walks its work items in a loop
whose trip count is traced (:mod:`paged_jax.attention.ragged`). A serving run
therefore compiles a handful of programs.

Attention work comes in two classes, because their best tiles differ
(measured on CPU, SmolLM2 heads; see ``Tiling``): sequences with one query
token (decode) use one-token tiles, so no flops go to padding rows; longer
chunks use ``prefill_tile_q``-token tiles, whose matmuls are large enough to
run efficiently.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from paged_jax.checks import check_instance, check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling:
    """How attention cuts a flat batch into work (static).

    Attributes:
      prefill_tile_q: query tokens per tile of a prefill chunk.
      decode_pages_per_block, prefill_pages_per_block: pages per work item.
      decode_work_chunk, prefill_work_chunk: work items per loop step (the
        decode step is capped at the call's decode tiles: a small batch
        should not pad its few items to a large step).
      max_prefill_chunks: prefill chunks one call may carry (bounds the
        number of prefill tiles, which every loop step rescales).
      min_tokens: smallest token bucket.

    Defaults measured on 2 CPU cores (SmolLM2 heads, page size 16, 30
    layers): decode over 38 sequences of 150-400 tokens took 222, 148, 122
    and 130 ms with 1, 2, 4 and 8 pages per item; a 256-token prefill chunk
    at 256 (768) cached tokens took 165 (735), 101 (476) and 95 (411) ms
    with tiles of 16 x 2, 32 x 4 and 64 x 8 (tokens x pages), and eight
    30-token prompts 26, 35 and 108 ms: 32 x 4 is the compromise. With
    32 x 4 tiles, loop steps of 32 decode / 8 prefill items beat 64 / 16 and
    128 / 32 on a mixed call (200-token chunk and 30 decodes: 130 ms against
    203 and 217).
    """

    prefill_tile_q: int = 32
    decode_pages_per_block: int = 4
    prefill_pages_per_block: int = 4
    decode_work_chunk: int = 32
    prefill_work_chunk: int = 8
    max_prefill_chunks: int = 8
    min_tokens: int = 16

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check_int(f.name, getattr(self, f.name))
        if self.min_tokens & (self.min_tokens - 1):
            raise ValueError(f"min_tokens must be a power of two, got min_tokens={self.min_tokens}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchShape:
    """The static sizes of one flat batch (each distinct value is one
    compiled program).

    Attributes:
      num_tokens: T, rows of the flat token array.
      num_logits: R, rows whose logits the call samples from (a row may be
        returned more than once: parallel samples of one prompt).
      num_prompt_logits: P, rows whose logits score prompt tokens
        (``SamplingParams.prompt_logprobs``), returned after the R; 0 in a
        call without any, whose shape (and program) is then as if the
        feature did not exist.
      num_verify_logits: V, rows whose logits verify a proposed token
        (speculative decoding: a row of a sequence's chunk judges the
        proposal after it), returned after the P; 0 in a call without
        any.
      decode_tiles: tiles of the one-token class (0: the call has none).
      prefill_tiles: tiles of the chunk class (0: none).
      tiling: the tile and block sizes.
    """

    num_tokens: int
    num_logits: int
    num_prompt_logits: int = 0
    num_verify_logits: int = 0
    decode_tiles: int = 0
    prefill_tiles: int = 0
    tiling: Tiling = Tiling()

    def __post_init__(self):
        check_int("num_tokens", self.num_tokens)
        check_int("num_logits", self.num_logits)
        check_int("num_prompt_logits", self.num_prompt_logits, 0)
        check_int("num_verify_logits", self.num_verify_logits, 0)
        check_int("decode_tiles", self.decode_tiles, 0)
        check_int("prefill_tiles", self.prefill_tiles, 0)
        check_instance("tiling", self.tiling, Tiling)


@struct.dataclass
class RaggedBatch:
    """A flat batch of query tokens and the metadata attention needs.

    Attributes:
      tokens: i32[T] token ids; padding rows hold any valid id.
      positions: i32[T] each token's position in its sequence.
      slots: i32[G * T] flat KV slot (``page * page_size + offset``) each token's
        K/V is written to, group after group (:mod:`paged_jax.paging.kv_groups`;
        ``G = 1`` for a model with one kind of layer); -1 for padding
        (dropped).
      block_tables: i32[G * S, pages_per_seq] every sequence row's pages,
        group after group (row ``group * S + s``).
      q_starts: i32[S] first flat row of each sequence's tokens.
      q_lens: i32[S] tokens each sequence brings (0: not in this call).
      kv_lens: i32[S] tokens each sequence holds after this call.
      logits_rows: i32[R + P + V] flat rows whose logits are returned: one
        per sequence that samples, then ``shape.num_prompt_logits`` rows
        that score prompt tokens, then ``shape.num_verify_logits`` rows
        that verify proposed tokens (padding entries point at row 0).
      shape: the static sizes.
    """

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slots: jax.Array  # i32[G * T]
    block_tables: jax.Array  # i32[G * S, pages_per_seq]
    q_starts: jax.Array  # i32[S]
    q_lens: jax.Array  # i32[S]
    kv_lens: jax.Array  # i32[S]
    logits_rows: jax.Array  # i32[R + P + V]
    shape: BatchShape = struct.field(pytree_node=False)

    @property
    def num_groups(self) -> int:
        """``G``, block tables per sequence (layer groups, :mod:`paged_jax.paging.kv_groups`)."""
        return self.block_tables.shape[0] // self.q_starts.shape[0]

    def group(self, g) -> "RaggedBatch":
        """Layer group ``g``'s view (int or traced i32[]): its block
        tables i32[S, pages_per_seq] and slots i32[T], the rest shared."""
        G = self.num_groups
        if G == 1:
            return self
        S, T = self.q_starts.shape[0], self.tokens.shape[0]
        return self.replace(block_tables=self.block_tables.reshape(G, S, -1)[g], slots=self.slots.reshape(G, T)[g])


def batch_shape(q_lens, *, num_seq_rows: int, tiling: Tiling = Tiling(), num_samples: int = 0,
                num_prompt_rows: int = 0, num_verify_rows: int = 0) -> BatchShape:
    """The bucketed static sizes for a flat batch whose sequences bring
    ``q_lens`` tokens.

    Tokens round up to a power of two (at least ``tiling.min_tokens``);
    logits rows to ``min(tokens, num_seq_rows)``, doubled until they hold
    ``num_samples`` (capped at ``num_seq_rows``); prompt-scoring rows, when
    any, to a power of two (at least ``tiling.min_tokens``, at most the
    tokens); verification rows, when any, to a power of two (at least 4:
    a sequence proposes a few tokens, and every row costs the output
    projection); tiles follow from the tokens: one per decode sequence, and for
    chunks ``tokens / tile`` plus one partial tile per chunk.

    Args:
      q_lens: i32[S] tokens each sequence brings.
      num_seq_rows: S, rows of the page state.
      tiling: tile and block sizes.
      num_samples: tokens the call samples (one per sampling sequence row,
        parallel samples forked in the call included), <= ``num_seq_rows``.
      num_prompt_rows: token rows whose logits score a prompt token, at
        most the call's tokens.
      num_verify_rows: token rows whose logits verify a proposed token, at
        most the call's tokens.

    Raises:
      ValueError: ``q_lens`` not a 1-D array of integers >= 0 with at most
        ``num_seq_rows`` entries; more than ``tiling.max_prefill_chunks``
        chunks of 2 or more tokens; no token at all; more tokens than int32
        positions can index; ``num_samples`` outside ``[0, num_seq_rows]``;
        ``num_prompt_rows`` or ``num_verify_rows`` outside ``[0, tokens]``.
    """
    check_int("num_seq_rows", num_seq_rows)
    check_int("num_samples", num_samples, 0)
    check_int("num_prompt_rows", num_prompt_rows, 0)
    check_int("num_verify_rows", num_verify_rows, 0)
    if num_samples > num_seq_rows:
        raise ValueError(f"num_samples={num_samples} exceeds num_seq_rows={num_seq_rows}")
    check_instance("tiling", tiling, Tiling)
    q_lens = np.asarray(q_lens)
    if q_lens.ndim != 1 or not (np.issubdtype(q_lens.dtype, np.integer) or q_lens.size == 0):
        raise ValueError(f"q_lens must be a 1-D array of integers, got shape {q_lens.shape} dtype {q_lens.dtype}")
    if len(q_lens) > num_seq_rows:
        raise ValueError(f"q_lens has {len(q_lens)} entries, more than num_seq_rows={num_seq_rows}")
    if (q_lens < 0).any():
        raise ValueError(f"q_lens must be >= 0, got {q_lens.tolist()}")
    q_lens = q_lens.astype(np.int64)
    total = int(q_lens.sum())
    if total >= 2**31 // 2:
        raise ValueError(f"q_lens sum to {total} tokens, more than a call can index (int32)")
    if total < 1:
        raise ValueError("a batch needs at least one token, got q_lens summing to 0")
    chunks = int((q_lens > 1).sum())
    if chunks > tiling.max_prefill_chunks:
        raise ValueError(f"a batch carries at most max_prefill_chunks={tiling.max_prefill_chunks} chunks, got {chunks}")
    num_tokens = tiling.min_tokens
    while num_tokens < total:
        num_tokens *= 2
    rows = min(num_tokens, num_seq_rows)
    while rows < num_samples:
        rows = min(2 * rows, num_seq_rows)
    if num_prompt_rows > total:
        raise ValueError(f"num_prompt_rows={num_prompt_rows} exceeds the {total} tokens of q_lens")
    prompt_rows = min(tiling.min_tokens, num_tokens) if num_prompt_rows else 0
    while prompt_rows < num_prompt_rows:
        prompt_rows *= 2
    if num_verify_rows > total:
        raise ValueError(f"num_verify_rows={num_verify_rows} exceeds the {total} tokens of q_lens")
    verify_rows = 4 if num_verify_rows else 0
    while verify_rows < num_verify_rows:
        verify_rows *= 2
    return BatchShape(
        num_tokens=num_tokens,
        num_logits=rows,
        num_prompt_logits=prompt_rows,
        num_verify_logits=verify_rows,
        decode_tiles=rows if (q_lens == 1).any() else 0,
        prefill_tiles=(num_tokens // tiling.prefill_tile_q + tiling.max_prefill_chunks) if chunks else 0,
        tiling=tiling,
    )
