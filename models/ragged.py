"""The engine's side of the decoder: the flat ragged forward and the model
the engine holds.

:func:`forward_ragged` runs :class:`models.llama.Llama` over the engine's
flat token batch (:class:`paged_jax.attention.batch.RaggedBatch`: prefill chunks and
decode tokens packed, no padding rows), with the blocks, RoPE and layer scan
of :mod:`models.llama` and attention through
:func:`paged_jax.attention.ragged.attend`. :class:`RaggedModel` binds the
module structure to it and keeps the weights as a pytree, the
``PagedModel`` the engine composes into its jitted step
(:mod:`paged_jax.engine.step`); with hybrid sliding-window models it reads a
block table per layer group (:mod:`paged_jax.paging.kv_groups`).
:func:`weight_matmuls` is the floor a call of ``T`` tokens can approach.

Validated at the door, as :mod:`models.llama`'s forwards: once per call,
the layers calling the ``unchecked_*`` attention and K/V writes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama, check_model_pool, embed_tokens, final_logits, query_struct, run_layers, windowed
from paged_jax.attention import paged as paged_attn
from paged_jax.attention import ragged as ragged_attention
from paged_jax.attention.batch import RaggedBatch
from paged_jax.checks import check_bool, check_choice, check_int
from paged_jax.paging.kv_cache import KVPool, check_slots, default_kv_dtype, init_kv_pool, unchecked_write_layer_kv
from paged_jax.paging.kv_groups import KVGroups, kv_groups


def layer_kv_groups(config: LlamaConfig) -> KVGroups:
    """The layer groups of ``config`` (:mod:`paged_jax.paging.kv_groups`): by
    attention kind, a sliding layer's window ``sliding_window``, a global
    layer's None. One group of every layer when the layers are of one kind."""
    return kv_groups([config.sliding_window if s else None for s in config.sliding_layers])


def forward_ragged(model: Llama, batch: RaggedBatch, kv: KVPool, *, impl: str = "auto",
                   reduce=None) -> tuple[jax.Array, KVPool, jax.Array]:
    """Runs the decoder over a flat ragged batch (mixed prefill chunks and
    decode tokens, :mod:`paged_jax.attention.batch`), writing its K/V into the pool.

    The weight matmuls see exactly the batch's ``T`` rows, whatever mix of
    phases they come from; attention is
    :func:`paged_jax.attention.ragged.attend`, whose cost follows the sum of
    the sequences' lengths. A Pallas ``impl``'s flat kernel writes each
    layer's K/V in its call (mixed sliding/global layers scatter first).

    Args:
      model: the decoder.
      batch: tokens i32[T], positions, slots, block tables, per-sequence
        starts and lengths, and the rows to return logits for.
      kv: the KV pool (``[layers, K, P, L, H]``).
      impl: attention implementation (:func:`paged_jax.attention.ragged.attend`):
        ``"auto"`` is the XLA work-list attention on CPU and the backend's
        Pallas kernels on GPU and TPU.
      reduce: as in :func:`forward` (tensor parallelism).

    Returns:
      ``(logits f32[R, V] at batch.logits_rows, kv, finite bool[T])``:
      ``finite`` says whether each token's final hidden state is finite
      (False for one a non-finite K or V reached at any layer: the engine
      stops its request and keeps its pages out of the prefix cache).

    Raises:
      ValueError: a pool that does not fit the model; an unknown ``impl``;
        a batch the attention refuses
        (:func:`paged_jax.attention.ragged.check_attend`, which also clamps
        its lengths under ``jit``); (eager calls) slots that are not
        distinct slots of the pool (``kv_cache.check_slots``).
    """
    config = model.config
    G, T = batch.num_groups, batch.tokens.shape[0]
    groups = layer_kv_groups(config)
    if G not in (1, groups.num_groups) or G * batch.q_starts.shape[0] != batch.block_tables.shape[0]:
        raise ValueError(f"batch.block_tables has {batch.block_tables.shape[0]} rows for {batch.q_starts.shape[0]} "
                         f"sequences; this model reads one table per sequence (a pool of every layer) or one per "
                         f"layer group ({groups.num_groups})")
    check_model_pool(config, kv, groups.group_size if G > 1 else None)
    for g in range(G):
        check_slots(kv, batch.group(g).slots, T)
    impl, _, checked = ragged_attention.check_attend(
        query_struct(model, T), kv.k, kv.v, 0, batch.group(0), impl=impl, k_scales=kv.k_scale,
        v_scales=kv.v_scale, sliding_window=config.sliding_window, scale=config.query_scale,
        soft_cap=config.attn_soft_cap)  # layer 0: the scan's layers are the pool's
    checked = batch.replace(q_starts=checked.q_starts, q_lens=checked.q_lens, kv_lens=checked.kv_lens)
    x = embed_tokens(model, batch.tokens)[None]  # [1, T, D]
    options = dict(scale=config.query_scale, soft_cap=config.attn_soft_cap)
    group_of, index_of = jnp.asarray(groups.layer_group, jnp.int32), jnp.asarray(groups.layer_index, jnp.int32)

    def locate(layer):
        """(the layer's row in a page, its group's view of the batch): with
        layer groups, a traced index into the [G, ...] tables and slots."""
        if G == 1:
            return layer, checked
        return index_of[layer], checked.group(group_of[layer])

    def attend_pages(q, kv, layer):
        row, view = locate(layer)
        return windowed(config, layer, lambda window: ragged_attention.unchecked_attend(
            q[0], kv.k, kv.v, row, view, impl=impl, k_scales=kv.k_scale, v_scales=kv.v_scale,
            sliding_window=window, **options))[None]

    def write_then_attend(q, k, v, kv, layer):
        row, view = locate(layer)
        kv = unchecked_write_layer_kv(kv, row, k[0], v[0], view.slots)
        return attend_pages(q, kv, layer), kv

    def write_attend(q, k, v, kv, layer):
        out, kv = windowed(config, layer, lambda window: ragged_attention.unchecked_write_attend(
            q[0], k[0], v[0], kv, layer, checked, impl=impl, sliding_window=window, **options))
        return out[None], kv

    # A flat kernel writes the K/V in its call, but not under mixed layers' cond (the pool would pass through both).
    writes = ragged_attention.kernel_writes_kv(impl) and not config.mixed_layers
    x, kv = run_layers(model, x, batch.positions[None, :], kv, write_attend if writes else write_then_attend, reduce)
    # A token whose final hidden state is not finite: a non-finite K or V at any layer reached it (it attends
    # to itself, and the residual stream carries it on), or a later layer made one (the engine's poison check).
    finite = jnp.all(jnp.isfinite(x[0]), axis=-1)  # [T]
    return final_logits(model, x[0, batch.logits_rows]), kv, finite  # [R, V]


class RaggedModel:
    """The engine's view of a decoder: weights and a pure ``apply``.

    ``apply(params, batch, kv) -> (logits f32[R, V], kv)`` is
    :func:`forward_ragged` with the module structure bound; ``params`` are
    the weights as a pytree, passed as an argument (not closed over) so XLA
    does not fold them into each program as constants. The engine composes
    ``apply`` with its page-state update and the sampler into one jitted
    step (:mod:`paged_jax.engine.core`).
    """

    def __init__(self, model: Llama, *, impl: str = "auto"):
        if not isinstance(model, Llama):
            raise ValueError(f"model must be a models.llama.Llama, got a {type(model).__name__}")
        check_choice("impl", impl, paged_attn.IMPLS)
        self.config: LlamaConfig = model.config
        self.vocab_size = model.config.vocab_size
        self.impl = impl
        self._graphdef, self.params = nnx.split(model)
        self._early_exits: dict[int, RaggedModel] = {}  # num_layers -> the draft early_exit made of self.params

    @property
    def kv_window(self) -> int | None:
        """Tokens every layer attends (the engine drops pages out of that
        window while sequences run, :mod:`paged_jax.paging.sliding_window`), or
        None when some layer attends all of them."""
        config = self.config
        return config.sliding_window if all(config.sliding_layers) else None

    @property
    def kv_groups(self) -> KVGroups:
        """The layer groups (:func:`layer_kv_groups`): an engine given a
        pool of ``kv_groups.group_size`` layers (:meth:`make_kv_pool`) keeps
        a block table per group and returns each sliding group's pages
        once they leave its window; given a pool of every layer
        (``LlamaConfig.make_kv_pool``), it keeps one table and every page."""
        return layer_kv_groups(self.config)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zeroed pool laid out by layer group: ``[g, K, P, L, H]``, ``g``
        = ``kv_groups.group_size`` (every layer for a model of one kind, so
        then ``LlamaConfig.make_kv_pool``'s pool). Arguments as there."""
        config = self.config
        return init_kv_pool(num_layers=self.kv_groups.group_size, num_kv_heads=config.num_kv_heads,
                            num_pages=num_pages, page_size=page_size, head_dim=config.head_dim,
                            dtype=default_kv_dtype() if dtype is None else dtype)

    def make_budget_kv_pool(self, num_pages: int, page_size: int, dtype=None, *, grouped: bool = True) -> KVPool:
        """A zeroed pool of the bytes of ``LlamaConfig.make_kv_pool(num_pages,
        ...)`` (pages of every layer, ``num_pages`` counting the null page),
        laid out by layer group when ``grouped`` (:meth:`make_kv_pool`):
        ``(num_pages - 1) * num_layers // g + 1`` pages of ``g`` layers, so
        a hybrid model's engine returns its sliding groups' pages while the
        same memory is given. A model of one kind gets the same pool either
        way; ``grouped=False`` keeps every layer's pages in one table.

        Raises:
          ValueError: ``num_pages`` not an int >= 2 (the null page and
            one), ``grouped`` not a bool, ``page_size`` not an int >= 1, or
            a bad ``dtype`` (as ``make_kv_pool``).
        """
        num_pages = check_int("num_pages", num_pages, 2)
        if not check_bool("grouped", grouped):
            return self.config.make_kv_pool(num_pages, page_size, dtype)
        groups = self.kv_groups
        return self.make_kv_pool((num_pages - 1) * groups.num_layers // groups.group_size + 1, page_size, dtype)

    def apply(self, params, batch: RaggedBatch, kv: KVPool) -> tuple[jax.Array, KVPool, jax.Array]:
        return forward_ragged(nnx.merge(self._graphdef, params), batch, kv, impl=self.impl)

    def early_exit(self, num_layers: int, params=None) -> RaggedModel:
        """The model's first ``num_layers`` decoder blocks, then its own final
        norm and output projection: an early-exit draft for speculative
        decoding (LayerSkip, Elhoushi et al., 2024, section 4; here without
        its early-exit training, so acceptance is what the checkpoint
        gives). Its K/V for a token equal this model's first layers' K/V
        for it.

        Args:
          num_layers: blocks kept, in ``[1, num_layers of this model)``.
          params: the full model's weights to cut (default: ``self.params``;
            :meth:`paged_jax.engine.core.Engine.update_weights` passes the new ones).

        Returns:
          a :class:`RaggedModel` whose blocks' weights are copies of the
          first ``num_layers`` (a ``num_layers / layers`` share of the
          blocks' bytes) and whose embedding, final norm and head are this
          model's arrays; without ``params`` the same object each time
          (engines of it share compiled programs).

        Raises:
          ValueError: ``num_layers`` not an int in range.
        """
        config = self.config
        num_layers = check_int("num_layers", num_layers, 1, config.num_layers)
        cached = self._early_exits.get(num_layers) if params is None else None
        if cached is not None:  # one draft object per cut: engines of it share compiled programs
            return cached
        types = None if config.layer_types is None else config.layer_types[:num_layers]
        sliding = types is not None and "sliding_attention" in types
        draft_config = dataclasses.replace(config, num_layers=num_layers, layer_types=types,
                                           sliding_window=config.sliding_window if types is None or sliding else None)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(draft_config, rngs=nnx.Rngs(0))))
        full = nnx.merge(self._graphdef, self.params if params is None else params)
        state = jax.tree.map(lambda a, w: w[:num_layers] if a.shape != w.shape else w, abstract, nnx.state(full))
        draft = RaggedModel(nnx.merge(graphdef, state), impl=self.impl)
        if params is None:
            self._early_exits[num_layers] = draft
        return draft

    def check_kv_pool(self, kv: KVPool) -> None:
        """Raises ValueError unless ``kv`` fits this model (KV heads, head
        dim, and layers: every layer, or ``kv_groups.group_size``)."""
        groups = self.kv_groups
        check_model_pool(self.config, kv, groups.group_size if kv.num_layers == groups.group_size else None)


def weight_matmuls(model: Llama, x: jax.Array, num_logits: int) -> jax.Array:
    """The decoder's weight matmuls alone, for ``x``'s ``T`` rows: the floor
    a model call at that token count can approach (no attention, norms,
    RoPE or KV writes). Same layer scan and einsums as :func:`forward_ragged`.

    Args:
      model: the decoder.
      x: f32[T, D] stand-in hidden states.
      num_logits: R, rows that go through the output projection.

    Returns:
      f32[R, V], of no meaning beyond its cost.
    """
    graphdef, block_state = nnx.split(model.blocks)

    def layer_body(x, state):
        block = nnx.merge(graphdef, state)
        a = block.attn
        q = jnp.einsum("TD,DNH->TNH", x, a.wq[...])
        k = jnp.einsum("TD,DKH->TKH", x, a.wk[...])
        v = jnp.einsum("TD,DKH->TKH", x, a.wv[...])
        x = x + jnp.einsum("TNH,NHD->TD", q, a.wo[...]) + (k.sum() + v.sum())
        m = block.mlp
        gate = jnp.einsum("TD,DF->TF", x, m.w_gate[...])
        up = jnp.einsum("TD,DF->TF", x, m.w_up[...])
        return x + jnp.einsum("TF,FD->TD", gate * up, m.w_down[...]), None

    x, _ = jax.lax.scan(layer_body, x, block_state)
    return jnp.einsum("RD,VD->RV", x[:num_logits], model.output_weight())
