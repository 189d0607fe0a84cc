"""Speculative decoding's parts that need no engine (Leviathan et al., 2023;
Chen et al., 2023): proposers that guess a sequence's next tokens
(:mod:`paged_jax.speculative.proposers`) and the verification that keeps
what the target model would have produced (:mod:`paged_jax.speculative.verify`).
The page rollback of rejected tokens is
:func:`paged_jax.paging.page_state.truncate`.

This room sits below the engine: it imports neither the engine nor a
model, and works on token ids and probabilities.
"""
