"""Saving and loading a :class:`models.llama.Llama`'s weights (safetensors).

A checkpoint is one ``.safetensors`` file: every parameter under its dotted
module path (``blocks.attn.wq``, stacked by layer as in the module, f32 or
the model's dtype) and, in the file's string metadata, the
:class:`models.config.LlamaConfig` as JSON (``paged_jax.engine.config``) plus a
format tag and whatever the caller adds (the training step, the data).

Why safetensors and not Orbax: the weights of the models trained here are a
few to a few hundred MB on one host, written once at the end of a run.
safetensors stores them as one flat, memory-mapped file with no pickled
code, which NumPy, PyTorch and transformers all read, and which the Hugging
Face loader reads too. Orbax earns its weight for what this does not do:
asynchronous, sharded, multi-host saves of a whole training state during a
run. Only weights are saved: a checkpoint is for serving and evaluation, not
for resuming the optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx, traverse_util

from models.llama import Llama, LlamaConfig
from paged_jax.checks import check_instance

FORMAT = "paged-jax-llama/1"
"""The ``format`` metadata value this module writes and accepts."""


def assign_params(module: nnx.Module, params: dict, path: str = "<weights>", prefix: str = "") -> None:
    """Sets ``module``'s Params (real or abstract) from a nested dict of arrays,
    cast to each Param's dtype.

    Raises:
      ValueError: an array whose shape differs from the Param's; names the
        weight and ``path``.
    """
    for name, value in params.items():
        target = getattr(module, name)
        where = f"{prefix}{name}"
        if isinstance(value, dict):
            assign_params(target, value, path, where + ".")
            continue
        want = target.get_value()
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(
                f"checkpoint {path!r}: weight {where} has shape {value.shape}, the config expects {want.shape}"
            )
        target.set_value(jnp.asarray(value, dtype=want.dtype))


def _flat_params(model: Llama) -> dict[str, np.ndarray]:
    """The model's Params by dotted module path (``blocks.attn.wq``)."""
    return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), sep=".")


def save_checkpoint(model: Llama, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> pathlib.Path:
    """Writes ``model``'s weights and config to one safetensors file.

    Args:
      model: the decoder (its weights are read back to the host).
      path: the file to write (parent folders are created); conventionally
        ``*.safetensors``.
      metadata: extra string key/values to store (for example the step).

    Returns:
      The path written.

    Raises:
      ValueError: ``model`` is not a :class:`Llama`, ``metadata`` has a
        non-string key or value or uses a reserved key (``format``,
        ``paged_jax.engine.config``), or ``path`` is a folder.
      OSError: the file cannot be written (the message names it).
    """
    check_instance("model", model, Llama, what="models.llama.Llama")
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str, got {key!r}: {value!r}")
        if key in ("format", "paged_jax.engine.config"):
            raise ValueError(f"metadata key {key!r} is reserved")
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"path {str(path)!r} is a folder; give the checkpoint file to write (e.g. "
                         f"{str(path / 'model.safetensors')!r})")
    weights = _flat_params(model)
    weights = {name: np.ascontiguousarray(jax.device_get(w)) for name, w in weights.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata.update({"format": FORMAT, "paged_jax.engine.config": json.dumps(dataclasses.asdict(model.config))})
    safetensors.numpy.save_file(weights, str(path), metadata=metadata)
    return path


def load_checkpoint(path: str | os.PathLike, *, param_dtype=None) -> tuple[Llama, dict[str, str]]:
    """Reads a checkpoint written by :func:`save_checkpoint`.

    Args:
      path: the ``.safetensors`` file.
      param_dtype: cast the weights to this dtype; default the stored one.

    Returns:
      ``(model, metadata)``: a :class:`Llama` with the stored weights (built
      abstractly, so no random initialization runs) and the file's metadata.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not a safetensors file, not this format, a config field
        that :class:`LlamaConfig` rejects, or a missing, extra or misshapen
        weight; the message names the path and the field or weight.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            weights = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ValueError(f"checkpoint {str(path)!r} is not a readable safetensors file: {e}") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r}: metadata 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        fields = json.loads(meta["paged_jax.engine.config"])
        config = LlamaConfig(**fields)
    except KeyError as e:
        raise ValueError(f"checkpoint {str(path)!r}: metadata lacks 'paged_jax.engine.config'") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: metadata 'paged_jax.engine.config' does not fit LlamaConfig: {e}") from e
    dtypes = {str(w.dtype) for w in weights.values()}
    if not weights or not all(np.issubdtype(w.dtype, np.floating) for w in weights.values()) or len(dtypes) > 1:
        raise ValueError(f"checkpoint {str(path)!r}: weights must be floating point of one dtype, got "
                         f"{sorted(dtypes) or 'no tensors'}")
    try:
        dtype = jnp.dtype(param_dtype or next(iter(weights.values())).dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"param_dtype must be a floating-point dtype, got {param_dtype!r}")
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    want = set(_flat_params(model))
    if want != set(weights):
        raise ValueError(f"checkpoint {str(path)!r}: missing weights {sorted(want - set(weights))}, "
                         f"unexpected weights {sorted(set(weights) - want)}")
    assign_params(model, traverse_util.unflatten_dict(weights, sep="."), str(path))
    return model, meta
