"""DeepSeek-V2 / V3 / Kimi K2 GGUFs (llama.cpp architecture ``deepseek2``)
into :class:`models.deepseek.model.DeepseekModel`.

What llama.cpp's converter (``DeepseekV2Model`` in ``convert_hf_to_gguf.py``,
registered for ``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``)
writes, and how it is read back here:

- MLA as multi-query attention over the latent: ``attention.head_count_kv``
  1, ``attention.key_length`` = ``kv_lora_rank + qk_rope_head_dim`` (the
  576-wide latent), ``attention.value_length`` = ``kv_lora_rank``; the
  per-head sizes as ``attention.key_length_mla`` (``qk_nope_head_dim +
  qk_rope_head_dim``) and ``attention.value_length_mla`` (``v_head_dim``),
  ``rope.dimension_count`` = ``qk_rope_head_dim``,
  ``attention.kv_lora_rank`` and ``attention.q_lora_rank`` (absent without
  a query LoRA, as in DeepSeek-V2-Lite). Files converted before llama.cpp
  split ``kv_b_proj`` (early 2025) have no ``*_mla`` keys: there
  ``key_length`` is the per-head ``qk_nope_head_dim + qk_rope_head_dim``
  and ``value_length`` the ``v_head_dim``.
- ``kv_b_proj`` [N (H + O), C] split per head into ``attn_k_b``, stored
  transposed as [N, C, H], and ``attn_v_b`` [N, O, C] (NumPy order); older
  files hold ``attn_kv_b`` whole. Both are put back together into
  ``kv_b_proj`` here, which :func:`models.deepseek.loader.model_from_tensors`
  splits into ``w_uk`` / ``w_uv`` as for a Hugging Face folder.
- Mixture of experts: ``expert_count``, ``expert_used_count``,
  ``expert_shared_count``, ``expert_feed_forward_length``,
  ``leading_dense_block_count`` (``first_k_dense_replace``),
  ``expert_weights_scale`` (``routed_scaling_factor``; 1 when absent, as
  llama.cpp), ``expert_weights_norm`` (written only when true),
  ``expert_group_count`` / ``expert_group_used_count`` (``n_group`` /
  ``topk_group``), ``expert_gating_func`` (2 sigmoid: DeepSeek-V3 and Kimi
  K2; 1 softmax: DeepSeek-V2; absent in V2 files converted before the key
  existed, which llama.cpp reads as softmax). Experts are stacked, one
  tensor a projection (``ffn_{gate,up}_exps`` [E, I, D], ``ffn_down_exps``
  [E, D, I]), shared experts as ``ffn_*_shexp``, the router as
  ``ffn_gate_inp``, the correction bias as ``exp_probs_b.bias`` (llama.cpp
  reads it as optional: a sigmoid router without one routes with a zero
  bias, and so does this loader).
- RoPE: the converter leaves the RoPE dims in the checkpoint's interleaved
  pairs and llama.cpp rotates adjacent pairs for ``deepseek2``
  (``LLAMA_ROPE_TYPE_NORM``), so the loader reorders them to halves as for a
  folder with ``rope_interleave``. YaRN writes ``rope.scaling.type`` yarn,
  ``factor``, ``original_context_length``, ``yarn_beta_fast`` /
  ``yarn_beta_slow`` and ``rope.scaling.yarn_log_multiplier`` = 0.1 x
  ``mscale_all_dim``; llama.cpp then assumes ``mscale == mscale_all_dim``
  (its cos and sin unscaled: every DeepSeek release has the two equal), and
  so does this reader.
- The multi-token-prediction layers are not converted (``skip_mtp``).

The model type read back is ``deepseek_v3`` for a sigmoid router (or a
model of dense layers only) and ``deepseek_v2`` for a softmax one, so
:func:`models.deepseek.config.config_from_hf` applies the same rules, and
refusals, as to the folder. Refused by name: another architecture, a
per-layer ``head_count_kv``, a ``head_count_kv`` other than 1 in a file
with the ``*_mla`` keys, a RoPE scaling type other than none or yarn, a
gating function other than softmax or sigmoid, and tensors the decoder has
no place for (by their GGUF names).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from models.config import check_param_dtype
from models.deepseek.config import DeepseekConfig, config_from_hf
from models.deepseek.loader import model_from_tensors
from models.deepseek.model import DeepseekModel
from models.loading.gguf_families import MISSING, arch_keys, f32_value

ARCH = "deepseek2"
"""The GGUF ``general.architecture`` this module reads."""
GATING = {1: "softmax", 2: "sigmoid"}
"""llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE`` values."""
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {  # blk.{i}.<gguf> -> model.layers.{i}.<hf> (gguf-py's tensor map for DEEPSEEK2)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")


def hf_config_fields(meta: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` a ``deepseek2`` GGUF's metadata
    stands for (module docstring).

    Args:
      meta: metadata key -> value.
      path: the file, for messages.

    Returns:
      A dict for :func:`models.deepseek.config.config_from_hf`.

    Raises:
      ValueError: another architecture, a missing key, or a value the
        decoder cannot compute; names ``path`` and the key.
    """
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"GGUF {path!r}: general.architecture={arch!r}; expected {ARCH!r} (DeepSeek-V2 / V3, "
                         "Kimi K2)")

    get, bad = arch_keys(meta, arch, path)

    def count(suffix: str, default=MISSING) -> int:
        value = get(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise bad(suffix, "expected one integer (a value per layer is not supported)")
        return int(value)

    def number(suffix: str, default=MISSING) -> float:
        value = get(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise bad(suffix, "expected a number")
        return f32_value(value)

    def flag(suffix: str, default: bool) -> bool:
        value = get(suffix, default)
        if not isinstance(value, (bool, np.bool_)):
            raise bad(suffix, "expected true or false")
        return bool(value)

    heads, rope_dim, latent = count("attention.head_count"), count("rope.dimension_count"), \
        count("attention.kv_lora_rank")
    if f"{arch}.attention.key_length_mla" in meta:  # MLA as MQA over the latent (llama.cpp since early 2025)
        if count("attention.head_count_kv", 1) != 1:
            raise bad("attention.head_count_kv", "MLA converted as multi-query attention has one KV head")
        if count("attention.key_length", latent + rope_dim) != latent + rope_dim:
            raise bad("attention.key_length", f"expected kv_lora_rank + rope dims = {latent + rope_dim}")
        qk_head, v_head = count("attention.key_length_mla"), count("attention.value_length_mla")
    else:  # an older file: key and value lengths are the per-head ones
        qk_head, v_head = count("attention.key_length"), count("attention.value_length")
    if qk_head <= rope_dim:
        raise ValueError(f"GGUF {path!r}: the query/key head ({qk_head}) must be wider than its RoPE dims "
                         f"({rope_dim})")
    layers = count("block_count")
    fields: dict[str, Any] = dict(
        num_hidden_layers=layers, hidden_size=count("embedding_length"),
        intermediate_size=count("feed_forward_length"), num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=latent, q_lora_rank=count("attention.q_lora_rank", 0) or None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=count("context_length", 4096), vocab_size=count("vocab_size"),
        rope_interleave=True, attention_bias=False, hidden_act="silu",
    )
    experts = count("expert_count", 0)
    gating = count("expert_gating_func", 1)
    if gating not in GATING:
        raise bad("expert_gating_func", f"supported: {GATING} (llama.cpp's gating function types)")
    sigmoid = GATING[gating] == "sigmoid"
    groups, kept = count("expert_group_count", 1), count("expert_group_used_count", 1)
    dense = count("leading_dense_block_count", 0)
    if dense > layers:
        raise bad("leading_dense_block_count", f"more leading dense layers than block_count={layers}")
    if experts:
        fields.update(n_routed_experts=experts, num_experts_per_tok=count("expert_used_count"),
                      moe_intermediate_size=count("expert_feed_forward_length"),
                      n_shared_experts=count("expert_shared_count", 0),
                      first_k_dense_replace=dense,
                      # 0 (or absent) is llama.cpp's "no scaling" (its scale_w off): a factor of 1
                      routed_scaling_factor=number("expert_weights_scale", 1.0) or 1.0,
                      n_group=groups, topk_group=kept, norm_topk_prob=flag("expert_weights_norm", False))
    else:
        fields["first_k_dense_replace"] = layers
    if sigmoid or not experts:
        fields.update(model_type="deepseek_v3", topk_method="noaux_tc", scoring_func="sigmoid")
    else:
        fields.update(model_type="deepseek_v2", scoring_func="softmax",
                      topk_method="group_limited_greedy" if groups > 1 else "greedy")
    fields["rope_parameters"] = _rope(get, bad, count, number)
    return fields


def _rope(get, bad, count, number) -> dict[str, Any]:
    """The ``rope_parameters`` of a ``deepseek2`` GGUF (module docstring)."""
    theta = number("rope.freq_base", 10000.0)
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise bad("rope.scaling.type", "DeepSeek GGUFs use 'none' or 'yarn'")
    mscale = number("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": number("rope.scaling.factor"),
            "original_max_position_embeddings": count("rope.scaling.original_context_length"),
            "mscale": mscale, "mscale_all_dim": mscale}
    for suffix, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if get(f"rope.scaling.{suffix}", None) is not None:
            rope[name] = number(f"rope.scaling.{suffix}")
    return rope


class GGUFTensors:
    """A ``deepseek2`` GGUF's dequantized tensors under the Hugging Face
    names :func:`models.deepseek.loader.model_from_tensors` reads: experts
    unstacked (views, no copies), ``kv_b_proj`` put back together.

    Raises (at construction):
      ValueError: a tensor the decoder has no place for, a stacked expert
        tensor whose expert count is not ``expert_count``, or a layer with
        only one of ``attn_k_b`` / ``attn_v_b``; names the file and tensor.
    """

    described_by = "its metadata"

    def __init__(self, weights: Mapping[str, np.ndarray], config: DeepseekConfig, path: str):
        self.listing = path
        self._arrays: dict[str, np.ndarray] = {}
        self._source: dict[str, str] = {}  # HF name -> the GGUF tensor it came from
        unplaced, split = [], {}
        experts = config.router.num_experts if config.router is not None else 0
        for name, array in weights.items():
            if name in _GLOBAL:
                self._add(_GLOBAL[name], array, name)
                continue
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[1] != str(int(parts[1])) \
                    or int(parts[1]) >= config.num_layers:
                unplaced.append(name)
                continue
            layer, rest = int(parts[1]), parts[2]
            prefix = f"model.layers.{layer}."
            if rest in _BLOCK:
                self._add(prefix + _BLOCK[rest], array, name)
            elif rest in _EXPERTS:
                if array.ndim != 3 or array.shape[0] != experts:
                    raise ValueError(f"GGUF {path!r}: tensor {name!r} has shape {list(array.shape)}; expected "
                                     f"{experts} stacked experts (expert_count)")
                for e in range(experts):
                    self._add(f"{prefix}mlp.experts.{e}.{_EXPERTS[rest]}.weight", array[e], name)
            elif rest in _SPLIT_KV_B:
                split.setdefault(layer, {})[rest] = array
            else:
                unplaced.append(name)
        if unplaced:
            raise ValueError(f"GGUF {path!r} holds tensors the decoder has no place for: {sorted(unplaced)[:8]}"
                             f"{' ...' if len(unplaced) > 8 else ''} ({len(unplaced)} in all); does its metadata "
                             "describe this checkpoint?")
        for layer, pair in sorted(split.items()):
            names = [f"blk.{layer}.{t}" for t in _SPLIT_KV_B]
            if len(pair) != 2:
                raise ValueError(f"GGUF {path!r}: layer {layer} has {sorted(f'blk.{layer}.{t}' for t in pair)} "
                                 f"without its other half of {names}")
            k_b, v_b = pair[_SPLIT_KV_B[0]], pair[_SPLIT_KV_B[1]]  # [N, C, H], [N, O, C]
            want = (config.num_heads, config.kv_lora_rank)
            if k_b.ndim != 3 or v_b.ndim != 3 or (k_b.shape[0], k_b.shape[1]) != want or \
                    (v_b.shape[0], v_b.shape[2]) != want:
                raise ValueError(f"GGUF {path!r}: {names} have shapes {list(k_b.shape)}, {list(v_b.shape)}; "
                                 f"expected [{want[0]}, {want[1]}, qk_nope_head_dim] and [{want[0]}, v_head_dim, "
                                 f"{want[1]}]")
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [N, H + O, C], kv_b_proj's rows
            self._add(f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1]),
                      " + ".join(names))
    @property
    def where(self) -> dict[str, str]:
        """The Hugging Face names held -> the GGUF tensor(s) each came from."""
        return self._source

    def _add(self, hf_name: str, array: np.ndarray, source: str) -> None:
        if hf_name in self._source:  # e.g. a layer's attn_kv_b beside its attn_k_b / attn_v_b
            raise ValueError(f"GGUF {self.listing!r}: {self._source[hf_name]!r} and {source!r} both hold "
                             f"{hf_name!r}; a file holds one of them")
        self._arrays[hf_name], self._source[hf_name] = array, source

    def display(self, hf_name: str) -> str:
        """The GGUF tensor(s) ``hf_name`` was read from, for messages."""
        return self._source.get(hf_name, hf_name)

    def default(self, hf_name: str, array: np.ndarray, why: str) -> None:
        """Holds ``array`` under ``hf_name`` unless the file gave one."""
        if hf_name not in self._arrays:
            self._add(hf_name, array, why)

    def read(self, wanted: Mapping[str, tuple[int, ...]], use: Callable[[str, np.ndarray], None]) -> None:
        """Passes each tensor in ``wanted`` (Hugging Face name -> shape) to
        ``use(name, array)``.

        Raises:
          ValueError: one is missing or of another shape; names the GGUF
            tensor.
        """
        for name, shape in wanted.items():
            if name not in self._arrays:
                raise ValueError(f"GGUF {self.listing!r} lacks the tensor that holds {name!r} (gguf names: "
                                 f"{_gguf_name(name)})")
            array = self._arrays[name]
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"GGUF {self.listing!r}: tensor {self._source[name]!r} gives {name!r} the shape "
                                 f"{list(array.shape)}; its metadata implies {list(shape)}")
            use(name, array)


def _gguf_name(hf_name: str) -> str:
    """The GGUF tensor(s) a Hugging Face name comes from, for messages."""
    flat = {v: k for k, v in _GLOBAL.items()}
    if hf_name in flat:
        return repr(flat[hf_name])
    parts = hf_name.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    if rest == "self_attn.kv_b_proj.weight":
        return f"'blk.{layer}.attn_k_b.weight' and 'blk.{layer}.attn_v_b.weight'"
    if rest.startswith("mlp.experts."):
        stacked = {v: k for k, v in _EXPERTS.items()}[parts[6]]
        return repr(f"blk.{layer}.{stacked}")
    return repr(f"blk.{layer}.{ {v: k for k, v in _BLOCK.items()}[rest]}")


def is_deepseek_gguf(path: str | os.PathLike) -> bool:
    """Whether the GGUF at ``path`` is a ``deepseek2`` one (its
    ``general.architecture``; the header only).

    Raises:
      FileNotFoundError, ValueError: as ``models.loading.gguf_loader.open_gguf``.
    """
    from models.loading.gguf_loader import metadata, open_gguf

    return metadata(open_gguf(path), "general.architecture", None) == ARCH


def read_gguf_deepseek_config(path: str | os.PathLike) -> DeepseekConfig:
    """The :class:`DeepseekConfig` of a ``deepseek2`` GGUF (its metadata
    only; no tensor is read).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a readable GGUF, or :func:`hf_config_fields`'s errors
        and :func:`models.deepseek.config.config_from_hf`'s (naming the file).
    """
    from models.loading.gguf_loader import open_gguf, scalar_metadata

    reader = open_gguf(path)
    name = str(reader.data.filename)
    return config_from_hf(hf_config_fields(scalar_metadata(reader), name), f"GGUF {name!r} (metadata read as "
                                                                            "config.json)")


def load_gguf_deepseek(path: str | os.PathLike, *, param_dtype=jnp.float32, impl: str = "auto") -> DeepseekModel:
    """A :class:`DeepseekModel` with a ``deepseek2`` GGUF's weights,
    dequantized by the ``gguf`` package to f32, then cast to
    ``param_dtype`` (the router's stay f32).

    Args:
      path: the GGUF file.
      param_dtype: f32, bf16 or f16.
      impl: the attention implementation.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a readable GGUF; an unsupported config
        (:func:`read_gguf_deepseek_config`); a tensor missing, misshapen
        or unexpected (module docstring); a bad ``param_dtype``.
    """
    from models.loading.gguf_loader import dequantize_all, open_gguf

    check_param_dtype(param_dtype)
    config = read_gguf_deepseek_config(path)
    reader = open_gguf(path)
    name = str(reader.data.filename)
    weights = dequantize_all(reader)
    tensors = GGUFTensors(weights, config, name)
    if config.router is not None and config.router.scoring == "sigmoid":
        for layer in range(config.num_dense_layers, config.num_layers):  # llama.cpp: exp_probs_b is optional
            tensors.default(f"model.layers.{layer}.mlp.gate.e_score_correction_bias",
                            np.zeros(config.router.num_experts, np.float32), "(none: a zero bias)")
    return model_from_tensors(config, tensors, interleaved=True, param_dtype=param_dtype, impl=impl)
