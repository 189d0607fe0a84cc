"""Serving over several devices: :mod:`~paged_jax.distributed.sharding` (a mesh
with a data and a model axis, KV heads and pages placed on it) and
:mod:`~paged_jax.distributed.data_parallel` (one engine per data shard)."""
