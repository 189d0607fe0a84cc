"""Pallas paged-attention kernels, each beside its pure-jnp reference.

* ``paged_attention_gpu``: decode kernel for GPUs (Triton lowering).
* ``paged_attention_tpu``: decode kernel for TPUs (scalar prefetch, double-
  buffered page DMAs).
* ``ragged_paged_attention``: mixed prefill/decode batches padded to
  ``[B, T]``, causal (Triton lowering).
* ``flat_ragged_attention``: the engine's kernel on GPU and TPU: a packed
  (flat) token batch, decode and chunks, causal, the new tokens' K/V
  written by the call (GPU: Triton; ``flat_ragged_tpu``: Mosaic), beside
  its jnp reference; ``flat_batch``: the flat batch's tiles and checks,
  shared with ``paged_jax.attention.ragged``'s XLA work list.
* ``common``: the shared input validator, the per-sequence reference, the
  K/V page dtypes and their quantization (int8, fp8) and the scale convention.

Kernels take arrays only; this package imports nothing from ``paged_jax``.
"""
