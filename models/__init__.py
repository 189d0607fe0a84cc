"""Decoders that run on the paged KV cache, and the loaders for their checkpoints.

Modules: ``gguf_loader`` (GGUF -> config + f32 numpy weights), ``tokenizer``
(the GGUF's byte-level BPE and chat template), ``llama`` (a Flax NNX
Llama-family decoder over a paged KV pool), ``smollm2`` (SmolLM2-135M-Instruct
from its GGUF, and a greedy generation helper for tests), ``train`` (the
dense forward's loss and an optax train step), ``checkpoint`` (weights and
config in one safetensors file), ``hf_loader`` (Hugging Face Llama / Mistral /
Qwen2 folders: safetensors weights, ``tokenizer.json``, chat template).

Axis alphabet, used in every einsum and shape comment under ``models/``:

  B batch (sequences)        T query tokens per sequence
  S key tokens               N query heads
  K KV heads                 G query heads per KV head (N = K * G)
  H head dim                 P pages in the KV pool
  L page size (tokens)       D model dim
  F MLP hidden dim           V vocabulary

Imports run one way: ``models -> paged_jax``, never back.
"""
