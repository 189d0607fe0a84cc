"""What every paged-attention kernel and reference in this package shares.

* :func:`validate_inputs`: the one input check, run eagerly (on shapes and
  dtypes only, so it also works under ``jit``) by every kernel's public entry
  and every ``ref_<name>``. Each kernel also exports ``unchecked_<name>``,
  the same call without any check (nor the clamps of :func:`checked_lengths`
  and :func:`checked_layer`), for a caller that validated the arguments at
  its own door (``paged_jax.attention.paged.paged_attention``).
* :func:`ref_sequence_attention`: attention over one sequence's contiguous
  K/V, plain NumPy in f64; the ``ref_<name>`` functions gather each
  sequence's owned slots and call it in a per-sequence Python loop
  (:func:`ref_ragged_loop`). It is the truth.
* Quantized KV pages (int8, float8_e4m3fn, float8_e5m2) with per-token
  scales (:func:`quantize_kv`); the page dtypes a pool may hold
  (:func:`check_kv_dtype`, :func:`is_quantized`).
* The scale convention (:func:`resolve_scale`).

Batch convention ("padded ragged", the same as ``paged_jax.attention.paged``):
sequence ``b`` has ``kv_lens[b]`` tokens in the cache, the last ``q_lens[b]``
of which are its query tokens (their K/V already written). Query row ``t <
q_lens[b]`` sits at position ``kv_lens[b] - q_lens[b] + t`` and sees keys at
positions ``<=`` its own (causal), and with a sliding window ``w`` only those
``> position - w``. Decode is ``q_lens = 1``. Query rows ``t >= q_lens[b]`` and
sequences with ``kv_lens[b] = 0`` give zeros: they see no key. Every other
row sees at least its own key, and a NaN or inf among the logits or values
it sees makes its output non-finite, never zeros (a corrupt weight or cache
must show). Slots no row may see never reach an output, even holding NaN.

Scaling. Logits are ``(q * scale) . k`` with ``scale = 1 / sqrt(head_dim)``
unless a scale is given (:func:`resolve_scale`). Each kernel applies it
exactly once, to the f32 query block inside the kernel body; callers must pass
unscaled queries. A logits soft cap (Gemma 2) is applied to the scaled logits:
``soft_cap * tanh(logits / soft_cap)``.

Quantized KV. A quantized pool stores K and V in a 1-byte dtype ``[K, P, L,
H]`` plus one f32 scale per token and KV head, ``[K, P, L]``: ``x ~= x_q *
scale`` with ``scale = max|x| / dtype max`` over the head dim (127 for int8,
448 for float8_e4m3fn, 57344 for float8_e5m2; :func:`quantize_kv`). int8
rounds ``x / scale`` to an integer, a uniform step of ``scale``; fp8 casts it
to the float format, whose step is relative (3 mantissa bits for e4m3fn, 2
for e5m2: errors up to 1/16 and 1/8 of an element, but for elements so far
below the largest that they fall among the format's subnormals; int8's
errors are up to 1/254 of the largest element, whatever the element). Per token and KV head either takes ``H + 4``
bytes instead of ``4 H`` (f32) or ``2 H`` (bf16): at ``H = 64``, 26.6 % of
an f32 pool (about a quarter) and 53.1 % of a bf16 pool (about a half); at
``H = 128``, 25.8 % and 51.6 % (:func:`kv_bytes_per_token`). Kernels apply
the K scale to the logits columns and the V scale to the probabilities, so
pages are never dequantized in memory. Whether pages are quantized is one
predicate, :func:`is_quantized`; no caller compares a dtype to int8.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Axis letters: the alphabet of models/__init__.py.

INT8_MAX = 127.0
"""int8 quantization maps ``[-max|x|, max|x|]`` onto ``[-127, 127]``."""

FLOAT_KV_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
"""Page dtypes stored as they are, without scales."""

QUANTIZED_KV_DTYPES = tuple(jnp.dtype(d) for d in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2))
"""Page dtypes stored with one f32 scale per token and KV head
(:func:`quantize_kv`). Not float8_e4m3fnuz / e4m3b11fnuz / e5m2fnuz (other
NaN and zero encodings, which this code has never been run on) nor the
sub-byte int4 / float4 types (a pool of them would not be half a byte per
element here)."""

KV_DTYPES = FLOAT_KV_DTYPES + QUANTIZED_KV_DTYPES
"""Every dtype a K/V pool may hold; anything else is refused by name (a
float64 pool, say, would silently be f32 without ``jax_enable_x64``)."""

KV_DTYPE_ALIASES = {"fp8": jnp.dtype(jnp.float8_e4m3fn)}
"""Names :func:`check_kv_dtype` accepts besides the dtypes' own: ``fp8`` is
float8_e4m3fn, the fp8 format with more mantissa (3 bits against e5m2's 2;
the per-token scale supplies the range e5m2's wider exponent would)."""


def is_quantized(dtype) -> bool:
    """Whether pages of ``dtype`` are quantized, i.e. carry per-token scales:
    one of :data:`QUANTIZED_KV_DTYPES` (int8, float8_e4m3fn, float8_e5m2)."""
    return jnp.dtype(dtype) in QUANTIZED_KV_DTYPES


def check_kv_dtype(name: str, value) -> np.dtype:
    """``value`` as a K/V page dtype.

    Args:
      name: the argument's name, for the message.
      value: a dtype, a dtype's name (``"bfloat16"``) or an alias of
        :data:`KV_DTYPE_ALIASES` (``"fp8"``).

    Returns:
      One of :data:`KV_DTYPES`.

    Raises:
      ValueError: anything else (an unknown name, float64, int32, int4,
        float8_e4m3fnuz, ...), naming ``name`` and the value.
    """
    dtype = None
    if isinstance(value, str) and value in KV_DTYPE_ALIASES:
        dtype = KV_DTYPE_ALIASES[value]
    elif value is not None:  # jnp.dtype(None) would be float64
        try:
            dtype = jnp.dtype(value)
        except (TypeError, ValueError):
            pass
    if dtype not in KV_DTYPES:
        shown = repr(value) if dtype is None else dtype.name
        floats = ", ".join(d.name for d in FLOAT_KV_DTYPES)
        raise ValueError(f"{name} must be a K/V page dtype: a floating dtype stored as it is ({floats}), or a "
                         f"quantized one with per-token scales: float8_e4m3fn ('fp8'), float8_e5m2 or int8, got "
                         f"{name}={shown}")
    return dtype


def quantized_max(dtype) -> float:
    """The largest magnitude a quantized page dtype stores: what ``max|x|``
    of a vector maps to (127 for int8, 448 for float8_e4m3fn, 57344 for
    float8_e5m2)."""
    dtype = jnp.dtype(dtype)
    return INT8_MAX if jnp.issubdtype(dtype, jnp.integer) else float(jnp.finfo(dtype).max)


def check_scales(name: str, pages_dtype, pages_shape: tuple[int, ...], k_scales, v_scales, *,
                 scale_names: tuple[str, str] = ("k_scales", "v_scales")) -> None:
    """The dtype-and-scales check of every attention door: pages (the
    argument ``name``) of a :data:`KV_DTYPES` dtype, with ``k_scales`` and
    ``v_scales`` f32 ``pages_shape[:-1]`` given exactly when that dtype is
    quantized (:func:`is_quantized`). Static facts only (runs under ``jit``).
    ``scale_names``: the scales' argument names in messages (a door whose
    one argument is both, MLA's ``latent_scales``, names it twice).

    Raises:
      ValueError: a page dtype outside :data:`KV_DTYPES`, scales missing
        for quantized pages or given for float ones, or scales of another
        shape or dtype; the message names the argument.
    """
    pages_dtype = jnp.dtype(pages_dtype)
    if pages_dtype not in KV_DTYPES:
        raise ValueError(f"{name} must have a K/V page dtype ({', '.join(d.name for d in KV_DTYPES)}), got dtype "
                         f"{pages_dtype}")
    quantized = is_quantized(pages_dtype)
    if quantized != (k_scales is not None) or quantized != (v_scales is not None):
        given = dict(zip(scale_names, ("set" if x is not None else "None" for x in (k_scales, v_scales))))
        raise ValueError(
            f"{' and '.join(given)} must be given exactly when {name} is quantized "
            f"({', '.join(d.name for d in QUANTIZED_KV_DTYPES)}), got {name} {pages_dtype}, "
            + ", ".join(f"{k} {v}" for k, v in given.items())
        )
    if quantized:
        for scale_name, s in zip(scale_names, (k_scales, v_scales)):
            shape, dtype = getattr(s, "shape", None), getattr(s, "dtype", None)
            if shape is None or dtype is None:  # a list or a number: named, not an AttributeError
                raise ValueError(f"{scale_name} must be an f32{list(pages_shape[:-1])} array, got "
                                 f"{type(s).__name__}")
            if tuple(shape) != tuple(pages_shape[:-1]) or dtype != jnp.float32:
                raise ValueError(f"{scale_name} must be f32{list(pages_shape[:-1])}, got {dtype}{list(shape)}")


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The logit scale: ``scale`` if given, else ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def validate_options(
    *, scale: float | None, soft_cap: float | None, sliding_window: int | None
) -> None:
    """Checks the keyword options shared by all kernels.

    Raises:
      ValueError: ``scale`` or ``soft_cap`` not a positive finite number, or
        ``sliding_window`` not an int >= 1.
    """
    for name, value in (("scale", scale), ("soft_cap", soft_cap)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and 0 < value < math.inf):
            raise ValueError(f"{name} must be a positive finite number or None, got {name}={value!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window=!r}")


def validate_inputs(
    q: jax.Array,  # [B, N, H] (decode) or [B, T, N, H] (ragged)
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [K, P, L, H] same dtype as k_pages
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array | None = None,  # i32[B]; None for decode
    k_scales: jax.Array | None = None,  # f32[K, P, L]; with quantized pages only
    v_scales: jax.Array | None = None,  # f32[K, P, L]; with quantized pages only
    layer: int | jax.Array | None = None,  # with a stacked pool [layers, K, P, L, H]
) -> None:
    """Checks the shapes and dtypes of a paged-attention call.

    Static facts only (no values are read), so it runs under ``jit``.
    ``q`` of rank 3 is a decode call and takes ``q_lens=None``; rank 4 is a
    ragged call and needs ``q_lens``. With ``layer`` the pages are the
    stacked pool ``[layers, K, P, L, H]`` (scales ``[layers, K, P, L]``) and
    ``layer`` an integer scalar (:func:`checked_layer` checks its value);
    without, one layer's ``[K, P, L, H]``.

    Raises:
      ValueError: a rank, shape or dtype mismatch; the message names the
        argument, what it got and what was expected.
    """
    if q.ndim == 3:
        if q_lens is not None:
            raise ValueError(f"decode q [batch, num_q_heads, head_dim] takes q_lens=None, got q_lens of shape {q_lens.shape}")
    elif q.ndim == 4:
        if q_lens is None:
            raise ValueError("ragged q [batch, q_tokens, num_q_heads, head_dim] needs q_lens")
    else:
        raise ValueError(
            f"q must be [batch, num_q_heads, head_dim] or [batch, q_tokens, num_q_heads, head_dim], got shape {q.shape}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float array, got dtype {q.dtype}")
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if layer is None:
        if k_pages.ndim != 4:
            raise ValueError(f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim] (or the stacked "
                             f"[layers, ...] pool with a layer index), got shape {k_pages.shape}")
    else:
        if k_pages.ndim != 5:
            raise ValueError(f"with layer={layer!r}, k_pages must be the stacked pool [num_layers, num_kv_heads, "
                             f"num_pages, page_size, head_dim], got shape {k_pages.shape}")
        _check_layer_type(layer)
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages {v_pages.dtype}{list(v_pages.shape)} must match k_pages {k_pages.dtype}{list(k_pages.shape)}"
        )
    num_kv_heads, num_pages, page_size, kv_head_dim = k_pages.shape[-4:]
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k_pages ({kv_head_dim}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=} {num_kv_heads=}")
    check_scales("k_pages", k_pages.dtype, k_pages.shape, k_scales, v_scales)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [batch={batch}, pages_per_seq >= 1], got shape {block_tables.shape}")
    lens = (("kv_lens", kv_lens),) + ((("q_lens", q_lens),) if q_lens is not None else ())
    for name, x in lens:
        if x.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {x.shape}")
    for name, x in (("block_tables", block_tables),) + lens:
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got dtype {x.dtype}")


def checked_lengths(block_tables: jax.Array, num_pages: int, page_size: int, kv_lens: jax.Array,
                    q_lens: jax.Array | None = None, num_q_tokens: int | None = None):
    """Lengths (and page ids) that can never walk past a row's block table.

    A kernel walks ``ceil(kv_lens[b] / page_size)`` entries of row ``b``'s
    table; a length beyond the row would step into entries the row does not
    own, and on a GPU nothing stops that read: another sequence's pages
    (the cross-request read that had paged attention removed from MaxText).

    Args:
      block_tables: i32[B, pages_per_seq].
      num_pages: P, pages in the pool.
      page_size: L.
      kv_lens: i32[B].
      q_lens: i32[B] or None (decode).
      num_q_tokens: T, query rows per sequence of a padded ``[B, T]`` call;
        None for flat batches.

    Returns:
      ``(kv_lens, q_lens)`` clamped to ``[0, pages_per_seq * L]`` and
      ``[0, min(T, kv_lens)]``: what every implementation uses, so under
      ``jit`` no input can make a row read another row's entries.

    Raises:
      ValueError: (eager calls, when the values can be read) a length
        outside those ranges, or a block-table entry outside ``[0,
        num_pages)``, naming the rows and values.
    """
    cap = block_tables.shape[1] * page_size
    q_cap = None if num_q_tokens is None else num_q_tokens
    traced = any(isinstance(x, jax.core.Tracer) for x in (block_tables, kv_lens, q_lens) if x is not None)
    if not traced:
        kl = np.asarray(kv_lens)
        bad = np.flatnonzero((kl < 0) | (kl > cap))
        if bad.size:
            raise ValueError(
                f"kv_lens must be in [0, pages_per_seq * page_size = {cap}] (the row's block table), got "
                f"rows {bad.tolist()}: {kl[bad].tolist()}"
            )
        if q_lens is not None:
            ql = np.asarray(q_lens)
            high = kl if q_cap is None else np.minimum(kl, q_cap)
            bad = np.flatnonzero((ql < 0) | (ql > high))
            if bad.size:
                raise ValueError(f"q_lens must be in [0, kv_lens]{'' if q_cap is None else f' and <= T={q_cap}'}, "
                                 f"got rows {bad.tolist()}: q_lens {ql[bad].tolist()} kv_lens {kl[bad].tolist()}")
        bt = np.asarray(block_tables)
        bad = np.argwhere((bt < 0) | (bt >= num_pages))
        if bad.size:
            r, c = bad[0]
            raise ValueError(f"block_tables entries must be page ids in [0, num_pages={num_pages}), got "
                             f"block_tables[{r}, {c}] = {bt[r, c]} ({len(bad)} such entries)")
    kv_lens = jnp.clip(kv_lens, 0, cap)
    if q_lens is None:
        return kv_lens, None
    high = kv_lens if q_cap is None else jnp.minimum(kv_lens, q_cap)
    return kv_lens, jnp.clip(q_lens, 0, high)


def _check_layer_type(layer) -> None:
    """Raises ValueError unless ``layer`` is an integer scalar (a Python or
    NumPy int, or an integer array of shape ())."""
    try:
        dtype = jnp.dtype(bool) if isinstance(layer, bool) else jnp.result_type(layer)
        ok = jnp.ndim(layer) == 0 and jnp.issubdtype(dtype, jnp.integer)
    except TypeError:
        dtype, ok = None, False
    if not ok:
        raise ValueError(f"layer must be an integer scalar, got {layer!r} ({type(layer).__name__}"
                         f"{'' if dtype is None else f' of dtype {dtype}'}, shape {jnp.shape(layer) if dtype else '?'})")


def checked_layer(layer: int | jax.Array | None, num_layers: int) -> jax.Array:
    """The layer index a kernel reads the stacked pool at, as i32[1].

    Args:
      layer: an integer scalar, or None for a single layer's pages (index 0
        of a one-layer stack, see :func:`stack_layer`).
      num_layers: layers in the stacked pool.

    Returns:
      i32[1]: ``layer`` clamped to ``[0, num_layers)`` (under ``jit`` a
      traced index cannot be checked, and a kernel must never step outside
      the pool).

    Raises:
      ValueError: (eager calls) ``layer`` outside ``[0, num_layers)``.
    """
    if layer is None:
        return jnp.zeros((1,), jnp.int32)
    _check_layer_type(layer)
    if not isinstance(layer, jax.core.Tracer):
        value = int(np.asarray(layer))
        if not 0 <= value < num_layers:
            raise ValueError(f"layer must be in [0, num_layers={num_layers}), got layer={value}")
    return jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1).reshape(1)


def check_decode_call(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, layer, *, scale, soft_cap,
                      sliding_window) -> tuple[jax.Array, jax.Array | None]:
    """The door of every paged decode kernel: :func:`validate_inputs`,
    :func:`validate_options`, the lengths (:func:`checked_lengths`) and the
    layer (:func:`checked_layer`).

    Returns:
      ``(lengths, layer)`` for the kernel's ``unchecked_*`` twin: lengths
      clamped to each row's table, the layer clamped into the pool (None
      stays None).

    Raises:
      ValueError: what those functions raise.
    """
    validate_inputs(q, k_pages, v_pages, block_tables, lengths, None, k_scales, v_scales, layer)
    lengths, _ = checked_lengths(block_tables, k_pages.shape[-3], k_pages.shape[-2], lengths)
    validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return lengths, None if layer is None else checked_layer(layer, k_pages.shape[0])[0]


def layer_index(layer: int | jax.Array | None) -> jax.Array:
    """i32[1] the layer an ``unchecked_<name>`` kernel reads: ``layer``
    (0 for one layer's pages) with neither :func:`checked_layer`'s check nor
    its clamp; the caller checked it at its door."""
    return jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)


def stack_layer(*arrays: jax.Array | None, layer) -> tuple[jax.Array | None, ...]:
    """One layer's pages (and scales) as a one-layer stack when ``layer`` is
    None (``x[None]``: a free reshape), the stacked pool as it is otherwise,
    so a kernel has one code path that reads ``pool[layer]`` in place."""
    return tuple(x if x is None or layer is not None else x[None] for x in arrays)


def quantize_kv(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """Quantization to a 1-byte page dtype with one scale per vector over
    the last axis.

    ``scale = max|x| / m`` with ``m`` = :func:`quantized_max` (127, 448 or
    57344), then ``x / scale`` clipped to ``[-m, m]`` and, for int8, rounded
    to an integer; for fp8, cast (round to nearest even). The clip is a
    saturation: ``max|x| / scale`` can come out a rounding step above ``m``,
    and float8_e4m3fn has no inf, so the cast would give NaN.

    Args:
      x: [..., H] float K or V (e.g. pages ``[K, P, L, H]``).
      dtype: a quantized page dtype (:data:`QUANTIZED_KV_DTYPES`).

    Returns:
      ``(x_q, scales)``: ``dtype`` ``[..., H]`` and f32 ``[...]`` with
      ``x ~= x_q * scales[..., None]`` (:func:`dequantize_kv`); all-zero
      vectors get scale 0. NaN inputs give undefined values (use them only
      in slots no one reads).

    Raises:
      ValueError: ``dtype`` is not a quantized page dtype.
    """
    dtype = jnp.dtype(dtype)
    if not is_quantized(dtype):
        raise ValueError(f"dtype must be one of {[d.name for d in QUANTIZED_KV_DTYPES]}, got dtype={dtype.name}")
    top = quantized_max(dtype)
    xf = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(xf), axis=-1) / top  # [...]
    safe = jnp.where(scales > 0, scales, 1.0)
    y = xf / safe[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return jnp.clip(y, -top, top).astype(dtype), scales


def dequantize_kv(x_q: jax.Array, scales: jax.Array) -> jax.Array:
    """f32 ``x_q * scales[..., None]``: [..., H] quantized (int8 or fp8),
    f32[...] -> f32[..., H]."""
    return x_q.astype(jnp.float32) * scales[..., None]


def kv_bytes_per_token(head_dim: int, dtype) -> int:
    """Bytes of K *or* V one token takes per KV head: ``H * itemsize``, plus a
    4-byte f32 scale for a quantized dtype (int8, fp8)."""
    dtype = jnp.dtype(dtype)
    return head_dim * dtype.itemsize + (4 if is_quantized(dtype) else 0)


def pad_block_tables(block_tables: jax.Array, multiple: int) -> jax.Array:
    """Pads ``i32[B, pages_per_seq]`` with page id 0 to a multiple of
    ``multiple`` pages, so a kernel may read whole compute blocks. Page 0 is a
    valid index; the padded pages lie past every sequence's length and are
    masked, so their content (even NaN) never reaches an output."""
    extra = -block_tables.shape[1] % multiple
    return jnp.pad(block_tables, ((0, 0), (0, extra))) if extra else block_tables


def interpret_default(interpret: bool | None, backend: str) -> bool:
    """Interpret mode unless we run on ``backend`` ("gpu" or "tpu"), or
    trace for a chip of it ahead of time (``pallas_kernels.chips.target``:
    then the real compiler gets the kernel, not the interpreter)."""
    if interpret is not None:
        return bool(interpret)
    from pallas_kernels import chips  # noqa: PLC0415 (chips imports this module's package)

    target = chips.targeted()
    if target is not None:
        return {"tpu": "tpu", "gpu": "cuda"}[backend] != target.platform
    return jax.default_backend() != backend



def check_block_sizes(obj, *, positive: tuple[str, ...], pow2: tuple[str, ...] = ()) -> None:
    """``__post_init__`` check shared by the block-size dataclasses.

    Raises:
      ValueError: a field in ``positive`` that is not an int >= 1, or one in
        ``pow2`` that is not a power of two; the message names it.
    """
    for name in positive:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    for name in pow2:
        value = getattr(obj, name)
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {name}={value}")

def ref_sequence_attention(
    q: np.ndarray,  # f64[T, N, H] the sequence's real query rows
    k: np.ndarray,  # f64[S, K, H] the sequence's S = kv_len keys
    v: np.ndarray,  # f64[S, K, H]
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
) -> np.ndarray:
    """Causal GQA attention over one sequence's contiguous K/V, on the host.

    NumPy in f64 (exact enough to be the truth for f32 kernels, and fast on
    the many small, differently shaped sequences of a test; jnp would compile
    every shape). Query row ``t`` is at position ``S - T + t``. Plain softmax
    over the keys each row may see (there is always at least its own key).

    Returns:
      f64[T, N, H].
    """
    num_q_tokens, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    q_pos = num_keys - num_q_tokens + np.arange(num_q_tokens)  # [T]
    k_pos = np.arange(num_keys)  # [S]
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    qg = q.reshape(num_q_tokens, num_kv_heads, group, head_dim) * scale
    logits = np.einsum("TKGH,SKH->KGTS", qg, k)
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    logits = np.where(visible, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("KGTS,SKH->TKGH", probs, v)
    return out.reshape(num_q_tokens, num_q_heads, head_dim)


def ref_ragged_loop(
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, L, H]
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    kv_lens: jax.Array,  # i32[B]
    q_lens: jax.Array,  # i32[B]
    k_scales: jax.Array | None,  # f32[K, P, L]
    v_scales: jax.Array | None,  # f32[K, P, L]
    *,
    scale: float | None,
    soft_cap: float | None,
    sliding_window: int | None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """The per-sequence Python loop behind every ``ref_<name>``.

    Copies everything to the host (not jittable), gathers exactly the
    ``kv_lens[b]`` owned slots of each sequence through its block table
    (dequantizing quantized pages) and calls :func:`ref_sequence_attention`.
    With ``layer``, the pages (and scales) are the stacked pool and layer
    ``layer`` of it is read.

    Returns:
      [B, T, N, H] in ``q.dtype``; zeros for rows ``t >= q_lens[b]``.

    Raises:
      ValueError: ``q_lens[b] > min(T, kv_lens[b])``, a negative length, or
        a sequence longer than its block table.
    """
    batch, num_q_tokens, _, head_dim = q.shape
    page_size = k_pages.shape[-2]
    scale = resolve_scale(scale, head_dim)
    if layer is not None:
        index = int(checked_layer(layer, k_pages.shape[0])[0])
        k_pages, v_pages, k_scales, v_scales = (None if x is None else x[index] for x in (k_pages, v_pages, k_scales, v_scales))
    host = lambda x: None if x is None else np.asarray(x).astype(np.float64)  # noqa: E731
    q_np, k_np, v_np, ks_np, vs_np = map(host, (q, k_pages, v_pages, k_scales, v_scales))
    kv_lens_np, q_lens_np, tables = np.asarray(kv_lens), np.asarray(q_lens), np.asarray(block_tables)
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        kv_len, q_len = int(kv_lens_np[b]), int(q_lens_np[b])
        if not 0 <= q_len <= min(num_q_tokens, kv_len) or kv_len > tables.shape[1] * page_size:
            raise ValueError(
                f"sequence {b}: need 0 <= q_len <= min(T={num_q_tokens}, kv_len) and "
                f"kv_len <= {tables.shape[1] * page_size}, got {q_len=} {kv_len=}"
            )
        if q_len == 0:
            continue
        slots = np.arange(kv_len)
        pages, offsets = tables[b, slots // page_size], slots % page_size

        def gather(p, s):
            x = p[:, pages, offsets]  # [K, S, H]
            if s is not None:
                x = x * s[:, pages, offsets][..., None]
            return x.swapaxes(0, 1)  # [S, K, H]

        out[b, :q_len] = ref_sequence_attention(
            q_np[b, :q_len], gather(k_np, ks_np), gather(v_np, vs_np),
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        )
    return jnp.asarray(out.astype(np.float32)).astype(q.dtype)


def ref_paged_decode_loop(
    q: jax.Array,  # [B, N, H] float
    k_pages: jax.Array,  # [K, P, L, H] float, or quantized (int8, fp8)
    v_pages: jax.Array,  # [K, P, L, H]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    k_scales: jax.Array | None = None,  # f32[K, P, L]
    v_scales: jax.Array | None = None,  # f32[K, P, L]
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    **unused_kernel_options,
) -> jax.Array:
    """The truth for every decode kernel (``ref_paged_attention_gpu``,
    ``_tpu``, ``_cpu`` are this function): one query per sequence, a
    per-sequence loop over exactly the ``lengths[b]`` owned slots
    (:func:`ref_ragged_loop`). Same arguments as the kernels (``layer``
    with a stacked pool); kernel-only options (``block_sizes``,
    ``interpret``) are ignored. Not jittable (reads lengths on the host).

    Returns:
      [B, N, H] in ``q.dtype``; zeros where ``lengths == 0``.

    Raises:
      ValueError: inputs failing :func:`validate_inputs` or
        :func:`validate_options`.
    """
    validate_inputs(q, k_pages, v_pages, block_tables, lengths, None, k_scales, v_scales, layer)
    validate_options(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return ref_ragged_loop(
        q[:, None], k_pages, v_pages, block_tables, lengths, jnp.minimum(lengths, 1), k_scales, v_scales,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, layer=layer,
    )[:, 0]
