"""One iteration's device work, as one jitted program: drop (pages a
sliding window no longer sees), free, share, fork, grow (copy-on-write
included), forward over the flat batch, sample (and score prompt tokens,
:mod:`paged_jax.engine.prompt_logprobs`).

The engine (:mod:`paged_jax.engine.core`) plans an iteration on the host and
calls :func:`device_step` once; the model is anything with the
:class:`PagedModel` protocol (``models.ragged.RaggedModel``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax.attention.batch import BatchShape, RaggedBatch
from paged_jax.checks import check_int
from paged_jax.engine.sampling import greedy, sample, verify_proposals
from paged_jax.paging import page_state as ps
from paged_jax.paging.kv_cache import KVPool, copy_pages
from paged_jax.paging.kv_groups import KVGroups, single_group
from paged_jax.paging.sliding_window import unchecked_drop_pages_before
from paged_jax.paging.slots import flat_slot_mapping


class PagedModel(Protocol):
    """What the engine needs of a model.

    Attributes (``kv_window`` and ``kv_groups`` optional):
      params: the weights, a pytree (an argument of the jitted step, never a
        constant folded into it).
      vocab_size: tokens in the vocabulary (prompt ids are checked against
        it).
      kv_window: tokens every layer attends, or None (absent: None) when
        some layer attends all; the engine then drops pages out of the
        window while sequences run (:mod:`paged_jax.paging.sliding_window`).
      kv_groups: the layer groups (:class:`paged_jax.paging.kv_groups.KVGroups`)
        of a model that mixes kinds of layer: with a pool of
        ``kv_groups.group_size`` layers the engine keeps a block table per
        group and drops each sliding group's pages out of its window;
        ``apply`` then takes block tables and slots for every group
        (:class:`paged_jax.attention.batch.RaggedBatch`). Absent: one group.
      apply: ``apply(params, batch: RaggedBatch, kv: KVPool) -> (logits, kv)``,
        logits ``f32[R + P, V]`` at ``batch.logits_rows``; pure and jittable, writing
        the batch's K/V at ``batch.slots`` (``models.ragged.RaggedModel``).
        It may return ``(logits, kv, finite)`` with ``finite`` bool[T]
        whether each token's forward stayed finite (the decoder does: its
        final hidden state, which any non-finite K or V of the token
        reaches); without it the engine reads the K/V the call wrote back
        from the pool's last layer, which a TPU may have to relayout the
        whole pool for (:func:`_finite_writes`).
    """

    params: Any
    vocab_size: int

    def apply(self, params, batch: RaggedBatch, kv: KVPool) -> tuple: ...


def check_model(model, kv_pool: KVPool, vocab_size: int | None) -> int | None:
    """Checks that ``model`` is a :class:`PagedModel` that fits ``kv_pool``
    (its ``check_kv_pool(pool)``, if it has one), that its ``kv_window``
    (if any) is None or an int >= 1, and that ``vocab_size``
    does not exceed its vocabulary. Returns the vocabulary size prompt ids
    are checked against: ``vocab_size``, or the model's when None.

    Raises:
      ValueError: naming what is wrong.
    """
    if not (hasattr(model, "params") and callable(getattr(model, "apply", None))):
        raise ValueError(f"model must have params and apply(params, batch, kv) (a PagedModel such as "
                         f"models.ragged.RaggedModel), got a {type(model).__name__}")
    model_vocab = getattr(model, "vocab_size", None)
    if vocab_size is None:
        vocab_size = model_vocab
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size)
        if model_vocab is not None and vocab_size > model_vocab:
            # An id past the embedding would be clamped by the lookup: a silent wrong token.
            raise ValueError(f"vocab_size={vocab_size} exceeds the model's vocabulary of {model_vocab} tokens")
    window = getattr(model, "kv_window", None)
    if window is not None and (type(window) is not int or window < 1):  # the attention takes Python ints only
        raise ValueError(f"model.kv_window must be None or an int >= 1 (tokens every layer attends), got {window!r}")
    groups = getattr(model, "kv_groups", None)
    if groups is not None and not isinstance(groups, KVGroups):
        raise ValueError(f"model.kv_groups must be None or a paged_jax.paging.kv_groups.KVGroups, got {groups!r:.80}")
    if getattr(model, "check_kv_pool", None) is not None:
        model.check_kv_pool(kv_pool)
    return vocab_size


def engine_kv_groups(model, kv_pool: KVPool, drop_out_of_window_pages: bool) -> KVGroups:
    """The layer groups an engine keeps block tables for (the model is
    checked by :func:`check_model`).

    - a model with ``kv_groups`` and a pool of ``kv_groups.group_size``
      layers: those groups (a sliding group drops its pages out of its
      window);
    - a pool of every layer (``kv_pool.num_layers`` = the model's layers),
      or ``drop_out_of_window_pages=False``: one group of every layer,
      attending its ``kv_window`` when every layer slides and drops are on,
      else keeping every page (a hybrid model kept whole: the layout before
      layer groups).

    Raises:
      ValueError: a hybrid model's pool of ``group_size`` layers with
        ``drop_out_of_window_pages=False`` (one table cannot serve several
        groups), or a pool that is neither ``group_size`` nor every layer.
    """
    groups = getattr(model, "kv_groups", None)
    window = getattr(model, "kv_window", None) if drop_out_of_window_pages else None
    layers = kv_pool.num_layers
    if groups is None or groups.num_groups == 1:
        return single_group(layers, window if groups is None else groups.uniform_window if drop_out_of_window_pages
                            else None)
    if layers == groups.group_size and layers != groups.num_layers:
        if not drop_out_of_window_pages:
            raise ValueError(f"a pool of group_size={groups.group_size} layers holds {groups.num_groups} layer groups; "
                             f"drop_out_of_window_pages=False keeps one table: give a pool of every layer "
                             f"({groups.num_layers})")
        return groups
    if layers == groups.num_layers:
        return single_group(layers)
    raise ValueError(f"kv_pool has {layers} layers: expected the model's {groups.num_layers} (every page kept) or "
                     f"its group_size={groups.group_size} (a block table per layer group)")


@struct.dataclass
class StepInputs:
    """Host-built arrays of one call (numpy; :func:`paged_jax.engine.input_builder.build_step_inputs`),
    a pytree handed to the jitted step as is. ``S`` sequence slots, ``G``
    layer groups (:mod:`paged_jax.paging.kv_groups`; the page state has ``G * S``
    rows, row ``group * S + slot``: the page-state fields are per row, the
    others per slot, and the step applies a slot's growth and forks to its
    ``G`` rows), ``T`` tokens, ``R`` sampling logits rows, ``P`` prompt-scoring logits rows
    (``BatchShape.num_prompt_logits``, 0 in most calls), ``V`` rows that verify
    proposed tokens (``BatchShape.num_verify_logits``, 0 without speculative decoding)."""

    first_kept: np.ndarray  # i32[G * S] block-table columns each page-state row drops below first (a sliding window's)
    free_mask: np.ndarray  # bool[G * S] rows to free before growing
    num_hit: np.ndarray  # i32[G * S] pages an empty row takes (a prefix-cache hit or a swap-in)
    hit_pages: np.ndarray  # i32[G * S, max_pages_per_seq] their ids
    hit_tokens: np.ndarray  # i32[G * S] tokens they hold
    num_new: np.ndarray  # i32[S] tokens each slot grows by (its chunk, less the tokens its shared pages hold ahead)
    q_lens: np.ndarray  # i32[S] tokens each slot computes in the call
    min_pages: np.ndarray  # i32[G * S]
    fork_pre: np.ndarray  # i32[S] slot each empty slot forks from before growing (beam search), -1 none
    fork_src: np.ndarray  # i32[S] slot each empty slot forks from after growing (parallel samples), -1 none
    tokens: np.ndarray  # i32[T]
    from_prev: np.ndarray  # bool[T] token is the previous call's sample for its row
    positions: np.ndarray  # i32[T]
    token_rows: np.ndarray  # i32[T] page-state row of each token, -1 padding
    q_starts: np.ndarray  # i32[S]
    logits_rows: np.ndarray  # i32[R]
    logits_slots: np.ndarray  # i32[R] page-state row of each sampled token, -1 none
    temperature: np.ndarray  # f32[R]
    top_p: np.ndarray  # f32[R]
    seeds: np.ndarray  # u32[R]
    streams: np.ndarray  # i32[R] sample index within the request
    steps: np.ndarray  # i32[R]
    prompt_rows: np.ndarray  # i32[P] flat row whose logits score a prompt token (padding: row 0)
    prompt_targets: np.ndarray  # i32[P] the prompt token each scores (the one after its row's)
    verify_rows: np.ndarray  # i32[V] flat row whose logits judge a proposed token (padding: row 0)
    verify_proposals: np.ndarray  # i32[V] the proposed token each judges (the one after its row's)
    verify_params: np.ndarray  # i32[V] the sampling row (of the R) whose temperature, top-p, seed and stream it uses
    verify_steps: np.ndarray  # i32[V] the generated-token index it decides (its random stream's step)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """:func:`device_step`'s static arguments besides the model and the
    shape: each distinct value, with the shape, is one program.

    Attributes:
      greedy_only: no row samples (argmax only).
      top_k: most likely tokens reported per sampling row (twice the
        widest beam, or the most ``SamplingParams.logprobs`` asked), a
        power of two or 0.
      logprobs: some row reports its sampled token's log-probability.
      prompt_top_k: most likely tokens reported per prompt-scoring row (the
        most ``SamplingParams.prompt_logprobs`` asked), a power of two or 0.
    """

    greedy_only: bool = True
    top_k: int = 0
    logprobs: bool = False
    prompt_top_k: int = 0


_TRACES: collections.Counter = collections.Counter()  # id(model) -> traces of device_step


@functools.partial(jax.jit, static_argnames=("model", "shape", "greedy_only", "top_k", "logprobs", "prompt_top_k"),
                   donate_argnums=(2, 3))
def device_step(model, params, state: ps.PageState, kv: KVPool, prev: jax.Array, inp: StepInputs, *, shape: BatchShape,
                 greedy_only: bool, top_k: int, logprobs: bool = False, prompt_top_k: int = 0):
    """Drop, free, share, grow, fork, forward, sample: one iteration's device work, one program
    per (model, shape, greedy_only, top_k, logprobs, prompt_top_k). ``prev``: i32[S] the
    previous call's sampled token per page-state row (inputs marked
    ``from_prev`` take it; a row whose logits are not finite samples -1 and
    gets NaN log-probs, which the engine refuses).

    Log-probabilities are the float32 log-softmax of the model's logits,
    before temperature or top-p (what vLLM reports by default).

    Prompt tokens are scored from ``shape.num_prompt_logits`` extra logits
    rows (``inp.prompt_rows``), computed by the same forward; a call
    without any (P = 0) traces none of it. Proposed tokens (speculative
    decoding) are judged from ``shape.num_verify_logits`` more
    (:func:`paged_jax.engine.sampling.verify_proposals`; V = 0: none traced).

    Every token the call computes is checked: ``kv_ok`` says, per sequence
    slot, whether all of its tokens' forwards stayed finite (the model's
    report, else the K/V read back from the pool, :class:`PagedModel`). A
    non-finite K or V is poison that outlives its request once its page is
    cached, and that no sampled row need ever see (a prefill chunk that
    does not end its prompt; a position out of every later row's sliding
    window): the host stops the request and keeps its pages out of the
    prefix cache.

    Returns:
      ``(state, kv, sampled, (top_ids, top_logprobs), sampled_logprob,
      prompt, verify, ok, num_free_pages, kv_ok)``: ``kv_ok`` bool[S] per sequence
      slot (True for a slot with no token in the call); ``sampled`` i32[S] per row; the ``k =
      min(top_k, V)`` most likely tokens per row, i32[S, k] and f32[S, k]
      (beam search and ``SamplingParams.logprobs``); ``sampled_logprob``
      f32[S] the sampled token's log-probability per row (zeros unless
      ``logprobs``); ``prompt``: None when P = 0, else ``(f32[P] each
      prompt row's target log-probability, i32[P, kp] and f32[P, kp] its
      ``kp = min(prompt_top_k, V)`` most likely tokens)``; ``verify``:
      None when no row verifies, else ``(bool[V] each proposal accepted,
      i32[V] each row's own token)``, a row whose logits are not finite
      rejecting with token -1.
    """
    _TRACES[id(model)] += 1  # runs at trace time only
    state = jax.lax.cond(jnp.any(inp.first_kept > 0), unchecked_drop_pages_before, lambda st, f: st, state,
                         inp.first_kept)
    S = inp.q_lens.shape[0]
    G = state.max_seqs // S  # layer groups: a slot's growth and forks apply to its G rows
    state = ps.unchecked_free(state, inp.free_mask)
    state, hit_ok = jax.lax.cond(
        jnp.any(inp.num_hit > 0), ps.unchecked_share, lambda st, n, p, t: (st, jnp.bool_(True)), state, inp.num_hit,
        inp.hit_pages, inp.hit_tokens,
    )
    no_fork = lambda st, f: (st, jnp.bool_(True))  # noqa: E731
    fork_pre, fork_src = _group_rows(inp.fork_pre, G, S), _group_rows(inp.fork_src, G, S)
    state, pre_ok = jax.lax.cond(jnp.any(inp.fork_pre >= 0), ps.unchecked_fork_many, no_fork, state, fork_pre)
    state, ok, cow_src, cow_dst = ps.unchecked_extend(state, jnp.tile(inp.num_new, G), inp.min_pages)
    state, fork_ok = jax.lax.cond(jnp.any(inp.fork_src >= 0), ps.unchecked_fork_many, no_fork, state, fork_src)
    ok &= hit_ok & pre_ok & fork_ok
    # Copy-on-write copies are rare: skip the pool-wide gather when none.
    kv = jax.lax.cond(jnp.any(cow_src != ps.NO_PAGE), copy_pages, lambda kv, s, d: kv, kv, cow_src, cow_dst)
    rows, positions = inp.token_rows, inp.positions
    P = shape.num_prompt_logits
    slots = flat_slot_mapping(state.block_tables, _group_rows(rows, G, S), jnp.tile(positions, G),
                              page_size=state.page_size)  # [G * T]
    tokens = jnp.where(inp.from_prev, prev[jnp.clip(rows, 0, prev.shape[0] - 1)], inp.tokens)
    batch = RaggedBatch(
        tokens=tokens,
        positions=positions,
        slots=slots,
        block_tables=state.block_tables,
        q_starts=inp.q_starts,
        q_lens=inp.q_lens,
        kv_lens=state.seq_lens[:S],  # a slot's G rows hold the same tokens
        logits_rows=jnp.concatenate([inp.logits_rows] + ([inp.prompt_rows] if P else [])
                                    + ([inp.verify_rows] if shape.num_verify_logits else [])),
        shape=shape,
    )
    out = model.apply(params, batch, kv)  # logits [R + P + V, vocab], kv(, finite [T])
    if len(out) == 3:
        logits, kv, finite_tokens = out
        kv_ok = _per_slot(finite_tokens | (rows < 0), rows, S)
    else:
        logits, kv = out
        kv_ok = _finite_writes(kv, slots, rows, G, S)  # [S]
    R = inp.logits_rows.shape[0]
    prompt = None
    if P:  # the prompt rows come after the sampling rows
        prompt = _score_prompt(logits[R:R + P], inp.prompt_targets, prompt_top_k)
    verify = None
    if shape.num_verify_logits:  # then the verification rows
        verify = _verify(logits[R + P:], inp, greedy_only)
    logits = logits[:R]
    if greedy_only:
        new = greedy(logits)
    else:
        new = sample(logits, inp.temperature, inp.top_p, inp.seeds, inp.streams, inp.steps)
    # A row whose logits hold NaN or inf has no token: -1 (NaN log-probs for beams), which the host refuses
    # (an argmax over NaN would otherwise return a valid-looking id).
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # [R]
    new = jnp.where(finite, new, -1)
    dest = jnp.where(inp.logits_slots < 0, prev.shape[0], inp.logits_slots)  # -1: dropped
    by_row = jnp.zeros_like(prev).at[dest].set(new, mode="drop")
    k = min(top_k, logits.shape[-1])
    S = prev.shape[0]
    top = (jnp.zeros((S, k), jnp.int32), jnp.zeros((S, k), jnp.float32))
    sampled_lp = jnp.zeros((S,), jnp.float32)
    if k or logprobs:
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R, V]
    if k:  # beam search and requested log-probs: each row's k most likely tokens
        top_lp, top_ids = jax.lax.top_k(log_probs, k)  # [R, k]
        top_lp = jnp.where(finite[:, None], top_lp, jnp.nan)
        top = (top[0].at[dest].set(top_ids, mode="drop"), top[1].at[dest].set(top_lp, mode="drop"))
    if logprobs:
        lp = jnp.take_along_axis(log_probs, jnp.clip(new, 0)[:, None], axis=-1)[:, 0]
        sampled_lp = sampled_lp.at[dest].set(jnp.where(finite, lp, jnp.nan), mode="drop")
    return state, kv, by_row, top, sampled_lp, prompt, verify, ok, state.num_free_pages, kv_ok


def _verify(logits: jax.Array, inp: StepInputs, greedy_only: bool) -> tuple[jax.Array, jax.Array]:
    """logits f32[V, vocab] of the verification rows -> (bool[V] accepted,
    i32[V] each row's token, -1 where its logits are not finite)."""
    if greedy_only:  # argmax only: no noise over the vocabulary
        token = greedy(logits)
        accept = token == inp.verify_proposals
    else:
        j = inp.verify_params
        accept, token = verify_proposals(logits, inp.verify_proposals, inp.temperature[j], inp.top_p[j],
                                         inp.seeds[j], inp.streams[j], inp.verify_steps)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return accept & finite, jnp.where(finite, token, -1)


def _finite_writes(kv: KVPool, slots: jax.Array, rows: jax.Array, G: int, S: int) -> jax.Array:
    """bool[S]: for each sequence slot, whether the K/V the call wrote for
    its tokens are finite, read back from the pool (for a model whose
    ``apply`` does not report it). ``slots`` i32[G * T] (-1: padding),
    ``rows`` i32[T] each token's slot (-1: padding).

    Only the pool's last layer is read, each layer group's (its pages, its
    last layer): a non-finite K or V at any layer reaches the token's own
    residual stream (it attends to itself), which carries it to every later
    layer's K and V, so the last layer's hold it whenever any layer's do. It
    costs ``K * G * T * H`` values a leaf, but on a TPU the gather can
    make XLA copy the whole pool out of the kernel's tiling (the step at
    Llama-3-8B then runs out of HBM, ``experiments.lib.aot_step``): the
    decoder reports finiteness itself instead."""
    num_tokens = rows.shape[0]
    at = jnp.clip(slots, 0)
    page, offset = at // kv.page_size, at % kv.page_size
    ok = slots < 0  # [G * T]: padding is fine
    written = jnp.ones_like(ok)
    for leaf in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        if leaf is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue  # int8 pages hold no NaN: their scales do
        # Indexed by (page, offset), never reshaped: merging the pool's page and offset axes could make a
        # TPU copy the whole pool into another tiling.
        got = leaf[-1][:, page, offset]  # [K, G * T(, H)]
        written &= jnp.all(jnp.isfinite(got), axis=tuple(i for i in range(got.ndim) if i != 1))
    return _per_slot((ok | written).reshape(G, num_tokens).all(axis=0), rows, S)


def _per_slot(per_token: jax.Array, rows: jax.Array, S: int) -> jax.Array:
    """bool[T] per token -> bool[S] per sequence slot: all of its tokens (True for a slot without one)."""
    dest = jnp.where(rows < 0, S, rows)
    return jnp.ones((S,), jnp.int32).at[dest].min(per_token.astype(jnp.int32), mode="drop") > 0
def _group_rows(slots: jax.Array, G: int, S: int) -> jax.Array:
    """i32[n] slots (-1: none) -> i32[G * n] the page-state rows of each
    group, group after group (row ``group * S + slot``); -1 stays -1."""
    if G == 1:
        return slots
    return jnp.concatenate([jnp.where(slots >= 0, slots + g * S, -1) for g in range(G)])


def _score_prompt(logits: jax.Array, targets: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits f32[P, V], targets i32[P] -> (f32[P] each target's float32
    log-softmax log-probability, i32[P, k'] and f32[P, k'] the ``k' =
    min(k, V)`` most likely tokens and theirs)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [P, V]
    target_lp = jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
    k = min(k, log_probs.shape[-1])
    if not k:
        return target_lp, jnp.zeros((targets.shape[0], 0), jnp.int32), jnp.zeros((targets.shape[0], 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(log_probs, k)  # [P, k]
    return target_lp, top_ids, top_lp


def num_traces(model) -> int:
    """Programs traced (compiled, unless JAX's persistent cache had them)
    for ``model``'s engine step, over all its engines."""
    return _TRACES[id(model)]
