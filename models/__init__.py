"""Decoders that run on the paged KV cache, and the loaders for their checkpoints.

Modules: ``config`` (``LlamaConfig``), ``llama`` (a Flax NNX Llama-family
decoder over a paged KV pool), ``ragged`` (its forward over the engine's
flat batch, ``RaggedModel``), ``sharded`` (the decoder over a mesh),
``smollm2`` (SmolLM2-135M-Instruct from its GGUF, and a greedy generation
helper for tests), ``tokenizer`` (the GGUF's byte-level BPE and chat
template), ``train`` (the dense forward's loss and an optax train step),
``presets`` (random-weight models of published shapes), ``llm`` (offline
generation: a checkpoint and text prompts in, text out).

Rooms: ``loading`` reads checkpoints (``gguf_loader``: GGUF -> config + f32
numpy weights, ``gguf_families`` each architecture's metadata, ``hf_config``
a Hugging Face ``config.json`` of Llama 2-3.3, Mistral, Qwen2/3, Gemma 2/3
or OLMo 2 as a ``LlamaConfig`` or a refusal naming the field,
``hf_loader`` those folders: safetensors weights, ``tokenizer.json``, chat
template, ``checkpoint`` weights and config in one safetensors file);
``layers`` holds what more than one decoder uses (``rope``: RoPE and its
``linear``, ``llama3`` and YaRN scalings; ``moe``: mixture-of-experts
routers and routed experts).

Axis alphabet, stated here once and used in every einsum and shape comment
of ``models/``, ``paged_jax/`` and ``pallas_kernels/``:

  B batch (sequences)        T query tokens per sequence (flat: of the call)
  S key tokens               N query heads
  K KV heads                 G query heads per KV head (N = K * G)
  H head dim                 P pages in the KV pool
  L page size (tokens)       D model dim
  F MLP hidden dim           V vocabulary
  E sequence rows of a flat batch (the page state's rows, empty ones
    included: ``block_tables`` is i32[E, pages_per_seq])
  R rows whose logits a flat batch returns

A module that tiles work adds its own letters and says so
(``paged_jax.attention.ragged``: U, Q, M, W, J, C).

Imports run one way: ``models -> paged_jax``, never back.
"""
