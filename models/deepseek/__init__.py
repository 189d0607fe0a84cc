"""DeepSeek-V3-architecture decoders (Kimi K2 shares it): MLA over latent pages and
mixture-of-experts layers. ``config`` (the shape and its ``config.json``), ``model``
(weights, the flat ragged forward, the engine's model), ``loader`` (Hugging Face folders), ``gguf`` (llama.cpp's ``deepseek2`` GGUFs)."""
