"""DeepSeek GGUFs (llama.cpp's ``deepseek2``) against transformers on the
folder they were converted from.

No transformers reader exists for ``deepseek2`` GGUFs, so the oracle is the
folder: :func:`write_gguf` writes each tiny checkpoint of
``tests/test_deepseek.py`` as llama.cpp's converter does
(``DeepseekV2Model.set_gguf_parameters`` / ``modify_tensors`` and
``TextModel.set_gguf_parameters``: MLA as one-KV-head attention over the
latent, ``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b``,
experts stacked, the correction bias as ``exp_probs_b.bias``, YaRN's
``mscale_all_dim`` as ``yarn_log_multiplier``, the RoPE dims left
interleaved; tensor names from gguf-py's own map), and the model read back
must give transformers' logits on the folder. An older file layout
(``attn_kv_b`` whole, per-head key and value lengths) is written for the V2
checkpoint, which also lacks ``expert_gating_func``, as V2 files converted
before that key existed do.
"""

import json  # noqa: I001  (family_helpers before torch: it sets HF_HUB_OFFLINE before transformers loads)
import pathlib
import warnings

import gguf
import numpy as np
import pytest
import safetensors.numpy

import tests.family_helpers  # noqa: F401

import torch

from models.deepseek.config import config_from_hf
from models.deepseek.gguf import load_gguf_deepseek, read_gguf_deepseek_config
from models.llm import LLM, load_model
from models.smollm2 import load_llama_gguf
from tests.decoder_helpers import mixed_calls
from tests.deepseek_helpers import DIMS, PROMPTS, SCHEDULE, check_schedule, write_checkpoint

BOTH = pytest.mark.parametrize("checkpoint", ["moe", "v2"], indirect=True)
"""The interleaved-RoPE checkpoints (llama.cpp rotates adjacent pairs for ``deepseek2``, so the ``dense``
checkpoint, written with ``rope_interleave`` off, has no faithful GGUF)."""


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    """tests/deepseek_helpers.py's checkpoint ``request.param``."""
    return write_checkpoint(request.param, tmp_path_factory)


def write_gguf(folder: pathlib.Path, path: pathlib.Path, *, split_kv_b: bool = True, gating: bool = True,
               drop=(), extra=None, meta=None) -> pathlib.Path:
    """The folder's checkpoint as llama.cpp's converter writes it (module
    docstring); ``split_kv_b`` False and ``gating`` False write an older
    converter's file. ``drop`` (GGUF names) and ``extra`` ({name: array})
    change the tensors, ``meta`` ({key suffix: value}) overrides metadata."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    N, C, R = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    H, Dv = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(N)
    w.add_head_count_kv(1 if split_kv_b else N)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    # Released configs name their scoring function (DeepSeek-V3's "sigmoid", V2's "softmax"); transformers' own
    # config classes do not write one, so it is added here as the release's config.json would have it.
    scoring = cfg.get("scoring_func") or {"deepseek_v3": "sigmoid", "deepseek_v2": "softmax"}[cfg["model_type"]]
    if gating:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[scoring])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(C)
    if split_kv_b:
        w.add_key_length(C + R)
        w.add_value_length(C)
        w.add_key_length_mla(H + R)
        w.add_value_length_mla(Dv)
    else:
        w.add_key_length(H + R)
        w.add_value_length(Dv)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(R)
    for suffix, value in (meta or {}).items():
        add = (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
               else w.add_string if isinstance(value, str) else w.add_float32)
        add(f"deepseek2.{suffix}", value)  # overwrites
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg["num_hidden_layers"])
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        if f"model.layers.{i}.mlp.experts.0.up_proj.weight" in tensors:
            for proj in ("down_proj", "gate_proj", "up_proj"):
                tensors[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack(
                    [tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")
                     for e in range(cfg["n_routed_experts"])])
    for hf_name, data in tensors.items():
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split_kv_b and hf_name.endswith("kv_b_proj.weight"):
            kv_b = data.reshape(N, H + Dv, C)
            out[names.get_name(hf_name.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",))] = \
                np.ascontiguousarray(kv_b[:, :H].transpose(0, 2, 1))
            out[names.get_name(hf_name.replace("kv_b_proj", "v_b_proj"), try_suffixes=(".weight",))] = kv_b[:, H:]
            continue
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, hf_name
        out[new] = data
    out.update(extra or {})
    for name, data in out.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@BOTH
def test_the_config_equals_the_folders(checkpoint, tmp_path):
    name, folder, _, _ = checkpoint
    want = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert read_gguf_deepseek_config(write_gguf(folder, tmp_path / "new.gguf")) == want
    # Before the split (early 2025): attn_kv_b whole; V2 files then had no gating function (V3 ones did).
    assert read_gguf_deepseek_config(write_gguf(folder, tmp_path / "old.gguf", split_kv_b=False,
                                                gating=name != "v2")) == want


@BOTH
def test_ragged_batches_match_transformers_on_the_folder(checkpoint, tmp_path):
    """Flat mixed batches on a NaN-filled latent pool, from the GGUF: each
    chunk's last logits equal transformers' on the folder (the V2 one read
    from an older converter's layout)."""
    name, folder, _, want = checkpoint
    path = write_gguf(folder, tmp_path / "m.gguf", split_kv_b=name != "v2", gating=name != "v2")
    check_schedule(f"{name} gguf", mixed_calls(load_gguf_deepseek(path), SCHEDULE), want)


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_llm_and_the_benchmarks_take_the_gguf(checkpoint, tmp_path):
    """``LLM`` / ``load_model`` dispatch on the architecture (a latent
    pool; no tokenizer in this file, so token ids), the benchmarks'
    preflight reads the config, and the Llama loader names where it goes."""
    from experiments.lib import preflight

    _, folder, hf, _ = checkpoint
    path = write_gguf(folder, tmp_path / "m.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the file
        model, tokenizer, name = load_model(str(path))
        llm = LLM(str(path), kv_tokens=256, page_size=4, max_seqs=2)
    assert tokenizer is None and name == "m.gguf" and model.config == preflight.model_config(str(path))
    assert llm.engine.kv.latent and llm.engine.kv.head_dim == 40
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                            eos_token_id=DIMS["eos_token_id"])[0, len(p):].tolist() for p in PROMPTS[:2]]
    assert [o.output_ids for o in llm.generate(PROMPTS[:2], max_tokens=6)] == want
    with pytest.raises(ValueError, match="'deepseek2' is DeepSeek-V2 / V3 .*load_gguf_deepseek"):
        load_llama_gguf(path)


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_what_the_decoder_cannot_take_is_refused_by_name(checkpoint, tmp_path):
    _, folder, _, _ = checkpoint

    def refused(match, **kwargs):
        path = write_gguf(folder, tmp_path / f"{len(list(tmp_path.iterdir()))}.gguf", **kwargs)
        with pytest.raises(ValueError, match=match):
            load_gguf_deepseek(path)

    refused(r"no place for: \['blk.1.attn_q.bias'\]", extra={"blk.1.attn_q.bias": np.ones(4)})
    refused(r"no place for: \['blk.3.attn_norm.weight'\]", extra={"blk.3.attn_norm.weight": np.ones(64)})
    refused(r"'blk.1.attn_k_b.weight'\] without its other half", drop=("blk.1.attn_v_b.weight",))
    refused(r"lacks the tensor that holds 'model.layers.2.mlp.experts.0.up_proj.weight' \(gguf names: "
            r"'blk.2.ffn_up_exps.weight'\)", drop=("blk.2.ffn_up_exps.weight",))
    refused(r"'blk.1.ffn_gate_exps.weight' has shape \[7, 32, 64\]; expected 8 stacked experts",
            extra={"blk.1.ffn_gate_exps.weight": np.ones((7, 32, 64))})
    refused(r"deepseek2.expert_gating_func=3; supported", meta={"expert_gating_func": 3})
    refused(r"deepseek2.attention.head_count_kv=4; MLA converted as multi-query", meta={"attention.head_count_kv": 4})
    refused(r"'blk.1.attn_kv_a_norm.weight' gives .* the shape \[31\]",
            extra={"blk.1.attn_kv_a_norm.weight": np.ones(31)})
    # A layer id written another way is not layer 1 (it would overwrite it); both forms of kv_b at once.
    refused(r"no place for: \['blk.01.attn_norm.weight'\]", extra={"blk.01.attn_norm.weight": np.ones(64)})
    refused(r"'blk.0.attn_kv_b.weight' and 'blk.0.attn_k_b.weight \+ blk.0.attn_v_b.weight' both hold",
            extra={"blk.0.attn_kv_b.weight": np.ones((4 * 32, 32))})
    # Metadata of the wrong type is refused, not converted.
    refused(r"deepseek2.expert_weights_norm='false'; expected true or false", meta={"expert_weights_norm": "false"})
    refused(r"deepseek2.expert_gating_func=True; expected one integer", meta={"expert_gating_func": True})
    refused(r"deepseek2.rope.freq_base='1e4'; expected a number", meta={"rope.freq_base": "1e4"})
    refused(r"deepseek2.leading_dense_block_count=5; more leading dense layers than block_count=3",
            meta={"leading_dense_block_count": 5})


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_a_sigmoid_router_without_a_correction_bias_routes_with_zero(checkpoint, tmp_path):
    """llama.cpp reads ``exp_probs_b`` as optional: without it the router's
    bias is zero, here as there."""
    _, folder, _, _ = checkpoint
    path = write_gguf(folder, tmp_path / "m.gguf", drop=("blk.1.exp_probs_b.bias", "blk.2.exp_probs_b.bias"))
    model = load_gguf_deepseek(path)
    assert not np.asarray(model.params["moe"]["bias"]).any()
