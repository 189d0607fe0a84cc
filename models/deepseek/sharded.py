"""The DeepSeek-V3 decoder over the model axis of a mesh: MLA's query
heads split (tensor parallel), the MoE layers' routed experts split whole
(expert parallelism), the latent pool replicated.

What each of the ``M`` devices holds (:data:`SPLIT_AXIS`): its ``N / M``
query heads' ``q`` / ``q_b``, ``w_uk``, ``w_uv`` and ``o``; its columns of
the dense layers' and the shared experts' SwiGLU (``gate``, ``up``; the
matching rows of ``down``); its ``E / M`` routed experts. Replicated: the
embedding and head, the norms, the query LoRA's ``q_a``, the latent's
``kv_a`` and the router with its correction bias, so every device computes
the same latent for each token and every device routes every token among
all ``E`` experts. Each device attends its heads and runs its share of the
MLP, and :func:`models.deepseek.model.forward_ragged` sums the partial
outputs over the axis (``axis=``: two all-reduces a layer, as Megatron
splits a dense model; tokens are not exchanged, they are replicated over
the axis already).

Why the latent pool is replicated, not split: MLA caches one latent a token
for all heads (one "KV head"), so there is no head axis to split, and every
device's heads attend every latent. vLLM and SGLang keep the MLA cache
whole on every tensor-parallel rank for the same reason; what splits the
pool is the data axis (``paged_jax.distributed.data_parallel``: one engine
a data shard, each with its own pages). A device's pool is therefore the
unsharded model's (``config.kv_bytes_per_token``), and the capacity gain
of MLA is per device, against a GQA model whose KV heads split.

The engine takes :class:`ShardedDeepseekModel` as it takes
:class:`models.deepseek.model.DeepseekModel` (an engine serves one data
shard: the mesh's data axis must be 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.deepseek.model import DeepseekModel, forward_ragged
from paged_jax.attention.batch import RaggedBatch
from paged_jax.checks import check_instance, check_int
from paged_jax.distributed.sharding import DATA, MODEL, split_evenly
from paged_jax.paging.kv_cache import KVPool
from pallas_kernels import common

SPLIT_AXIS = {  # stacked weight -> its axis split over the model axis (the layer axis first); absent: replicated
    "q": 2, "q_b": 2, "w_uk": 1, "w_uv": 1, "o": 1,  # [n, D | Q, N, H + R], [n, N, H, C], [n, N, C, O], [n, N, O, D]
    "gate": 2, "up": 2, "down": 1,  # [n, D, F], [n, F, D]
    "w_gate": 1, "w_up": 1, "w_down": 1,  # [n, E, D, I], [n, E, I, D]
    "shared_gate": 2, "shared_up": 2, "shared_down": 1,  # [n, D, I_s], [n, I_s, D]
}


def param_specs(params: dict) -> dict:
    """The partition spec of every weight of a :class:`DeepseekModel`'s
    ``params`` (module docstring), shaped as ``params``."""
    def spec(stack: str | None, name: str, ndim: int) -> P:
        axis = SPLIT_AXIS.get(name) if stack is not None else None
        return P() if axis is None else P(*[MODEL if i == axis else None for i in range(ndim)])

    return {name: ({k: spec(name, k, np.ndim(w)) for k, w in v.items()} if isinstance(v, dict)
                   else spec(None, name, np.ndim(v))) for name, v in params.items()}


class ShardedDeepseekModel:
    """A :class:`DeepseekModel` placed on a ``(data, model)`` mesh whose
    data axis is 1: the engine's model (``apply``, ``params``, a pool from
    :meth:`make_kv_pool`), tensor and expert parallel over ``model``
    (module docstring).

    Args:
      model: the decoder (its weights are placed on the mesh).
      mesh: axes ``("data", "model")``
        (:func:`paged_jax.distributed.sharding.make_mesh`), data 1.

    Raises:
      ValueError: ``model`` not a :class:`DeepseekModel`; a mesh without
        those axes or with a data axis other than 1; query heads, the
        dense MLP width, the routed experts or the shared experts' width
        that do not split evenly over the model axis (both numbers named).
    """

    kv_window = None

    def __init__(self, model: DeepseekModel, mesh: Mesh):
        check_instance("model", model, DeepseekModel, what="models.deepseek.model.DeepseekModel")
        if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
            raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') "
                             f"(paged_jax.distributed.sharding.make_mesh), got {mesh!r}")
        if mesh.shape[DATA] != 1:
            raise ValueError(f"an engine serves one data shard: the mesh's data axis must be 1, got "
                             f"data={mesh.shape[DATA]} (paged_jax.distributed.data_parallel runs one engine per shard)")
        c, m = model.config, mesh.shape[MODEL]
        split_evenly("num_heads", c.num_heads, m)
        if c.num_dense_layers:
            split_evenly("mlp_dim", c.mlp_dim, m)
        if c.router is not None:
            split_evenly("num_experts", c.router.num_experts, m)
            if c.num_shared_experts:
                split_evenly("moe_mlp_dim * num_shared_experts", c.moe_mlp_dim * c.num_shared_experts, m)
        self.model, self.mesh, self.config, self.vocab_size = model, mesh, c, model.vocab_size
        self.kv_groups = model.kv_groups
        specs = param_specs(model.params)
        self.params = jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)), model.params, specs,
                                   is_leaf=lambda x: isinstance(x, P))
        impl, expanded = model.impl, model.expanded_min_tokens

        def local(params, batch: RaggedBatch, kv: KVPool):
            return forward_ragged(c, params, batch, kv, impl=impl, expanded_min_tokens=expanded, axis=MODEL)

        # The pool and the batch replicated (P() a prefix of the pool's tree: every leaf, scales included).
        self._apply = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), P(), P()),
                                    check_vma=False)

    def apply(self, params, batch: RaggedBatch, kv: KVPool) -> tuple[jax.Array, KVPool, jax.Array]:
        """:func:`models.deepseek.model.forward_ragged` on each device's
        share: ``(logits f32[R, V], kv, finite bool[T])``, replicated."""
        return self._apply(params, batch, kv)

    def make_kv_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """The latent pool (:meth:`DeepseekModel.make_kv_pool`), replicated
        over the mesh. Raises as that method."""
        pool = self.model.make_kv_pool(num_pages, page_size, dtype)
        return jax.device_put(pool, NamedSharding(self.mesh, P()))

    def make_budget_kv_pool(self, num_pages: int, page_size: int, dtype=None, *, grouped: bool = True) -> KVPool:
        """:meth:`make_kv_pool` (one layer group)."""
        del grouped
        return self.make_kv_pool(num_pages, page_size, dtype)

    def check_kv_pool(self, kv: KVPool) -> None:
        """Raises ValueError unless ``kv`` fits the model
        (:meth:`DeepseekModel.check_kv_pool`) and lies on the mesh's
        devices (a pool on others would fail inside the first step)."""
        self.model.check_kv_pool(kv)
        mesh_devices = set(self.mesh.devices.flat)
        for name, leaf in (("k", kv.k), ("k_scale", kv.k_scale)):
            devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
            if devices is not None and not devices <= mesh_devices:
                raise ValueError(f"kv.{name} lies on devices {sorted(d.id for d in devices)}, outside the mesh's "
                                 f"{sorted(d.id for d in mesh_devices)}; make the pool with make_kv_pool")

    def kv_bytes_per_device(self, num_pages: int, page_size: int, dtype=jnp.float32) -> int:
        """Bytes of latent pages one device holds: the whole pool (replicated;
        module docstring), ``num_pages * page_size * config.kv_bytes_per_token``.

        Raises:
          ValueError: ``num_pages`` below 2, ``page_size`` below 1 (or not
            ints), a dtype the pool does not take.
        """
        check_int("num_pages", num_pages, 2)
        check_int("page_size", page_size)
        return num_pages * page_size * self.config.kv_bytes_per_token(common.check_kv_dtype("dtype", dtype))
