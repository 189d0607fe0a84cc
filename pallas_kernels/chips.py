"""The chips the kernels are compiled for, and the on-chip memory each allows.

A kernel is done when the real compilers accept it: libtpu for TPU
topologies, Triton to PTX for NVIDIA architectures (``experiments.lib.aot``
compiles every kernel for each chip here with no device at hand). What
interpret mode never checks, and these numbers bound: the shared memory one
GPU thread block may use and the VMEM a TPU kernel's buffers take.

Which chip a kernel is tuned for (:mod:`pallas_kernels.tuning`) is the chip
JAX runs on (:func:`current`), or the one named by :func:`target` while a
program is traced for a chip that is not here (ahead-of-time compilation).

Sources: NVIDIA's CUDA C Programming Guide, table "Technical Specifications
per Compute Capability" (maximum shared memory per thread block: 163 KB on
8.0, 227 KB on 9.0; fp8 tensor cores from 8.9, which Triton's
``f8e4m3nv`` conversion needs); Google Cloud TPU system architecture pages
(v5e: 16 GiB HBM at 819 GB/s, 197 bf16 TFLOP/s; v6e: 32 GiB at 1,640 GB/s,
918 TFLOP/s; 128 MiB of VMEM on each, of which libtpu lets a kernel scope
16 MiB by default on v5e and 32 MiB on v6e unless ``vmem_limit_bytes``
asks for more).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator the kernels are compiled and tuned for.

    Attributes:
      name: short name (``"v5e"``, ``"sm90"``).
      platform: ``"tpu"`` or ``"cuda"``.
      description: what it is, for tables.
      topology: (TPU) the topology ``jax.experimental.topologies`` builds.
      compute_capability: (GPU) ``"9.0"``, the architecture Triton targets.
      smem_per_block: (GPU) bytes of shared memory one thread block may use.
      vmem_bytes: (TPU) bytes of VMEM per core.
      scoped_vmem_bytes: (TPU) bytes of VMEM a kernel may use without
        raising ``vmem_limit_bytes``.
      hbm_bytes: device memory, bytes.
      hbm_available_bytes: of it, what one program may use (libtpu keeps
        some for itself: on 2026-12-04, libtpu 0.0.42.1's out-of-memory
        message gave 15.75 GiB for v5e and 31.25 GiB for v6e); None: all.
      fp8: whether pages of float8 can be multiplied (GPU: compute
        capability >= 8.9).
    """

    name: str
    platform: str
    description: str
    topology: str | None = None
    compute_capability: str | None = None
    smem_per_block: int | None = None
    vmem_bytes: int | None = None
    scoped_vmem_bytes: int | None = None
    hbm_bytes: int
    hbm_available_bytes: int | None = None
    fp8: bool = True

    def __post_init__(self):
        if self.platform not in ("tpu", "cuda"):
            raise ValueError(f"platform must be 'tpu' or 'cuda', got platform={self.platform!r}")
        if (self.platform == "tpu") != (self.topology is not None and self.vmem_bytes is not None):
            raise ValueError(f"a TPU chip has a topology and VMEM, a GPU neither, got {self}")
        if (self.platform == "cuda") != (self.compute_capability is not None and self.smem_per_block is not None):
            raise ValueError(f"a GPU has a compute capability and a shared-memory limit, a TPU neither, got {self}")

    @property
    def on_chip_limit(self) -> int:
        """The bound a kernel's on-chip buffers must fit: shared memory per
        block (GPU) or scoped VMEM (TPU), bytes."""
        return self.smem_per_block if self.platform == "cuda" else self.scoped_vmem_bytes

    @property
    def usable_hbm_bytes(self) -> int:
        """Device memory one program may use, bytes."""
        return self.hbm_bytes if self.hbm_available_bytes is None else self.hbm_available_bytes


CHIPS: dict[str, Chip] = {
    "v5e": Chip(name="v5e", platform="tpu", description="TPU v5e (v5 lite)", topology="v5e:2x2",
                vmem_bytes=128 * MiB, scoped_vmem_bytes=16 * MiB, hbm_bytes=16 * GiB,
                hbm_available_bytes=15 * GiB + 768 * MiB),
    "v6e": Chip(name="v6e", platform="tpu", description="TPU v6e (Trillium)", topology="v6e:2x2",
                vmem_bytes=128 * MiB, scoped_vmem_bytes=32 * MiB, hbm_bytes=32 * GiB,
                hbm_available_bytes=31 * GiB + 256 * MiB),
    "sm80": Chip(name="sm80", platform="cuda", description="NVIDIA A100 (sm80)", compute_capability="8.0",
                 smem_per_block=163 * KiB, hbm_bytes=80 * 10**9, fp8=False),
    "sm90": Chip(name="sm90", platform="cuda", description="NVIDIA H100 / H200 (sm90)", compute_capability="9.0",
                 smem_per_block=227 * KiB, hbm_bytes=80 * 10**9),
}
"""The chips every kernel is compiled for in the test suite (``make test``)."""

_TARGET = jax.make_user_context(default_value=None)
"""The chip :func:`target` names, part of every ``jax.jit`` cache key: a
function traced for one chip is traced again for another, never reused with
the first chip's tiling (which the kernels choose while being traced).
Per thread, as JAX's own contexts are."""


def get(name: str) -> Chip:
    """The chip named ``name`` (a key of :data:`CHIPS`).

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    if not isinstance(name, str) or name not in CHIPS:
        raise ValueError(f"chip must be one of {sorted(CHIPS)}, got chip={name!r}")
    return CHIPS[name]


@contextlib.contextmanager
def target(chip: Chip | str):
    """Tune kernels traced inside the block for ``chip`` (a :class:`Chip` or
    its name), not for the device JAX runs on: what ahead-of-time
    compilation for a chip that is not here needs.

    Raises:
      ValueError: ``chip`` is neither a :class:`Chip` nor a known name.
    """
    chip = get(chip) if isinstance(chip, str) else chip
    if not isinstance(chip, Chip):
        raise ValueError(f"chip must be a pallas_kernels.chips.Chip or one of {sorted(CHIPS)}, got chip={chip!r}")
    with _TARGET(chip):
        yield chip


def generic_gpu(compute_capability: str) -> Chip:
    """A GPU not in :data:`CHIPS`, described as cautiously as its compute
    capability allows: the smallest shared memory per block of its
    generation (99 KiB from 8.0 on: A10, L4 and the RTX 30 / 40 cards have
    that much where A100 and H100 have more; 96 KiB on 7.x), so a kernel
    tiled for it fits whatever card it is, and float8 from 8.9 on.

    Raises:
      ValueError: ``compute_capability`` is not ``"major.minor"``.
    """
    try:
        major, minor = (int(x) for x in str(compute_capability).split("."))
    except ValueError:
        raise ValueError(f"compute_capability must be 'major.minor', got {compute_capability!r}") from None
    return Chip(name=f"sm{major}{minor}", platform="cuda", description=f"a GPU of compute capability {major}.{minor}",
                compute_capability=f"{major}.{minor}", smem_per_block=(99 if major >= 8 else 96) * KiB,
                hbm_bytes=16 * GiB, fp8=(major, minor) >= (8, 9))


def from_device(device) -> Chip | None:
    """The :class:`Chip` a JAX device is: one of :data:`CHIPS`, a
    :func:`generic_gpu` for another GPU (never taken for an H100: an A10
    tuned as one would ask for more shared memory than it has), or None for
    a CPU or a TPU not in the table (then the kernels keep their
    defaults)."""
    if device.platform == "gpu":
        cc = str(getattr(device, "compute_capability", ""))
        return next((c for c in CHIPS.values() if c.compute_capability == cc), None) or generic_gpu(cc)
    if device.platform == "tpu":
        kind = device.device_kind.lower()
        if "v5 lite" in kind or "v5e" in kind:
            return CHIPS["v5e"]
        if "v6" in kind:
            return CHIPS["v6e"]
    return None


def targeted() -> Chip | None:
    """The chip :func:`target` names in this thread, or None outside it."""
    return _TARGET.value


def current() -> Chip | None:
    """The chip kernels are tuned for now: the one :func:`target` names, else
    the first device JAX has (None on a CPU)."""
    chip = targeted()
    return chip if chip is not None else from_device(jax.devices()[0])
