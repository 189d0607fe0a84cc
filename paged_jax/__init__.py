"""paged-jax: paged attention in JAX (PagedAttention, Kwon et al., SOSP 2023).

The package is laid out in the order the data flows, and imports run one way,
from the engine down to the page-state core (``tests/test_layout.py`` keeps it so):

- :mod:`paged_jax.paging`: the page-state core: block tables, reference counts and
  the free-page queue as a pure, jittable pytree; slot mappings; the KV page
  pool; layer groups and sliding windows; the host's block pool, the prefix
  cache and swap space.
- :mod:`paged_jax.attention`: paged attention in XLA (the padded ``[B, T]``
  batch and the flat ragged batch) and the dispatcher to the Pallas kernels.
- :mod:`paged_jax.engine`: the continuous-batching serving engine: requests,
  scheduler, KV-cache manager, the jitted step, sampling, beams, outputs,
  detokenization and statistics.
- :mod:`paged_jax.distributed`: device meshes and data parallelism.

Beside them: :mod:`paged_jax.memory` (KV-size maths and the capacity planner,
arithmetic only), :mod:`paged_jax.checks` (the door checks every package
shares), :mod:`paged_jax.jit_stats` and :mod:`paged_jax.profiling`.
"""
