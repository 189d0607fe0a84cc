"""Hugging Face Llama-family checkpoints: a folder of ``config.json``,
``*.safetensors`` and ``tokenizer.json`` -> :class:`models.llama.Llama` and
:class:`models.tokenizer.Tokenizer`.

Which ``model_type`` values are supported (Llama 2 / 3 / 3.x, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3 text, OLMo 2), and what is refused, is
:mod:`models.loading.hf_config`'s business: it turns ``config.json`` into a
:class:`models.config.LlamaConfig` or a ``ValueError`` naming the file, the
field and the value. A missing file is a ``FileNotFoundError`` naming it.

Weights are read with ``safetensors`` from ``model.safetensors``, or from the
shards that ``model.safetensors.index.json`` lists. Hugging Face stores each
projection as ``[out, in]`` and its RoPE rotates halves (``rotate_half``), as
:mod:`models.llama` does, so the weights need only transposing and stacking
by layer, no permutation (unlike a GGUF, :mod:`models.loading.gguf_loader`)::

  model.embed_tokens.weight                    [V, D]      embed
  model.layers.{i}.input_layernorm.weight      [D]         blocks.attn_norm.scale[i]  (not OLMo 2)
  model.layers.{i}.self_attn.q_proj.weight     [N*H, D]    blocks.attn.wq[i]      [D, N, H]
  model.layers.{i}.self_attn.k_proj.weight     [K*H, D]    blocks.attn.wk[i]      [D, K, H]
  model.layers.{i}.self_attn.v_proj.weight     [K*H, D]    blocks.attn.wv[i]      [D, K, H]
  model.layers.{i}.self_attn.{q,k,v}_proj.bias [N*H|K*H]   blocks.attn.b{q,k,v}[i] (Qwen2)
  model.layers.{i}.self_attn.o_proj.weight     [D, N*H]    blocks.attn.wo[i]      [N, H, D]
  model.layers.{i}.self_attn.{q,k}_norm.weight [H|N*H|K*H] blocks.attn.{q,k}_norm.scale[i] (Qwen3,
                                                           Gemma 3: [H]; OLMo 2: [N*H], [K*H])
  model.layers.{i}.post_attention_layernorm.weight [D]     blocks.mlp_norm.scale[i] (Llama's pre-MLP
                                                           norm), blocks.post_attn_norm.scale[i]
                                                           (Gemma, OLMo 2: after attention)
  model.layers.{i}.pre_feedforward_layernorm.weight [D]    blocks.mlp_norm.scale[i] (Gemma)
  model.layers.{i}.post_feedforward_layernorm.weight [D]   blocks.post_mlp_norm.scale[i] (Gemma, OLMo 2)
  model.layers.{i}.mlp.gate_proj.weight        [F, D]      blocks.mlp.w_gate[i]   [D, F]
  model.layers.{i}.mlp.up_proj.weight          [F, D]      blocks.mlp.w_up[i]     [D, F]
  model.layers.{i}.mlp.down_proj.weight        [D, F]      blocks.mlp.w_down[i]   [F, D]
  model.norm.weight                            [D]         final_norm.scale
  lm_head.weight                               [V, D]      lm_head (absent when tied)

Gemma's norm weights are stored as ``w`` of ``x * (1 + w)`` and kept so
(``LlamaConfig.norm_plus_one``). The weights are cast to ``param_dtype``
(f32, bf16 or f16; default f32) as they are read, one
tensor at a time into the stacked arrays, so the host holds about one copy of
the model in that dtype plus one tensor.

Tokenizer: ``tokenizer.json`` (the fast tokenizer) with the special tokens and
chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``, where
newer transformers put it). Prompts are encoded without adding BOS, as
transformers' ``apply_chat_template`` does; templates that want a BOS write
``{{ bos_token }}`` themselves.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import tokenizers
from flax import nnx

from models.config import PARAM_DTYPES, check_param_dtype  # noqa: F401 (re-exported)
from models.llama import Llama, LlamaConfig
from models.loading.checkpoint import assign_params
from models.loading.hf_config import CONFIG, config_from_hf
from models.tokenizer import Tokenizer
from paged_jax.checks import is_int

WEIGHT_DTYPES = ("BF16", "F16", "F32")
"""safetensors dtypes the loader reads (anything else is refused)."""

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older exports saved; recomputed from the config


def refuse_unexpected(tensors: "Tensors", expected, *, tied: bool, ignore=lambda name: False) -> None:
    """Raises ValueError when the checkpoint holds a tensor outside
    ``expected`` (names): a tensor the decoder has no place for would change
    what the checkpoint computes (a bias the config does not announce, an
    expert or a layer the config does not count). Not counted: buffers
    older exports saved (``rotary_emb.inv_freq``), ``lm_head.weight`` when
    ``tied`` (transformers ignores it too), and names ``ignore`` takes."""
    unexpected = sorted(name for name in set(tensors.where) - set(expected)
                        if not (name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")
                                or ignore(name)))
    if unexpected:
        unexpected = [getattr(tensors, "display", str)(name) for name in unexpected]  # a GGUF's own names
        raise ValueError(f"{str(tensors.listing)!r} holds tensors the decoder has no place for: "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all); "
                         f"does {getattr(tensors, 'described_by', CONFIG)} describe this checkpoint?")


def read_json(path: pathlib.Path) -> dict:
    """The JSON object in ``path`` (a checkpoint's ``config.json`` and the like).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not JSON, or not an object; names the file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; a Hugging Face checkpoint folder needs it")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got a {type(data).__name__}")
    return data


def checkpoint_folder(path: str | os.PathLike) -> pathlib.Path:
    """``path`` as a checkpoint folder (``~`` expanded).

    Raises:
      FileNotFoundError: not a folder; names it.
    """
    folder = pathlib.Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; a Hugging Face checkpoint is a folder "
                                f"holding {CONFIG}, *.safetensors and {TOKENIZER}")
    return folder


# ----------------------------------------------------------------------------- config


def read_hf_config(folder: str | os.PathLike) -> LlamaConfig:
    """The decoder config of a checkpoint folder (reads ``config.json`` only:
    cheap, for checking a folder before loading it).

    Raises:
      FileNotFoundError: no such folder, or no ``config.json`` in it.
      ValueError: as :func:`config_from_hf`.
    """
    path = checkpoint_folder(folder) / CONFIG
    return config_from_hf(read_json(path), str(path))


# ----------------------------------------------------------------------------- weights


class Tensors:
    """The tensors of a checkpoint folder: which file holds each, and reading
    them (``model.safetensors``, or the shards of its index)."""

    def __init__(self, folder: pathlib.Path):
        index, single = folder / INDEX, folder / SINGLE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{str(index)!r}: field 'weight_map' must map tensor names to shard files, "
                                 f"got {type(weight_map).__name__}")
            self.where = {name: folder / shard for name, shard in weight_map.items()}
            root = folder.resolve()
            outside = sorted({s for s in weight_map.values() if root not in (folder / s).resolve().parents})
            if outside:
                raise ValueError(f"{str(index)!r}: field 'weight_map' names shard files outside the checkpoint "
                                 f"folder: {outside}")
            for shard in sorted(set(self.where.values())):
                if not shard.is_file():
                    raise FileNotFoundError(f"{str(index)!r} lists shard {shard.name!r}, which does not exist")
            self.listing = index  # the file a missing tensor is blamed on
        elif single.is_file():
            with self._open(single) as f:
                self.where = {name: single for name in f.keys()}
            self.listing = single
        else:
            found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
            raise FileNotFoundError(f"{str(folder)!r} has neither {SINGLE} nor {INDEX} (weight files there: "
                                    f"{found or 'none'}; only safetensors checkpoints are supported)")

    @staticmethod
    def _open(path: pathlib.Path):
        try:
            return safetensors.safe_open(str(path), framework="flax")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from e

    def read(self, wanted: dict[str, tuple[int, ...]], use: Callable[[str, np.ndarray], None]) -> None:
        """Reads each tensor in ``wanted`` (name -> expected shape), one file
        at a time, and passes it to ``use(name, array)`` as NumPy in its
        stored dtype.

        Raises:
          ValueError: a tensor missing, of another shape, or of a dtype other
            than BF16 / F16 / F32 (names the file and the tensor).
        """
        for name in wanted:
            if name not in self.where:
                raise ValueError(f"{str(self.listing)!r} lacks tensor {name!r}")
        by_file: dict[pathlib.Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.where[name], []).append(name)
        # safetensors' flax reader handles bf16 (NumPy's does not); keep the
        # arrays on the host, whatever the default device.
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            for path, names in by_file.items():
                with self._open(path) as f:
                    for name in names:
                        if name not in f.keys():
                            raise ValueError(f"{str(path)!r} lacks tensor {name!r} (the index places it there)")
                        view = f.get_slice(name)
                        dtype, shape = view.get_dtype(), tuple(view.get_shape())
                        if dtype not in WEIGHT_DTYPES:
                            raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {dtype}; supported: "
                                             f"{', '.join(WEIGHT_DTYPES)}")
                        if shape != wanted[name]:
                            raise ValueError(f"{str(path)!r}: tensor {name!r} has shape {list(shape)}, "
                                             f"{CONFIG} implies {list(wanted[name])}")
                        use(name, np.asarray(f.get_tensor(name)))


def _layout(config: LlamaConfig) -> dict[str, tuple[tuple[str, ...], int | None, tuple[int, ...], Callable]]:
    """Hugging Face tensor name -> (our parameter path, layer or None (or
    ``(layer, expert)``), its stored shape, stored array -> our per-layer
    array)."""
    v, d, f = config.vocab_size, config.model_dim, config.mlp_dim
    n, k, h = config.num_q_heads, config.num_kv_heads, config.head_dim
    same = lambda w: w  # noqa: E731
    transposed = lambda w: w.T  # noqa: E731  [out, in] -> [in, out]
    norms = {
        "pre": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")],
        "pre_post": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
                     ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm")],
        "post": [("post_attention_layernorm", "post_attn_norm"), ("post_feedforward_layernorm", "post_mlp_norm")],
    }[config.norm_placement]
    layer_tensors = [(f"{hf}.weight", (ours, "scale"), (d,), same) for hf, ours in norms]
    if config.qk_norm is not None:
        full = config.qk_norm == "full"
        layer_tensors += [
            ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (n * h if full else h,), same),
            ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (k * h if full else h,), same),
        ]
    layer_tensors += [
        ("self_attn.q_proj.weight", ("attn", "wq"), (n * h, d), lambda w: w.T.reshape(d, n, h)),
        ("self_attn.k_proj.weight", ("attn", "wk"), (k * h, d), lambda w: w.T.reshape(d, k, h)),
        ("self_attn.v_proj.weight", ("attn", "wv"), (k * h, d), lambda w: w.T.reshape(d, k, h)),
        ("self_attn.o_proj.weight", ("attn", "wo"), (d, n * h), lambda w: w.T.reshape(n, h, d)),
    ]
    expert_tensors = []  # (suffix, path, shape, fn), one per expert: the layer index is (layer, expert)
    if config.router is None:
        layer_tensors += [
            ("mlp.gate_proj.weight", ("mlp", "w_gate"), (f, d), transposed),
            ("mlp.up_proj.weight", ("mlp", "w_up"), (f, d), transposed),
            ("mlp.down_proj.weight", ("mlp", "w_down"), (d, f), transposed),
        ]
    else:  # the Hub's layout: one tensor per expert
        i = config.moe_mlp_dim
        layer_tensors.append(("mlp.gate.weight", ("mlp", "router"), (config.router.num_experts, d), same))
        expert_tensors = [
            ("gate_proj.weight", ("mlp", "w_gate"), (i, d), transposed),
            ("up_proj.weight", ("mlp", "w_up"), (i, d), transposed),
            ("down_proj.weight", ("mlp", "w_down"), (d, i), transposed),
        ]
    if config.qkv_bias:
        layer_tensors += [
            ("self_attn.q_proj.bias", ("attn", "bq"), (n * h,), lambda b: b.reshape(n, h)),
            ("self_attn.k_proj.bias", ("attn", "bk"), (k * h,), lambda b: b.reshape(k, h)),
            ("self_attn.v_proj.bias", ("attn", "bv"), (k * h,), lambda b: b.reshape(k, h)),
        ]
    layout = {
        "model.embed_tokens.weight": (("embed",), None, (v, d), same),
        "model.norm.weight": (("final_norm", "scale"), None, (d,), same),
    }
    if not config.tie_embeddings:
        layout["lm_head.weight"] = (("lm_head",), None, (v, d), same)
    for i in range(config.num_layers):
        for suffix, path, shape, fn in layer_tensors:
            layout[f"model.layers.{i}.{suffix}"] = (("blocks",) + path, i, shape, fn)
        for e in range(config.router.num_experts if expert_tensors else 0):
            for suffix, path, shape, fn in expert_tensors:
                layout[f"model.layers.{i}.mlp.experts.{e}.{suffix}"] = (("blocks",) + path, (i, e), shape, fn)
    return layout


def load_hf_model(folder: str | os.PathLike, *, param_dtype=jnp.float32) -> Llama:
    """A :class:`Llama` with a Hugging Face checkpoint's weights.

    Args:
      folder: the checkpoint folder (``config.json`` and ``model.safetensors``
        or ``model.safetensors.index.json`` with its shards).
      param_dtype: dtype of the module's weights, f32, bf16 or f16; the
        stored BF16 / F16 / F32 tensors are cast to it (default f32: the
        decoder then computes in f32).

    Raises:
      FileNotFoundError: the folder, ``config.json``, the weights or a shard
        the index lists does not exist.
      ValueError: an unsupported config (:func:`config_from_hf`); a tensor
        missing, misshapen or of another dtype; a tensor the decoder has no
        place for (a bias the config does not announce, say). Each names
        the file and the field or tensor. A ``param_dtype`` other than f32,
        bf16 or f16.
    """
    check_param_dtype(param_dtype)
    folder = checkpoint_folder(folder)
    config = read_hf_config(folder)
    tensors = Tensors(folder)
    layout = _layout(config)
    refuse_unexpected(tensors, layout, tied=config.tie_embeddings)

    # Build the module abstractly (no random init), allocate its weights on
    # the host, fill them tensor by tensor, then hand them to the module.
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    params = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def use(name: str, array: np.ndarray) -> None:
        path, layer, _, fn = layout[name]
        node = params
        for part in path[:-1]:
            node = node[part]
        value = fn(array)
        if layer is None:
            node[path[-1]] = value.astype(node[path[-1]].dtype)
        else:
            node[path[-1]][layer] = value

    tensors.read({name: spec[2] for name, spec in layout.items()}, use)
    assign_params(model, params, str(folder))
    return model


# ----------------------------------------------------------------------------- tokenizer


def _token_text(value, path: pathlib.Path, name: str) -> str | None:
    """A special-token field of tokenizer_config.json: a string, an
    AddedToken object ``{"content": ...}``, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{str(path)}: field {name!r} is {value!r}; expected a token string, "
                     f"an object with 'content', or null")


def folder_stop_ids(folder: str | os.PathLike) -> list[int]:
    """The ``eos_token_id`` entries of a checkpoint folder's ``config.json``
    and ``generation_config.json`` (where present): the tokens that end a
    generation when the folder has no ``tokenizer.json`` to say so.

    Raises:
      FileNotFoundError: no such folder or ``config.json``.
      ValueError: an entry that is not a token id, naming the file.
    """
    folder = checkpoint_folder(folder)
    out = _id_list(read_json(folder / CONFIG).get("eos_token_id"), folder / CONFIG, "eos_token_id")
    if (folder / GENERATION_CONFIG).is_file():
        out += _id_list(read_json(folder / GENERATION_CONFIG).get("eos_token_id"), folder / GENERATION_CONFIG,
                        "eos_token_id")
    return list(dict.fromkeys(out))


def _id_list(value, path: pathlib.Path, field: str) -> list[int]:
    """A token id or a list of them (``eos_token_id``), as a list.

    Raises:
      ValueError: an entry that is not an int >= 0 (a string id would
        otherwise be dropped and generation not stop there), naming the file
        and field.
    """
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not is_int(v, 0):
            raise ValueError(f"{str(path)!r}: field {field!r} must be a token id (an int >= 0) or a list of them, "
                             f"got {value!r}")
    return list(values)


def load_hf_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The :class:`models.tokenizer.Tokenizer` of a checkpoint folder.

    ``tokenizer.json`` is the tokenizer; ``tokenizer_config.json`` (optional)
    names the BOS, EOS and pad tokens and holds the chat template (a string,
    or a list of named templates of which ``default`` is taken), else
    ``chat_template.jinja``. Generation stops at EOS, at ``<|im_end|>`` if
    the vocabulary has it, and at every ``eos_token_id`` of
    ``generation_config.json`` and ``config.json`` (Llama 3 lists several).

    Raises:
      FileNotFoundError: the folder or ``tokenizer.json`` does not exist.
      ValueError: an unreadable ``tokenizer.json``; a special token that is
        not in the vocabulary; no EOS token at all. Each names the file and
        the field.
    """
    folder = checkpoint_folder(folder)
    tok_path = folder / TOKENIZER
    if not tok_path.is_file():
        extra = " (only tokenizer.model is there: a slow SentencePiece tokenizer; save the fast one)" if (
            folder / "tokenizer.model").is_file() else ""
        raise FileNotFoundError(f"{str(tok_path)!r} does not exist{extra}")
    try:
        tok = tokenizers.Tokenizer.from_file(str(tok_path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{str(tok_path)!r} is not a readable tokenizers file: {e}") from e

    cfg_path = folder / TOKENIZER_CONFIG
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    model_cfg = read_json(folder / CONFIG) if (folder / CONFIG).is_file() else {}
    gen_cfg = read_json(folder / GENERATION_CONFIG) if (folder / GENERATION_CONFIG).is_file() else {}

    def token_id(name: str) -> int | None:
        text = _token_text(cfg.get(name), cfg_path, name)
        if text is None:
            return None
        token = tok.token_to_id(text)
        if token is None:
            raise ValueError(f"{str(cfg_path)}: field {name!r} is {text!r}, which {TOKENIZER} does not have")
        return token

    config_eos = _id_list(model_cfg.get("eos_token_id"), folder / CONFIG, "eos_token_id")
    eos_id = token_id("eos_token")
    if eos_id is None:
        if not config_eos:
            raise ValueError(f"{str(cfg_path)}: field 'eos_token' is missing and {CONFIG} has no "
                             f"eos_token_id: generation would never stop")
        eos_id = config_eos[0]
    bos_id = token_id("bos_token")
    if bos_id is None and isinstance(model_cfg.get("bos_token_id"), int):
        bos_id = model_cfg["bos_token_id"]
    pad_id = token_id("pad_token")

    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{str(cfg_path)}: field 'chat_template' is {type(template).__name__}; expected a "
                         f"string or a list of {{name, template}} objects")
    if template is None and (folder / CHAT_TEMPLATE).is_file():
        template = (folder / CHAT_TEMPLATE).read_text()

    return Tokenizer(
        tok,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=eos_id if pad_id is None else pad_id,
        chat_template=template,
        extra_stop_ids=config_eos + _id_list(gen_cfg.get("eos_token_id"), folder / GENERATION_CONFIG, "eos_token_id"),
    )


def load_hf(folder: str | os.PathLike, *, param_dtype=jnp.float32) -> tuple[Llama, Tokenizer]:
    """``(model, tokenizer)`` of a Hugging Face checkpoint folder: see
    :func:`load_hf_model` and :func:`load_hf_tokenizer`.

    Raises:
      ValueError: also when the tokenizer can produce ids the model's
        vocabulary does not hold, or names a special id outside it (a
        prompt would fail at its first request, or a stop id never match).
    """
    model, tokenizer = load_hf_model(folder, param_dtype=param_dtype), load_hf_tokenizer(folder)
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"{folder}: tokenizer.json has {tokenizer.vocab_size} tokens, more than config.json's "
                         f"vocab_size={vocab}")
    special = {"eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id,
               "stop_ids": max(tokenizer.stop_ids, default=None)}
    for name, value in special.items():
        if value is not None and not 0 <= value < vocab:
            raise ValueError(f"{folder}: the tokenizer's {name} {value} is outside the model's vocabulary "
                             f"[0, {vocab}) (config.json / generation_config.json / tokenizer_config.json)")
    if any(t < 0 for t in tokenizer.stop_ids):
        raise ValueError(f"{folder}: stop ids must be >= 0, got {sorted(tokenizer.stop_ids)}")
    return model, tokenizer
