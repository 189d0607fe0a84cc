"""Pallas paged-attention kernels, each beside its pure-jnp reference.

* ``paged_attention_gpu``: decode kernel for GPUs (Triton lowering).
* ``paged_attention_tpu``: decode kernel for TPUs (scalar prefetch, double-
  buffered page DMAs).
* ``ragged_paged_attention``: mixed prefill/decode batches, causal (Triton
  lowering).
* ``common``: the shared input validator, the per-sequence reference, the
  K/V page dtypes and their quantization (int8, fp8) and the scale convention.

Kernels take arrays only; this package imports nothing from ``paged_jax``.
"""
