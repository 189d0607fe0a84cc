"""Tilings that fit the chip: the GPU kernels' shared memory, per chip and shape.

A Triton program's shared memory grows with its tile: the K and V blocks it
stages per pipeline stage, and the scratch its layout conversions use for
the query rows, the key block and the probabilities. A tiling that fits an
H100's 227 KiB can be over an A100's 163 KiB, and one chosen for head dim
128 is over both at Gemma's 256 with an f32 pool. :func:`fit_gpu_tiling`
takes the tiling a caller asks for as an upper bound and steps it down until
the model below fits the chip (:mod:`pallas_kernels.chips`): first the
pipeline stages (2 to 1), then the keys per block (halved, never below one
page nor 16), then the query tokens per program (halved, never below 16
rows), and last the query group itself (``group_splits``: programs that
each hold a part of one KV head's query heads, reading the same pages: 128
MLA heads on one latent head are 128 rows a token, over both chips at head
dim 576 whatever the keys). ``pallas_kernels.paged_attention_gpu.flash_paged_call``, the launch of
every GPU kernel, calls it, so every configuration the engine can build
fits: ``experiments.lib.aot`` compiles them all with Triton for sm80 and sm90
and checks the shared memory Triton reports against the limit
(``tests/test_aot.py``; the table in ``results/kernel_compile.md``).

The model (bytes), for ``R`` rows (query tokens times the padded group),
``S`` keys per block, head dim ``H``, pool itemsize ``b`` and ``n`` stages::

    smem = 4 H (S + R) + 4 R S + (n - 1) * 2 S H b

It is exact for f32 pools on sm90 at every shape measured (Llama-3-8B and
Gemma-3-12B heads, 16 and 64 keys, 1 and 2 stages: 45,056, 86,016, 106,496,
110,592, 217,088 and 237,568 bytes, Triton's own count) and above Triton's
count for 16-bit and 8-bit pools (bf16 Llama decode: 45,056 modelled,
22,528 measured at one stage), so a tiling it admits fits.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import chips


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUTiling:
    """A GPU program's tile: ``block_q`` query tokens (rows: ``block_q *
    group_pad``), ``pages_per_compute_block`` pages of keys per loop step
    (or, with ``page_splits`` > 1 and one page a step, ``1 / page_splits``
    of a page: a page of 256 tokens at head dim 256 is over sm90's shared
    memory whole), Triton's ``num_stages``; ``group_splits`` programs share
    one KV head's padded query group (``G_pad / group_splits`` heads each)."""

    block_q: int
    pages_per_compute_block: int
    num_stages: int
    page_splits: int = 1
    group_splits: int = 1

    def __post_init__(self):
        for name in ("block_q", "pages_per_compute_block", "num_stages", "page_splits", "group_splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")


def gpu_smem_bytes(*, rows: int, keys: int, head_dim: int, itemsize: int, num_stages: int) -> int:
    """Shared memory of one GPU program by the module's model, bytes."""
    return 4 * head_dim * (keys + rows) + 4 * rows * keys + (num_stages - 1) * 2 * keys * head_dim * itemsize


def fit_gpu_tiling(want: GPUTiling, *, group_pad_for, page_size: int, head_dim: int, itemsize: int,
                   chip: chips.Chip | None = None) -> GPUTiling:
    """The largest tiling at most ``want`` whose shared memory fits ``chip``.

    Args:
      want: the tiling asked for (an upper bound).
      group_pad_for: ``block_q -> G_pad``, the padded query group at that
        block (Triton wants ``block_q * G_pad >= 16``); a program holds
        ``G_pad / group_splits`` of its heads.
      page_size: L, tokens per page (keys per block are a multiple).
      head_dim: H.
      itemsize: bytes of a pool element.
      chip: the target; default :func:`pallas_kernels.chips.current`, and
        sm90 where that is None (a CPU running the kernel interpreted).

    Returns:
      ``want`` itself when it fits, else the first fitting step down
      (stages, then keys: fewer pages a step, then a half, a quarter...
      of one page (``page_splits``), down to 16 keys; then query tokens;
      then the query group, halved while a program keeps 16 rows).

    Raises:
      ValueError: nothing fits (16 keys and 16 rows are already over the
        chip), naming the shapes, the bytes and the limit.
    """
    chip = chip or chips.current() or chips.CHIPS["sm90"]
    if not isinstance(chip, chips.Chip) or chip.platform != "cuda":
        raise ValueError(f"chip must be a GPU pallas_kernels.chips.Chip, got chip={chip!r}")
    for name, value in (("page_size", page_size), ("head_dim", head_dim), ("itemsize", itemsize)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    limit = chip.smem_per_block
    block_q, ppcb, stages, splits = want.block_q, want.pages_per_compute_block, want.num_stages, want.page_splits
    groups = want.group_splits

    def smem(bq, pp, st, sp):
        return gpu_smem_bytes(rows=bq * group_pad_for(bq) // groups, keys=pp * page_size // sp,
                              head_dim=head_dim, itemsize=itemsize, num_stages=st)

    while smem(block_q, ppcb, stages, splits) > limit:
        if stages > 1:
            stages -= 1
        elif ppcb > 1 and (ppcb // 2) * page_size >= 16:
            ppcb //= 2
        elif ppcb == 1 and page_size % (2 * splits) == 0 and page_size // (2 * splits) >= 16:
            splits *= 2
        elif block_q > 1 and (block_q // 2) * group_pad_for(block_q // 2) // groups >= 16:
            block_q //= 2
        elif group_pad_for(block_q) % (2 * groups) == 0 and block_q * group_pad_for(block_q) // (2 * groups) >= 16:
            groups *= 2
        else:
            raise ValueError(
                f"no GPU tiling fits {chip.description}'s {limit:,} bytes of shared memory per block at "
                f"page_size={page_size}, head_dim={head_dim}, {itemsize}-byte pages: the smallest "
                f"({block_q} query tokens of {group_pad_for(block_q) // groups} heads, "
                f"{ppcb * page_size // splits} keys, 1 stage) needs {smem(block_q, ppcb, 1, splits):,}")
    got = GPUTiling(block_q=block_q, pages_per_compute_block=ppcb, num_stages=stages, page_splits=splits,
                    group_splits=groups)
    return want if got == want else got


def check_gpu_dtype(kv_dtype, chip: chips.Chip | None = None) -> None:
    """Raises ValueError when ``chip`` (default: :func:`chips.current`)
    cannot multiply pages of ``kv_dtype``: float8 pools below compute
    capability 8.9 (Triton: "Conversion from/to f8e4m3nv is only supported
    on compute capability >= 89"; the compiler aborts the process rather
    than raise). Refused at trace time, by name, before Triton sees it."""
    import jax.numpy as jnp

    chip = chip or chips.current()
    if chip is not None and not isinstance(chip, chips.Chip):
        raise ValueError(f"chip must be a pallas_kernels.chips.Chip or None, got chip={chip!r}")
    dtype = jnp.dtype(kv_dtype)
    if chip is not None and not chip.fp8 and dtype.name.startswith("float8"):
        raise ValueError(f"{chip.description} (compute capability {chip.compute_capability}) has no float8: a "
                         f"{dtype.name} pool needs compute capability >= 8.9; use int8 (same bytes, per-token "
                         "scales) or bfloat16 pages on this GPU")
