"""KV tiers: the prefix cache's pages beyond the device pool.

- :mod:`~paged_jax.tiers.host`: the host tier as a store (cached pages the
  pool evicted, in host memory, least recently used out by bytes, keyed as
  the device cache keys them);
- :mod:`~paged_jax.tiers.offload`: the engine's traffic with it: evicted
  pages spilled in one copy per round, a prefix hit that runs on into the
  host tier loaded back before the request's first call, counted by tier.

This room sits between the page-state core and the engine: it imports
:mod:`paged_jax.paging` (the prefix cache's keys, the pool's copies out and
in) and nothing above it; the KV manager
(:mod:`paged_jax.engine.kv_manager`) decides when pages leave and return.
"""
