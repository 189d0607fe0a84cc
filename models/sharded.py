"""The decoder over a device mesh: tensor parallel on the model axis, data
parallel on the data axis, the KV pool sharded by KV head and by page range.

Weights (:class:`ShardedLlama`). Attention heads and MLP columns are split
over the ``model`` axis (Megatron-style): each device holds its query heads'
``wq`` and ``wo`` rows, its KV heads' ``wk`` / ``wv``, its columns of
``w_gate`` / ``w_up`` and the matching rows of ``w_down``; norms and the
(tied) embedding are replicated. A mixture-of-experts MLP (Qwen3-MoE) is
split by expert instead (expert parallelism): each device holds ``E / M``
whole experts, the router is replicated, every device routes every token
among all experts and runs its own experts' share, and the same sum over
the model axis adds the shares (tokens are not exchanged: they are
replicated over the model axis already; an all-to-all dispatch pays off
only when tokens are sharded too). Each device computes its heads' attention
and its share of the MLP, and the two partial outputs of every layer are
summed over the model axis (``psum``, two all-reduces per layer). Heads that
do not split evenly are replicated and padded with zero heads
(:func:`paged_jax.distributed.sharding.head_layout`): the padded model computes exactly
the same function. The layer scan stays one compiled body.

KV pool (:meth:`ShardedLlama.make_kv_pool`): ``[layers, K', P, L, H]`` with
the KV-head axis split over ``model`` and the page axis over ``data``: data
shard ``d`` owns global pages ``[d * P_d, (d + 1) * P_d)``, addressed by
local ids ``0 .. P_d - 1`` (each shard has its own null page 0), so a block
table can name no other shard's page. A quantized pool (int8, fp8) shards
its scales ``f32[layers, K', P, L]`` the same way (:func:`kv_pool_specs`):
a scale is per token and KV head, so it lives on the device holding its
page, and a device quantizes and dequantizes its own heads with no
communication. Replicated KV heads hold replicated scales: each replica
computes the same K/V from the same weights, so it quantizes them the same.

Attention runs under ``jax.shard_map`` on each device's own heads and
pages: a Pallas kernel cannot be partitioned automatically, and the XLA
reference takes the same path so CPU tests exercise it.

Two entry points: :meth:`ShardedLlama.forward` (a padded batch over the
whole mesh, rows split over the data axis) and :class:`ShardedRaggedModel`
(the engine's model for one data shard; :mod:`paged_jax.distributed.data_parallel`
runs one engine per data shard).

Imports run one way: this module uses :mod:`paged_jax.distributed.sharding`, never the
reverse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama import Llama, LlamaConfig, forward
from models.ragged import forward_ragged
from paged_jax.attention import paged as paged_attn
from paged_jax.attention.batch import RaggedBatch
from paged_jax.checks import check_choice, check_instance, check_int
from paged_jax.distributed.sharding import DATA, MODEL, HeadLayout, head_layout, split_evenly
from paged_jax.paging.kv_cache import KVPool, check_pool, init_kv_pool
from pallas_kernels import common

KV_SPEC = P(None, MODEL, DATA, None, None)
"""K and V pages ``[layers, K', P, L, H]``: KV heads over model, pages over data."""
SCALE_SPEC = P(None, MODEL, DATA, None)
"""A quantized pool's scales ``f32[layers, K', P, L]``: sharded as their pages."""


def kv_pool_specs(quantized: bool) -> KVPool:
    """The pool's partition specs, shaped as the pool (a :class:`KVPool` of
    ``PartitionSpec``): :data:`KV_SPEC` for K and V, :data:`SCALE_SPEC` for
    the scales of a ``quantized`` pool (None for a float one), so
    ``shard_map`` and ``jit`` take it as the pool's spec tree."""
    if quantized:
        return KVPool(k=KV_SPEC, v=KV_SPEC, k_scale=SCALE_SPEC, v_scale=SCALE_SPEC)
    return KVPool(k=KV_SPEC, v=KV_SPEC)

# Which axis of each stacked weight is split over the model axis (None: replicated).
_SPLIT_AXIS = {
    ("attn", "wq"): 2, ("attn", "wk"): 2, ("attn", "wv"): 2, ("attn", "wo"): 1,  # [L, D, N, H], [L, N, H, D]
    ("attn", "bq"): 1, ("attn", "bk"): 1, ("attn", "bv"): 1,  # [L, N, H]
    ("mlp", "w_gate"): 2, ("mlp", "w_up"): 2, ("mlp", "w_down"): 1,  # [L, D, F], [L, F, D]
}
# A mixture of experts splits its experts instead (expert parallelism): [L, E, D, I], [L, E, I, D]; the router
# [L, E, D] is replicated (every device chooses among all experts).
_EXPERT_SPLIT_AXIS = {**_SPLIT_AXIS, ("mlp", "w_gate"): 1, ("mlp", "w_up"): 1, ("mlp", "w_down"): 1}


def _gather_heads(w: np.ndarray, slots, axis: int) -> np.ndarray:
    """``w`` with its head axis re-indexed by ``slots`` (-1: a zero head)."""
    slots = np.asarray(slots)
    out = np.take(w, np.maximum(slots, 0), axis=axis)
    shape = [1] * w.ndim
    shape[axis] = len(slots)
    return out * (slots >= 0).reshape(shape).astype(w.dtype)


def pad_params(params: dict, layout: HeadLayout) -> dict:
    """A checkpoint's parameters (nested dict, :class:`Llama` layout) with
    the head axes laid out as ``layout``'s slots: query heads (``wq``,
    ``wo``, ``bq``) by ``q_slots``, KV heads (``wk``, ``wv``, ``bk``,
    ``bv``) by ``kv_slots``; zero heads where a slot is -1."""
    attn = dict(params["blocks"]["attn"])
    for name, axis, slots in (("wq", 2, layout.q_slots), ("wo", 1, layout.q_slots), ("bq", 1, layout.q_slots),
                              ("wk", 2, layout.kv_slots), ("wv", 2, layout.kv_slots), ("bk", 1, layout.kv_slots),
                              ("bv", 1, layout.kv_slots)):
        if name in attn:
            attn[name] = _gather_heads(np.asarray(attn[name]), slots, axis)
    return {**params, "blocks": {**params["blocks"], "attn": attn}}


def _spec(path: tuple[str, ...], ndim: int, experts: bool = False) -> P:
    axis = (_EXPERT_SPLIT_AXIS if experts else _SPLIT_AXIS).get(path[-2:]) if path[0] == "blocks" else None
    if axis is None:
        return P()
    return P(*[MODEL if i == axis else None for i in range(ndim)])


def _map_with_names(fn, tree: dict) -> dict:
    """``fn(path, leaf)`` over a nested dict's leaves (``path`` a tuple of
    keys), same nesting out."""
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({path: fn(path, leaf) for path, leaf in flat.items()})


class ShardedLlama:
    """A :class:`Llama`'s weights placed on a ``(data, model)`` mesh.

    Attributes:
      mesh: the mesh (axes ``data``, ``model``).
      layout: how the heads split over the model axis.
      config: the padded model's config (``N' = M * q_heads_per_device``
        query heads, ``K' = M * kv_heads_per_device`` KV heads): what the
        pool is shaped for.
      local_config: one device's share (its heads and MLP columns).
      params: the padded weights as an ``nnx.State``, each leaf a global
        array sharded as described in the module docstring.

    Raises (constructor):
      ValueError: ``model`` is not a :class:`Llama`, the mesh lacks the
        ``data`` / ``model`` axes, or the MLP width (a mixture of experts:
        the number of experts) does not split evenly over the model axis
        (names both numbers).
    """

    def __init__(self, model: Llama, mesh: Mesh, *, impl: str = "auto"):
        check_instance("model", model, Llama, what="models.llama.Llama")
        if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
            raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') "
                             f"(paged_jax.distributed.sharding.make_mesh), got {mesh!r}")
        check_choice("impl", impl, paged_attn.IMPLS)
        base = model.config
        m = mesh.shape[MODEL]
        self.mesh, self.impl = mesh, impl
        self.layout = head_layout(base.num_q_heads, base.num_kv_heads, m)
        experts = base.router is not None
        if experts:  # expert parallelism: each device holds E / M whole experts (models.llama.MoE)
            split_evenly("num_experts", base.router.num_experts, m)
            mlp = dict(expert_shards=m)
        else:
            mlp = dict(mlp_dim=split_evenly("mlp_dim", base.mlp_dim, m))
        self.config: LlamaConfig = dataclasses.replace(
            base, num_q_heads=len(self.layout.q_slots), num_kv_heads=len(self.layout.kv_slots))
        self.local_config: LlamaConfig = dataclasses.replace(
            base, num_q_heads=self.layout.q_heads_per_device, num_kv_heads=self.layout.kv_heads_per_device, **mlp)
        self.vocab_size = base.vocab_size

        host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        padded = pad_params(host, self.layout)
        specs = _map_with_names(lambda path, w: _spec(path, w.ndim, experts), padded)
        placed = _map_with_names(
            lambda path, w: jax.device_put(w, NamedSharding(mesh, _spec(path, w.ndim, experts))), padded)
        # The padded model's module structure carries the arrays; a device's
        # shard of each has the local config's shapes.
        abstract = nnx.eval_shape(lambda: Llama(self.config, rngs=nnx.Rngs(0), param_dtype=model.embed[...].dtype))
        self.params = nnx.split(abstract)[1]
        nnx.replace_by_pure_dict(self.params, placed)
        self.param_specs = nnx.split(abstract)[1]
        nnx.replace_by_pure_dict(self.param_specs, specs)
        self._local_graphdef = nnx.split(
            nnx.eval_shape(lambda: Llama(self.local_config, rngs=nnx.Rngs(0))))[0]
        self._forwards: dict = {}

    # -- the pool ---------------------------------------------------------

    def make_kv_pool(self, pages_per_shard: int, page_size: int, dtype=jnp.float32) -> KVPool:
        """A zeroed pool sharded over the mesh: ``[layers, K', D * P_d, L,
        H]``, KV heads over ``model``, pages over ``data``; data shard ``d``
        owns pages ``[d * P_d, (d + 1) * P_d)`` under local ids ``0 .. P_d -
        1`` (page 0 of each shard is its null page). Every shard's pages are
        exactly ``dtype``; a quantized dtype (int8, float8_e4m3fn or
        ``"fp8"``, float8_e5m2) adds f32 scales ``[layers, K', D * P_d, L]``
        sharded as the pages (:func:`kv_pool_specs`).

        Args:
          pages_per_shard: P_d, pages of each data shard, null page included
            (>= 2).
          page_size: L, tokens per page.
          dtype: the page dtype (``pallas_kernels.common.KV_DTYPES``).

        Raises:
          ValueError: as :func:`paged_jax.paging.kv_cache.init_kv_pool`.
        """
        dtype = common.check_kv_dtype("dtype", dtype)
        pages_per_shard = check_int("pages_per_shard", pages_per_shard, 2)  # a null page and one more
        data = self.mesh.shape[DATA]
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec),
                                 kv_pool_specs(common.is_quantized(dtype)))
        pool = jax.jit(lambda: init_kv_pool(
            num_layers=self.config.num_layers, num_kv_heads=self.config.num_kv_heads,
            num_pages=pages_per_shard * data, page_size=page_size, head_dim=self.config.head_dim, dtype=dtype),
            out_shardings=shardings)
        return pool()

    def kv_bytes_per_device(self, pages_per_shard: int, page_size: int, dtype=jnp.float32) -> int:
        """Bytes of K and V one device holds for a pool of ``pages_per_shard``
        pages per data shard (its KV heads, padding and replicas included;
        a quantized pool's f32 scales too): ``2 * layers * k * P_d * L * b``
        with ``k`` = :attr:`HeadLayout.kv_heads_per_device` and ``b`` =
        ``H * itemsize``, plus 4 for a quantized dtype's scale
        (``pallas_kernels.common.kv_bytes_per_token``).

        Raises:
          ValueError: ``dtype`` is not a K/V page dtype; ``pages_per_shard``
            below 2 or ``page_size`` below 1 (or not ints), as
            :meth:`make_kv_pool` refuses them.
        """
        c = self.config
        pages_per_shard = check_int("pages_per_shard", pages_per_shard, 2)
        page_size = check_int("page_size", page_size)
        per_token = common.kv_bytes_per_token(c.head_dim, common.check_kv_dtype("dtype", dtype))
        return 2 * c.num_layers * self.layout.kv_heads_per_device * pages_per_shard * page_size * per_token

    # -- a padded batch over the whole mesh ---------------------------------

    def forward(self, tokens, kv: KVPool, block_tables, kv_lens, q_lens, *, all_logits: bool = False):
        """:func:`models.llama.forward` over the mesh.

        Rows are split over the data axis in order: data shard ``d`` runs rows
        ``[d * B_d, (d + 1) * B_d)`` (``B = D * B_d``) against its own pages,
        whose ids in ``block_tables`` are local (``0 .. P_d - 1``).

        Args:
          tokens: i32[B, T]; block_tables: i32[B, pages_per_seq] local page
            ids; kv_lens, q_lens: i32[B]; as in :func:`models.llama.forward`.
          kv: a pool from :meth:`make_kv_pool`, float or quantized
            (donated: use the returned one).
          all_logits: logits for every query row.

        Returns:
          ``(logits f32[B, V] or f32[B, T, V], kv)``; logits sharded over
          the data axis, replicated over the model axis.

        Raises:
          ValueError: ``B`` not a multiple of the data-axis size; a page id
            outside a shard's ``[0, P_d)``, or lengths past a row's block
            table (checked on the host, so a bad table fails loudly instead
            of being clamped inside the program).
        """
        data = self.mesh.shape[DATA]
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] % data:
            raise ValueError(f"tokens must be [batch, tokens] with the batch split evenly over data={data} shards, "
                             f"got shape {tokens.shape}")
        pages_per_shard = kv.k.shape[2] // data
        try:
            common.checked_lengths(np.asarray(block_tables), pages_per_shard, kv.page_size, np.asarray(kv_lens),
                                   np.asarray(q_lens), tokens.shape[1])
        except ValueError as e:
            raise ValueError(f"{e} (page ids are local to each data shard: [0, {pages_per_shard}))") from None
        key = (all_logits, kv.quantized)
        fn = self._forwards.get(key)
        if fn is None:
            local_graphdef, impl = self._local_graphdef, self.impl
            kv_specs = kv_pool_specs(kv.quantized)

            def local(params, tokens, kv, block_tables, kv_lens, q_lens):
                model = nnx.merge(local_graphdef, params)
                return forward(model, tokens, kv, block_tables, kv_lens, q_lens, impl=impl, all_logits=all_logits,
                               reduce=lambda y: jax.lax.psum(y, MODEL))

            rows = P(DATA)
            fn = jax.jit(jax.shard_map(local, mesh=self.mesh,
                                       in_specs=(self.param_specs, rows, kv_specs, rows, rows, rows),
                                       out_specs=(rows, kv_specs), check_vma=False), donate_argnums=(2,))
            self._forwards[key] = fn
        return fn(self.params, jnp.asarray(tokens, jnp.int32), kv, jnp.asarray(block_tables, jnp.int32),
                  jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))


class ShardedRaggedModel:
    """The engine's model (:class:`paged_jax.engine.core.PagedModel`) for one data
    shard: tensor parallel over a mesh whose data axis has size 1.

    ``apply(params, batch, kv)`` runs :func:`models.ragged.forward_ragged`
    under ``shard_map``: the batch (and so the page state that built it) is
    replicated over the model axis, each device attends over its own KV
    heads, and logits come back replicated. Pass ``make_kv_pool``'s pool to
    the engine.

    Raises (constructor):
      ValueError: a mesh whose data axis is not 1, and as
        :class:`ShardedLlama`.
    """

    def __init__(self, model: Llama, mesh: Mesh, *, impl: str = "auto"):
        if isinstance(mesh, Mesh) and mesh.shape.get(DATA, 1) != 1:
            raise ValueError(f"an engine serves one data shard: the mesh's data axis must be 1, got "
                             f"data={mesh.shape[DATA]} (paged_jax.distributed.data_parallel runs one engine per shard)")
        self.sharded = ShardedLlama(model, mesh, impl=impl)
        self.config = self.sharded.config
        self.vocab_size = self.sharded.vocab_size
        self.params = self.sharded.params
        self.mesh = mesh
        local_graphdef = self.sharded._local_graphdef

        def local(params, batch: RaggedBatch, kv: KVPool):
            return forward_ragged(nnx.merge(local_graphdef, params), batch, kv, impl=impl,
                                  reduce=lambda y: jax.lax.psum(y, MODEL))

        # One shard_map per pool kind: a quantized pool's spec tree has its scales.
        self._apply = {quantized: jax.shard_map(local, mesh=mesh, in_specs=(self.sharded.param_specs, P(), specs),
                                                out_specs=(P(), specs, P()), check_vma=False)
                       for quantized, specs in ((q, kv_pool_specs(q)) for q in (False, True))}

    def apply(self, params, batch: RaggedBatch, kv: KVPool):
        return self._apply[kv.quantized](params, batch, kv)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=jnp.float32) -> KVPool:
        """The engine's pool: ``num_pages`` pages (null page included), KV
        heads (and a quantized pool's scales) split over the model axis."""
        return self.sharded.make_kv_pool(num_pages, page_size, dtype)

    def check_kv_pool(self, kv: KVPool) -> None:
        """Raises ValueError unless ``kv`` fits the padded model and is a
        well-formed pool, float or quantized with its scales
        (:func:`paged_jax.paging.kv_cache.check_pool`)."""
        want = (self.config.num_layers, self.config.num_kv_heads, self.config.head_dim)
        got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        if got != want:
            raise ValueError(f"kv pool must have (num_layers, num_kv_heads, head_dim)={want} for this sharded "
                             f"model (KV heads padded for the mesh), got {got}")
        check_pool(kv)


def make_data_parallel_engine(model: Llama, mesh: Mesh, config, *, pages_per_shard: int, page_size: int,
                              stop_ids=(), vocab_size: int | None = None, impl: str = "auto",
                              check_page_state: bool = False, kv_dtype=jnp.float32):
    """A :class:`paged_jax.distributed.data_parallel.DataParallelEngine` over ``mesh``:
    for each data shard (a row of ``model``-axis devices), the weights placed
    on its devices tensor parallel (:class:`ShardedRaggedModel`), a pool of
    ``pages_per_shard`` pages there, and an :class:`paged_jax.engine.core.Engine`
    with ``config``. Under ``jax.distributed`` each process builds engines
    only for the shards whose devices it holds (None for the others).

    Args:
      model: the decoder.
      mesh: ``(data, model)`` mesh (:func:`paged_jax.distributed.sharding.make_mesh`).
      config: an :class:`paged_jax.engine.core.EngineConfig`, shared by the shards.
      pages_per_shard: pages of each shard's pool, null page included.
      page_size: tokens per page.
      stop_ids, vocab_size, check_page_state: as :class:`paged_jax.engine.core.Engine`.
      impl: attention implementation.
      kv_dtype: dtype of every shard's K/V pages.

    Raises:
      ValueError: a data shard whose devices belong to more than one
        process; from :class:`ShardedRaggedModel` or the engines.
    """
    from paged_jax.distributed.data_parallel import DataParallelEngine
    from paged_jax.engine.core import Engine

    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model'), got {mesh!r}")
    engines = []
    for d in range(mesh.shape[DATA]):
        owners = sorted({device.process_index for device in mesh.devices[d]})
        if len(owners) > 1:
            raise ValueError(f"data shard {d} spans processes {owners}: an engine serves a whole data shard from "
                             f"one host, so keep each data shard's model axis within a host (data >= hosts)")
        if owners[0] != jax.process_index():
            engines.append(None)  # another host serves this shard
            continue
        row = Mesh(mesh.devices[d:d + 1], (DATA, MODEL))
        shard_model = ShardedRaggedModel(model, row, impl=impl)
        engines.append(Engine(shard_model, shard_model.make_kv_pool(pages_per_shard, page_size, kv_dtype), config,
                              stop_ids=stop_ids, vocab_size=vocab_size, check_page_state=check_page_state))
    return DataParallelEngine(engines)
