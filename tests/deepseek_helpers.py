"""Shared by the DeepSeek tests (tests/test_deepseek*.py): tiny checkpoints
written by transformers (three of them: all dense; query LoRA, MoE layers,
YaRN and interleaved RoPE; DeepSeek-V2's softmax routing), prompts and a
schedule of flat mixed batches."""

import numpy as np  # noqa: I001  (family_helpers before torch: it sets HF_HUB_OFFLINE before transformers loads)

import tests.family_helpers  # noqa: F401

import torch
import transformers

LOGIT_ATOL = 5e-5
VOCAB = 96
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((23, 17, 30))]
NEW_TOKENS = 8

DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CHECKPOINTS = {
    "dense": dict(q_lora_rank=None, first_k_dense_replace=3, n_routed_experts=8, num_experts_per_tok=2,
                  rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "moe": dict(q_lora_rank=48, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 0.707, "mscale_all_dim": 0.707}),
    # DeepSeek-V2's softmax routing (group_limited_greedy, unnormalized weights) and complex-pair RoPE.
    "v2": dict(q_lora_rank=None, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
               topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2, moe_intermediate_size=32,
               routed_scaling_factor=1.5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 0.707, "mscale_all_dim": 0.707}),
}
ARCHITECTURES = {"v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM")}


def write_checkpoint(name, tmp_path_factory):
    """The checkpoint ``name`` of :data:`CHECKPOINTS` written by transformers: (name, folder, the model, its
    logits per prompt f32[n, V])."""
    config_cls, model_cls = ARCHITECTURES.get(name, ("DeepseekV3Config", "DeepseekV3ForCausalLM"))
    config = getattr(transformers, config_cls)(**DIMS, **CHECKPOINTS[name])
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight") or "layernorm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for module in hf.modules():
            if isinstance(module, transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter):
                module.e_score_correction_bias.copy_(0.3 * torch.randn_like(module.e_score_correction_bias))
    folder = tmp_path_factory.mktemp(f"deepseek-{name}")
    hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]
    return name, folder, hf, logits


SCHEDULE = [
    [(0, PROMPTS[0][:13]), (1, PROMPTS[1][:6])],
    [(0, PROMPTS[0][13:20]), (1, PROMPTS[1][6:7]), (2, PROMPTS[2][:22])],
    [(0, PROMPTS[0][20:21]), (1, PROMPTS[1][7:17]), (2, PROMPTS[2][22:23])],
]


def check_schedule(name, got, want):
    seen = [0, 0, 0]
    worst = 0.0
    for call, logits in zip(SCHEDULE, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            w = want[row][seen[row] - 1]
            worst = max(worst, float(np.abs(logits[row] - w).max()))
            np.testing.assert_allclose(logits[row], w, atol=LOGIT_ATOL, err_msg=f"{name} row {row} at {seen[row]}")
    print(f"{name}: largest logit difference {worst:.2e}")


