"""Ahead-of-time compilation of the Pallas kernels for chips that are not here.

Interpret mode checks a kernel's numbers, never whether a real compiler takes
it: Mosaic's layout rules, DMA tile alignment, VMEM, Triton's shared memory
and dtype support. This module compiles each kernel for real chips on a
machine with no accelerator:

* TPU (libtpu): ``jax.experimental.topologies.get_topology_desc`` builds a
  topology of the chip (``v5e:2x2``), the arguments are placed on one of its
  devices, and ``jax.jit(f).trace(...).lower().compile()`` runs the whole
  TPU compiler, Mosaic included. The kernel's VMEM is counted from its
  ``pallas_call`` (:func:`vmem_bytes`): double-buffered blocks and scratch,
  padded to Mosaic's (8, 128) tiles; libtpu itself refuses a kernel over its
  scoped VMEM.
* GPU (Triton to PTX): the program is lowered for ``cuda``, each Triton
  custom call's IR is taken from the module and compiled by the CUDA
  plugin's Triton for the chip's compute capability, which reports the
  block's shared memory (checked against the chip's limit). XLA's own GPU
  compile needs a GPU and is not run.

libtpu aborts the whole process on a failed internal check, so cases run in
worker processes (:func:`run_cases`): a worker compiles a list of cases and
prints one JSON line per case; when it dies, the case it was on is recorded
as aborted and the rest go to a new worker.

The compilers live in their own virtualenv, ``.venv-aot`` (``make setup``):
``jax[tpu]`` (libtpu, 1.3 GB) and ``jax-cuda12-plugin`` at the project's JAX
version. Not the test venv: with libtpu installed every ``import jax`` there
would probe for a TPU, and the CUDA plugin for a GPU, on machines that have
neither; a venv of its own keeps the user's JAX as it is.

The engine's whole step, compiled the same way: :mod:`experiments.lib.aot_step`.

Usage: ``python -m experiments.kernels.compile_kernels`` (the table in
``results/``); tests: ``tests/test_aot.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
"""The compilers' interpreter (``make setup`` builds it)."""

KERNELS = ("paged_attention_tpu", "flat_ragged_tpu", "paged_attention_gpu", "ragged_paged_attention", "flat_ragged_gpu")
"""Every Pallas kernel of ``pallas_kernels`` (the flat kernel once per
implementation)."""

PLATFORM = {"paged_attention_tpu": "tpu", "flat_ragged_tpu": "tpu", "paged_attention_gpu": "cuda",
            "ragged_paged_attention": "cuda", "flat_ragged_gpu": "cuda"}

HEADS = {"llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64), "qwen2.5-7b": (28, 4, 128),
         "gemma-3-12b": (16, 8, 256)}
"""(query heads, KV heads, head dim) of the presets the kernels are compiled
at (``models.presets.PRESETS``; ``tests/test_aot.py`` checks they agree)."""

LATENT = {"deepseek-v3": (128, 512, 64)}
"""(query heads, latent rank C, RoPE key dim R) of the MLA presets the flat
kernels are compiled at in their latent mode (absorbed MLA: one latent
"head" of C + R = 576, keys and values the same pages;
``models.deepseek.presets.PRESETS``, checked in ``tests/test_aot.py``).
Only the flat kernels serve MLA (``paged_jax.attention.latent``)."""

LATENT_KERNELS = ("flat_ragged_tpu", "flat_ragged_gpu")

KV_DTYPES = ("bfloat16", "float32", "int8", "float8_e4m3fn")
"""Pool dtypes compiled: the float ones as stored, the quantized ones with
per-token scales."""

PAGE_SIZES = (16, 64)
"""Page sizes of the default matrix; the full one adds 8, 32, 128 and 256."""

# Static sizes of the compiled calls: a decode batch of 32 over 4,096-token
# tables (the padded ragged kernel: 16 query rows each), a flat batch of 256 tokens (decodes and up to 4 chunks), 2 layers
# of a 2,048-page pool. On-chip memory does not depend on them (only on
# block shapes); HBM sizes do, and the engine-step check sizes its own.
DECODE_BATCH, RAGGED_TOKENS, MAX_CONTEXT, FLAT_TOKENS, FLAT_CHUNKS, NUM_LAYERS, NUM_PAGES = 32, 16, 4096, 256, 4, 2, 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One kernel compiled for one chip at one configuration."""

    kernel: str
    model: str
    page_size: int
    kv_dtype: str
    chip: str

    def __post_init__(self):
        from pallas_kernels import chips

        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got kernel={self.kernel!r}")
        if self.model not in HEADS and self.model not in LATENT:
            raise ValueError(f"model must be one of {sorted(HEADS) + sorted(LATENT)}, got model={self.model!r}")
        if self.model in LATENT and self.kernel not in LATENT_KERNELS:
            raise ValueError(f"{self.model} (MLA) runs on the flat kernels only, {LATENT_KERNELS}; got "
                             f"kernel={self.kernel!r}")
        if chips.get(self.chip).platform != PLATFORM[self.kernel]:
            raise ValueError(f"{self.kernel} runs on {PLATFORM[self.kernel]}, got chip={self.chip!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two (an int), got page_size={self.page_size!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got kv_dtype={self.kv_dtype!r}")

    @property
    def name(self) -> str:
        return f"{self.kernel}-{self.chip}-{self.model}-L{self.page_size}-{self.kv_dtype}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """What compiling a :class:`Case` gave.

    Attributes:
      status: ``"ok"`` (compiled, within the chip's on-chip memory),
        ``"over"`` (compiled, but over it), ``"refused"`` (the kernel's door
        refused the configuration by name, e.g. fp8 below sm89), ``"error"``
        (the compiler raised), ``"aborted"`` (the compiler killed the
        process).
      seconds: wall time of lowering and compiling.
      on_chip_bytes: GPU: the largest shared memory of the program's Triton
        kernels; TPU: the kernel's VMEM (:func:`vmem_bytes`).
      limit_bytes: the chip's bound on it.
      message: the error, or what was refused.
    """

    case: Case
    status: str
    seconds: float = 0.0
    on_chip_bytes: int | None = None
    limit_bytes: int | None = None
    message: str = ""

    def row(self) -> dict:
        return {**dataclasses.asdict(self.case), "status": self.status, "seconds": round(self.seconds, 2),
                "on_chip_bytes": self.on_chip_bytes, "limit_bytes": self.limit_bytes, "message": self.message}


def matrix(*, full: bool = False, chips: tuple[str, ...] = ("v5e", "v6e", "sm80", "sm90")) -> list[Case]:
    """The cases to compile.

    ``full``: the product of kernels, chips, presets, page sizes (8, 16, 32,
    64, 128, 256) and pool dtypes (960 cases, about 12 minutes on 2 cores).
    Default (the test suite's): what differs. Every kernel on every chip at
    every preset's heads (bf16, pages of 64) and at Gemma's head dim 256
    with an f32 pool, in pages of 64 and of 256 (the most on-chip memory:
    the GPU kernels split such a page, ``pallas_kernels.tuning``); every pool dtype at both
    page sizes (16, 64) at Llama-3-8B's heads on one chip per limit that
    can differ: v5e (v6e has more VMEM, same rules), sm80 (fp8 refused,
    the smaller shared memory) and sm90. The flat kernels' latent mode at
    DeepSeek-V3's MLA (:data:`LATENT`): bf16 pages of 64 (FlashMLA's page)
    on every chip, int8 and fp8 on v5e and sm90; the full matrix: every
    page size and dtype.
    """
    from pallas_kernels import chips as chip_table

    if isinstance(chips, str):
        raise ValueError(f"chips must be a tuple of chip names, got chips={chips!r}")
    page_sizes = (8, 16, 32, 64, 128, 256) if full else PAGE_SIZES
    cases = set()
    for kernel in KERNELS:
        for chip in chips:
            if chip_table.get(chip).platform != PLATFORM[kernel]:
                continue
            if full:
                cases.update(Case(kernel=kernel, model=m, page_size=p, kv_dtype=d, chip=chip)
                             for m in HEADS for p in page_sizes for d in KV_DTYPES)
                continue
            cases.update(Case(kernel=kernel, model=m, page_size=64, kv_dtype="bfloat16", chip=chip) for m in HEADS)
            cases.update(Case(kernel=kernel, model="gemma-3-12b", page_size=p, kv_dtype="float32", chip=chip)
                         for p in (64, 256))
            if chip in ("v5e", "sm80", "sm90"):
                cases.update(Case(kernel=kernel, model="llama-3-8b", page_size=p, kv_dtype=d, chip=chip)
                             for p in page_sizes for d in KV_DTYPES)
    for kernel in LATENT_KERNELS:
        for chip in chips:
            if chip_table.get(chip).platform != PLATFORM[kernel]:
                continue
            dtypes = KV_DTYPES if full else ("bfloat16",) + (("int8", "float8_e4m3fn") if chip in ("v5e", "sm90")
                                                             else ())
            cases.update(Case(kernel=kernel, model=m, page_size=p, kv_dtype=d, chip=chip)
                         for m in LATENT for p in (page_sizes if full else (64,)) for d in dtypes)
    return sorted(cases, key=lambda c: c.name)


# ---------------------------------------------------------------------------------------------------------------------
# In the worker (the .venv-aot interpreter).


def _structs(case: Case, sharding):
    """The kernel's function and the ShapeDtypeStructs of its arguments."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import common, paged_attention_gpu, paged_attention_tpu, ragged_paged_attention
    from pallas_kernels import flat_ragged_attention as flat

    if case.model in LATENT:
        num_q_heads, latent_dim, rope_dim = LATENT[case.model]
        num_kv_heads, head_dim = 1, latent_dim + rope_dim
    else:
        (num_q_heads, num_kv_heads, head_dim), latent_dim = HEADS[case.model], None
    kv_dtype = jnp.dtype(case.kv_dtype)
    quantized = common.is_quantized(kv_dtype)
    q_dtype = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16
    pages_per_seq = MAX_CONTEXT // case.page_size
    i32 = jnp.int32

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    # At most 2,048 pages and 256 MiB a pool: HBM (a v5e's 16 GiB) must hold the call's copies of it.
    num_pages = min(NUM_PAGES, (256 << 20) // (NUM_LAYERS * num_kv_heads * case.page_size * head_dim * kv_dtype.itemsize))
    pool = s((NUM_LAYERS, num_kv_heads, num_pages, case.page_size, head_dim), kv_dtype)
    scales = s((NUM_LAYERS, num_kv_heads, num_pages, case.page_size), jnp.float32) if quantized else None
    # The kernels' public doors, traced: their static checks run (a value
    # check needs values, which a trace has not), as in a real call.
    if case.kernel in ("paged_attention_tpu", "paged_attention_gpu"):
        door = (paged_attention_tpu.paged_attention_tpu if case.kernel == "paged_attention_tpu"
                else paged_attention_gpu.paged_attention_gpu)

        def f(q, k, v, tables, lengths, layer, ks=None, vs=None):
            return door(q, k, v, tables, lengths, ks, vs, layer=layer, interpret=False)

        args = [s((DECODE_BATCH, num_q_heads, head_dim), q_dtype), pool, pool, s((DECODE_BATCH, pages_per_seq), i32),
                s((DECODE_BATCH,), i32), s((), i32)]
    elif case.kernel == "ragged_paged_attention":
        def f(q, k, v, tables, kv_lens, q_lens, layer, ks=None, vs=None):
            return ragged_paged_attention.ragged_paged_attention(q, k, v, tables, kv_lens, q_lens, ks, vs,
                                                                 layer=layer, interpret=False)

        args = [s((DECODE_BATCH, RAGGED_TOKENS, num_q_heads, head_dim), q_dtype), pool, pool,
                s((DECODE_BATCH, pages_per_seq), i32), s((DECODE_BATCH,), i32), s((DECODE_BATCH,), i32), s((), i32)]
    else:
        impl = "tpu" if case.kernel == "flat_ragged_tpu" else "gpu"
        seqs = FLAT_TOKENS
        sizes = dict(decode_tiles=seqs, prefill_chunks=FLAT_CHUNKS, impl=impl, interpret=False)
        tables = [s((seqs, pages_per_seq), i32), s((seqs,), i32), s((seqs,), i32), s((seqs,), i32)]
        q = s((FLAT_TOKENS, num_q_heads, head_dim), q_dtype)
        if latent_dim is None:
            def f(q, k_new, v_new, k, v, layer, tables, q_starts, q_lens, kv_lens, slots, ks=None, vs=None):
                return flat.flat_ragged_paged_attention(
                    q, k_new, v_new, k, v, layer, tables, q_starts, q_lens, kv_lens, slots, k_scales=ks, v_scales=vs,
                    **sizes)

            new = s((FLAT_TOKENS, num_kv_heads, head_dim), q_dtype)
            args = [q, new, new, pool, pool, s((), i32), *tables, s((FLAT_TOKENS,), i32)]
        else:  # MLA's absorbed form: the latents already written, one pool as keys and values
            def f(q, latents, layer, tables, q_starts, q_lens, kv_lens, ks=None, vs=None):
                return flat.flat_ragged_paged_attention(
                    q, None, None, latents, latents, layer, tables, q_starts, q_lens, kv_lens, None, k_scales=ks,
                    v_scales=ks, latent_dim=latent_dim, **sizes)

            args = [q, pool, s((), i32), *tables]
    if quantized:
        args += [scales, scales]
    return f, args


def vmem_bytes(jaxpr) -> int:
    """The largest VMEM footprint of the ``pallas_call``s in a (closed)
    jaxpr: each block with a VMEM (default) memory space twice (Pallas'
    pipeline double-buffers it) plus the VMEM scratch, every buffer's last
    two dims padded to Mosaic's tiles ((8 x 32 / bits) sublanes, 128
    lanes). Blocks left in HBM (``memory_space=ANY``) and semaphores take
    none."""
    import numpy as np

    def padded(shape, dtype) -> int:
        shape = list(shape) or [1]
        itemsize = np.dtype(dtype).itemsize
        if len(shape) >= 2:
            shape[-2] = -(-shape[-2] // (8 * max(1, 4 // itemsize))) * (8 * max(1, 4 // itemsize))
        shape[-1] = -(-shape[-1] // 128) * 128
        return math.prod(shape) * itemsize

    def memory_space(aval) -> str:
        return str(getattr(aval, "memory_space", "")).lower()

    best = 0

    def walk(jx):
        nonlocal best
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                total = 0
                for bm in gm.block_mappings:
                    aval = bm.transformed_block_aval
                    if "any" in memory_space(aval) or "hbm" in memory_space(aval) or "smem" in memory_space(aval):
                        continue
                    total += 2 * padded(aval.shape, aval.dtype)
                for aval in gm.scratch_avals:
                    if "vmem" in memory_space(aval):
                        total += padded(aval.shape, aval.dtype)
                best = max(best, total)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    walk(inner if hasattr(inner, "eqns") else inner.jaxpr)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return best


def _triton_calls(module):
    """(name, IR bytes, num_warps, num_stages) of every Triton custom call in
    a lowered StableHLO module."""
    from jax._src.lib.mlir import ir

    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and "triton" in ir.StringAttr(
                            inner.attributes["call_target_name"]).value:
                        cfg = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        found.append((ir.StringAttr(cfg["name"]).value, ir.StringAttr(cfg["ir"]).value_bytes,
                                      ir.IntegerAttr(cfg["num_warps"]).value,
                                      ir.IntegerAttr(cfg["num_stages"]).value if "num_stages" in cfg else 1))
                    walk(inner.operation)

    walk(module.operation)
    return found


def tpu_device(chip):
    """One device of ``chip``'s topology (no chip needed: libtpu describes
    it) and a sharding that puts an argument whole on it."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(platform="tpu", topology_name=chip.topology)
    return topology.devices[0], NamedSharding(Mesh(topology.devices[:1], ("x",)), PartitionSpec())


def compile_triton(module, chip) -> list[int]:
    """Compiles every Triton kernel of a module lowered for ``cuda`` to PTX
    for ``chip``; returns each one's shared memory per block, bytes."""
    from jax._src.lib import triton

    return [triton.compile("cuda", ir_bytes, chip.compute_capability, num_warps=warps, num_ctas=1,
                           num_stages=stages).smem_bytes for _, ir_bytes, warps, stages in _triton_calls(module)]


def compile_case(case: Case) -> Result:
    """Compiles one case in this process (which must be the ``.venv-aot``
    interpreter: libtpu and the CUDA plugin) and measures it."""
    import jax

    from pallas_kernels import chips

    chip = chips.get(case.chip)
    start = time.perf_counter()
    try:
        with chips.target(chip):
            if chip.platform == "tpu":
                device, sharding = tpu_device(chip)
                f, args = _structs(case, sharding)
                # Pallas asks the default device for chip facts (integer division lowers through them).
                with jax.default_device(device):
                    traced = jax.jit(f).trace(*args)
                    used = vmem_bytes(traced.jaxpr)
                    traced.lower().compile()
            else:
                f, args = _structs(case, None)
                traced = jax.jit(f).trace(*args)
                module = traced.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
                used = max(compile_triton(module, chip), default=0)
    except ValueError as e:
        return Result(case=case, status="refused", seconds=time.perf_counter() - start, message=str(e)[:300])
    except Exception as e:  # noqa: BLE001 (the compilers raise their own types)
        return Result(case=case, status="error", seconds=time.perf_counter() - start,
                      message=f"{type(e).__name__}: {str(e)[:600]}")
    status = "ok" if used <= chip.on_chip_limit else "over"
    return Result(case=case, status=status, seconds=time.perf_counter() - start, on_chip_bytes=used,
                  limit_bytes=chip.on_chip_limit)


def _worker() -> None:
    """Compiles the cases given as JSON lines on stdin, printing one JSON
    result a line (flushed: the parent keeps what was done if we die)."""
    for line in sys.stdin:
        case = Case(**json.loads(line))
        print(json.dumps(compile_case(case).row()), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# In the parent.


def aot_env() -> dict:
    """The environment of a worker: CPU as JAX's platform (the TPU and GPU
    are targets, not devices), libtpu told it has no chip, the project on
    the path."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", TPU_SKIP_MDS_QUERY="1",
               TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_WORKER_HOSTNAMES="localhost", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_cases(cases: list[Case], *, jobs: int = 2, python: Path | str = AOT_PYTHON,
              timeout: float = 600.0) -> list[Result]:
    """Compiles ``cases`` in up to ``jobs`` worker processes of ``python``.

    Cases are dealt to the workers round robin; a worker that dies (libtpu's
    abort) has its current case recorded as ``"aborted"`` with the end of
    its stderr, and its remaining cases go to a fresh worker.

    Returns:
      One :class:`Result` per case, in the order of ``cases``.

    Raises:
      FileNotFoundError: ``python`` does not exist (run ``make setup``).
      TimeoutError: the cases took longer than ``timeout`` seconds.
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got jobs={jobs!r}")
    if not Path(python).is_file():
        raise FileNotFoundError(f"no compilers' interpreter at {python}: run `make setup` (it builds .venv-aot)")
    deadline = time.monotonic() + timeout
    results: dict[Case, Result] = {}
    running: list[tuple[subprocess.Popen, list[Case], tempfile.TemporaryDirectory]] = []

    def start(todo: list[Case]):
        # Files, not pipes: libtpu's logs could fill a pipe and stall a worker nobody reads yet.
        folder = tempfile.TemporaryDirectory(prefix="paged_jax_aot_")
        cases_file = Path(folder.name, "cases.jsonl")
        cases_file.write_text("".join(json.dumps(dataclasses.asdict(c)) + "\n" for c in todo))
        with open(cases_file) as stdin, open(Path(folder.name, "out"), "w") as out, \
                open(Path(folder.name, "err"), "w") as err:
            proc = subprocess.Popen([str(python), "-m", "experiments.lib.aot", "--worker"], cwd=ROOT, env=aot_env(),
                                    stdin=stdin, stdout=out, stderr=err)
        running.append((proc, todo, folder))

    for i in range(jobs):
        if cases[i::jobs]:
            start(cases[i::jobs])
    while running:
        proc, todo, folder = running.pop(0)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _, _ in running + [(proc, todo, folder)]:
                p.kill()
            raise TimeoutError(f"compiling {len(cases)} cases took over {timeout} s") from None
        out = Path(folder.name, "out").read_text()
        err = Path(folder.name, "err").read_text(errors="replace")
        folder.cleanup()
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            case = Case(**{k: row[k] for k in ("kernel", "model", "page_size", "kv_dtype", "chip")})
            results[case] = Result(case=case, status=row["status"], seconds=row["seconds"],
                                   on_chip_bytes=row["on_chip_bytes"], limit_bytes=row["limit_bytes"],
                                   message=row["message"])
        left = [c for c in todo if c not in results]
        if left:  # the worker died on left[0]
            tail = " | ".join(line for line in err.splitlines() if "Check failed" in line or "Error" in line)[-600:]
            results[left[0]] = Result(case=left[0], status="aborted",
                                      message=f"exit {proc.returncode}: {tail or err[-600:]}")
            if left[1:]:
                start(left[1:])
    return [results[c] for c in cases]


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        sys.exit("usage: python -m experiments.lib.aot --worker (cases as JSON lines on stdin); "
                 "the table: python -m experiments.kernels.compile_kernels")
