"""DeepSeek-V3 and DeepSeek-V2 checkpoints from Hugging Face folders
(``DeepseekV3ForCausalLM``, ``DeepseekV2ForCausalLM``: ``config.json`` and
safetensors, the Hub's layout with one tensor per expert), into :class:`models.deepseek.model.DeepseekModel`'s weights.

What changes on the way: every ``[out, in]`` matrix is transposed to
``[in, out]``; ``kv_b_proj`` is split per head into ``w_uk`` [N, H, C] and
``w_uv`` [N, C, Dv] (the absorbed form's up-projections); with
``rope_interleave`` (the default) the RoPE dims of ``q_b_proj`` /
``q_proj`` and ``kv_a_proj_with_mqa`` are reordered from interleaved pairs
to halves, so the decoder rotates halves as every model here does and the
latent it caches equals transformers' ``k_rot`` value for value. The
``num_nextn_predict_layers`` layers past ``num_hidden_layers`` that hold an
``eh_proj`` (DeepSeek-V3's multi-token-prediction layer 61, which
transformers does not run either) are not read; any other tensor the decoder has no place for is refused by
name (an expert, a layer or a shared expert the config does not count, a
bias), as the Llama loader refuses it.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from models.deepseek.config import DeepseekConfig, config_from_hf, rope_interleaved
from models.deepseek.model import FLOAT32_PARAMS, DeepseekModel, param_shapes
from models.loading.hf_config import CONFIG
from models.loading.hf_loader import Tensors, check_param_dtype, checkpoint_folder, read_json, refuse_unexpected


def read_deepseek_config(folder: str | os.PathLike) -> DeepseekConfig:
    """The :class:`DeepseekConfig` of a checkpoint folder (``config.json``
    only).

    Raises:
      FileNotFoundError: no such folder or ``config.json``.
      ValueError: as :func:`models.deepseek.config.config_from_hf`.
    """
    path = checkpoint_folder(folder) / CONFIG
    return config_from_hf(read_json(path), str(path))


def _nextn_layers(cfg: dict, path: str) -> int:
    """``num_nextn_predict_layers`` (0 when absent): the multi-token-prediction
    layers stored after the decoder's."""
    n = cfg.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{path}: num_nextn_predict_layers must be an int >= 0, got {n!r}")
    return n


def _halves(rope_dims: int) -> np.ndarray:
    """The order that takes interleaved pairs ``(0, 1), (2, 3), ...`` to
    halves ``0, 2, 4, ..., 1, 3, 5, ...``."""
    return np.concatenate([np.arange(0, rope_dims, 2), np.arange(1, rope_dims, 2)])


def load_hf_deepseek(folder: str | os.PathLike, *, param_dtype=jnp.float32, impl: str = "auto") -> DeepseekModel:
    """A :class:`DeepseekModel` with a Hugging Face DeepSeek-V3 or -V2
    checkpoint's weights.

    Args:
      folder: the checkpoint folder.
      param_dtype: f32, bf16 or f16: the weights' dtype (the router's stay
        f32, as in transformers).
      impl: the attention implementation.

    Raises:
      FileNotFoundError: the folder, ``config.json`` or the weights are
        missing.
      ValueError: an unsupported config; a tensor missing, misshapen or of
        an unsupported dtype (each named with its file); a tensor the
        decoder has no place for (module docstring); a bad
        ``param_dtype``.
    """
    check_param_dtype(param_dtype)
    folder = checkpoint_folder(folder)
    cfg = read_json(folder / CONFIG)
    config = config_from_hf(cfg, str(folder / CONFIG))
    tensors = Tensors(folder)
    # A multi-token-prediction layer holds eh_proj (its projection of [embedding, hidden]): a decoder layer past
    # num_hidden_layers does not, and is refused (a config that undercounts the layers would truncate the model).
    mtp = {k for k in range(config.num_layers, config.num_layers + _nextn_layers(cfg, str(folder / CONFIG)))
           if f"model.layers.{k}.eh_proj.weight" in tensors.where}
    return model_from_tensors(config, tensors, interleaved=rope_interleaved(cfg, str(folder / CONFIG)),
                              param_dtype=param_dtype, impl=impl,
                              ignore=lambda name: name.startswith("model.layers.") and name.split(".")[2].isdigit()
                              and int(name.split(".")[2]) in mtp)


def model_from_tensors(config: DeepseekConfig, tensors, *, interleaved: bool, param_dtype=jnp.float32,
                       impl: str = "auto", ignore=lambda name: False) -> DeepseekModel:
    """A :class:`DeepseekModel` of ``config`` with the weights ``tensors``
    holds under their Hugging Face names (a folder's
    :class:`models.loading.hf_loader.Tensors`, or a GGUF's, renamed by
    :mod:`models.deepseek.gguf`).

    Args:
      config: the decoder.
      tensors: has ``where`` (the names it holds), ``listing`` (what to
        blame a missing tensor on) and ``read(wanted, use)``.
      interleaved: the RoPE dims come as interleaved pairs (reordered to
        halves here; module docstring).
      param_dtype, impl: as :func:`load_hf_deepseek`.
      ignore: names not to refuse although the decoder has no place for
        them.

    Raises:
      ValueError: a tensor missing, misshapen or unexpected (named).
    """
    c = config
    D, N, C, R, H, Dv = c.model_dim, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    order = _halves(R) if interleaved else np.arange(R)
    shapes = param_shapes(config)
    params = {name: (np.empty(shape, np.float32) if isinstance(shape, tuple)
                     else {k: np.empty(s, np.float32) for k, s in shape.items()}) for name, shape in shapes.items()}
    layout = {}  # HF tensor name -> (its stored shape, where it goes: (stack or None, layer, name), transform)

    def put(name, shape, stack, layer, key, fn):
        layout[name] = (shape, stack, layer, key, fn)

    def query(w):  # [N (H + R), in] -> [in, N, H + R], RoPE dims as halves
        w = w.reshape(N, H + R, -1)
        return np.concatenate([w[:, :H], w[:, H:][:, order]], axis=1).transpose(2, 0, 1)

    put("model.embed_tokens.weight", (c.vocab_size, D), None, None, "embed", lambda w: w)
    put("model.norm.weight", (D,), None, None, "final_norm", lambda w: w)
    if not c.tie_embeddings:
        put("lm_head.weight", (c.vocab_size, D), None, None, "lm_head", lambda w: w)
    for i in range(c.num_layers):
        stack, j = ("dense", i) if i < c.num_dense_layers else ("moe", i - c.num_dense_layers)
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", (D,), stack, j, "attn_norm", lambda w: w)
        put(p + "post_attention_layernorm.weight", (D,), stack, j, "mlp_norm", lambda w: w)
        a = p + "self_attn."
        if c.q_lora_rank is None:
            put(a + "q_proj.weight", (N * (H + R), D), stack, j, "q", query)
        else:
            Q = c.q_lora_rank
            put(a + "q_a_proj.weight", (Q, D), stack, j, "q_a", lambda w: w.T)
            put(a + "q_a_layernorm.weight", (Q,), stack, j, "q_a_norm", lambda w: w)
            put(a + "q_b_proj.weight", (N * (H + R), Q), stack, j, "q_b", query)
        put(a + "kv_a_proj_with_mqa.weight", (C + R, D), stack, j, "kv_a",
            lambda w: np.concatenate([w[:C], w[C:][order]]).T)
        put(a + "kv_a_layernorm.weight", (C,), stack, j, "kv_a_norm", lambda w: w)
        put(a + "kv_b_proj.weight", (N * (H + Dv), C), stack, j, ("w_uk", "w_uv"),
            lambda w: (w.reshape(N, H + Dv, C)[:, :H], w.reshape(N, H + Dv, C)[:, H:].transpose(0, 2, 1)))
        put(a + "o_proj.weight", (D, N * Dv), stack, j, "o", lambda w: w.reshape(D, N, Dv).transpose(1, 2, 0))
        m = p + "mlp."
        if stack == "dense":
            F = c.mlp_dim
            put(m + "gate_proj.weight", (F, D), stack, j, "gate", lambda w: w.T)
            put(m + "up_proj.weight", (F, D), stack, j, "up", lambda w: w.T)
            put(m + "down_proj.weight", (D, F), stack, j, "down", lambda w: w.T)
            continue
        E, Im, Is = c.router.num_experts, c.moe_mlp_dim, c.moe_mlp_dim * c.num_shared_experts
        put(m + "gate.weight", (E, D), stack, j, "router", lambda w: w)
        if c.router.scoring == "sigmoid":
            put(m + "gate.e_score_correction_bias", (E,), stack, j, "bias", lambda w: w)
        for e in range(E):
            x = f"{m}experts.{e}."
            put(x + "gate_proj.weight", (Im, D), stack, (j, e), "w_gate", lambda w: w.T)
            put(x + "up_proj.weight", (Im, D), stack, (j, e), "w_up", lambda w: w.T)
            put(x + "down_proj.weight", (D, Im), stack, (j, e), "w_down", lambda w: w.T)
        if Is:
            put(m + "shared_experts.gate_proj.weight", (Is, D), stack, j, "shared_gate", lambda w: w.T)
            put(m + "shared_experts.up_proj.weight", (Is, D), stack, j, "shared_up", lambda w: w.T)
            put(m + "shared_experts.down_proj.weight", (D, Is), stack, j, "shared_down", lambda w: w.T)

    def use(name: str, array: np.ndarray) -> None:
        _, stack, layer, key, fn = layout[name]
        values = fn(array.astype(np.float32))
        for k, v in zip(key if isinstance(key, tuple) else (key,), values if isinstance(key, tuple) else (values,)):
            if stack is None:
                params[k][...] = v
            else:
                params[stack][k][layer] = v

    refuse_unexpected(tensors, layout, tied=c.tie_embeddings, ignore=ignore)
    tensors.read({name: spec[0] for name, spec in layout.items()}, use)

    def cast(name, a):
        return jnp.asarray(a, jnp.float32 if name in FLOAT32_PARAMS else param_dtype)

    out = {name: (cast(name, v) if isinstance(v, np.ndarray) else {k: cast(k, a) for k, a in v.items()})
           for name, v in params.items()}
    return DeepseekModel(config, out, impl=impl)
