"""The page-state core: where each token's K/V live, and who holds each page.

- :mod:`~paged_jax.paging.page_state`: block tables, reference counts and the
  free-page queue as one pytree, with pure ``state -> state`` functions
  (allocate, append, fork, copy-on-write, free);
- :mod:`~paged_jax.paging.free_queue`: the FIFO of free pages inside it;
- :mod:`~paged_jax.paging.slots`: slot mappings, token position -> pool slot;
- :mod:`~paged_jax.paging.kv_cache`: the KV page pool (f32, bf16, int8, fp8
  pages) and its writes;
- :mod:`~paged_jax.paging.kv_groups`: layer groups of hybrid models, one block
  table each;
- :mod:`~paged_jax.paging.sliding_window`: pages a window no longer sees;
- :mod:`~paged_jax.paging.block_pool`: the host's exact twin of the page state;
- :mod:`~paged_jax.paging.prefix_cache`: full pages keyed by a hash chain;
- :mod:`~paged_jax.paging.swap`: preempted sequences' pages in host memory.

Nothing here imports the attention, the engine or a model.
"""
