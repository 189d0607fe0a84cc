"""Tiny random Hugging Face checkpoints of the families tests/test_families.py
holds against transformers: one config per family, written with
``save_pretrained`` into a folder (no download).

Every checkpoint is small (model dim 64, vocabulary 256, 2 layers; Gemma 3:
6, so its 5 sliding : 1 global pattern shows) and sets what makes its
family differ from Llama to a value that changes the answer: an 8-token
sliding window against prompts of 20-30 tokens, RoPE scaling whose
thresholds fall inside the head's frequencies, soft caps small enough that
``tanh`` bends the logits, a ``query_pre_attn_scalar`` other than the head
dim, a head dim other than ``D / N``, top-2 of 8 experts renormalized. Weights are random at unit-ish scale
(norm weights too), so a mapping error cannot hide behind zeros or ones.
"""

import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch  # noqa: E402  (the test extra: the oracle must be there, never skipped)
import transformers  # noqa: E402

VOCAB = 256
WINDOW = 8
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)

FAMILIES = {
    # Llama 3.1: head dim 16 has wavelengths 6.3, 20, 63, ... tokens; with an
    # original context of 32 (thresholds 8 and 32) pair 0 is kept, pair 1
    # smoothed and the rest divided by 8.
    "llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Qwen3: head dim 32 (not 64 / 4), YaRN over an original context of 32,
    # layer 0 global and layer 1 sliding (max_window_layers=1).
    "qwen3": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32})),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=8,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Gemma 3: sliding layers at base 100 (local), global ones at 1e4 with
    # linear scaling by 2; final soft cap set (Gemma 3 has none by default).
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                   final_logit_softcapping=4.0, rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "olmo2": ("olmo2", dict()),
    # Qwen3-MoE: every MLP 8 experts of width 32, top-2, renormalized.
    "qwen3moe": ("qwen3_moe", dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 10000.0})),
}
"""name -> (model_type, config fields beyond :data:`DIMS`)."""

PLUS_ONE_NORMS = ("gemma2", "gemma3_text")
"""Families whose RMSNorm weight ``w`` multiplies as ``1 + w``."""


def hf_config(name: str) -> transformers.PretrainedConfig:
    model_type, extra = FAMILIES[name]
    return transformers.AutoConfig.for_model(model_type, **{**DIMS, **extra})


def write_checkpoint(folder: pathlib.Path, name: str, dtype=torch.float32) -> None:
    """A random checkpoint of family ``name`` saved into ``folder``."""
    model_type, _ = FAMILIES[name]
    torch.manual_seed(list(FAMILIES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # effective scale 1 +- 0.2 either way
                p.copy_((0.0 if model_type in PLUS_ONE_NORMS else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    model.to(dtype).save_pretrained(folder)


def load_transformers(folder: pathlib.Path):
    """The checkpoint in transformers, f32, eager attention (the reference),
    generating fixed-length continuations (no EOS)."""
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    return hf
