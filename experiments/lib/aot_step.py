"""The engine's whole jitted step compiled ahead of time for a chip that is
not here, with the compiled program's memory and cost analyses.

:func:`paged_jax.engine.step.device_step` (page-state updates, the forward with
the flat kernel writing K/V, sampling) is traced with
``jax.ShapeDtypeStruct`` arguments at a preset's real shapes (nothing is
allocated: Llama-3-8B's weights are 16 GB) and compiled as
:mod:`experiments.lib.aot` compiles the kernels: TPU by libtpu for the chip's
topology (memory analysis checked against the chip's usable HBM), GPU
lowered for CUDA with its Triton kernels compiled to PTX.

Usage: ``python -m experiments.kernels.compile_kernels`` (the table in
``results/``); tests: ``tests/test_aot.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from experiments.lib import aot


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCase:
    """The engine's jitted device step (:func:`paged_jax.engine.step.device_step`:
    page-state updates, the model's forward with the flat kernel writing
    K/V, sampling) at a preset's real shapes, compiled for one chip.

    Attributes:
      model: a key of ``models.presets.PRESETS`` (weights in bfloat16).
      chip: a key of ``pallas_kernels.chips.CHIPS``.
      page_size: tokens per page.
      max_seqs: sequence slots (rows of the page state).
      prefill_tokens: tokens of the call's one prefill chunk.
      decodes: decode sequences in the call (one token each).
      headroom_bytes: device memory left out of the pool for the
        program's own buffers (weights are counted exactly); the pool takes
        the rest of the chip's usable HBM (``Chip.usable_hbm_bytes``).
    """

    model: str = "llama-3-8b"
    chip: str = "v5e"
    page_size: int = 16
    max_seqs: int = 64
    prefill_tokens: int = 448
    decodes: int = 63
    headroom_bytes: int = 64 << 20

    def __post_init__(self):
        from models.presets import PRESETS
        from pallas_kernels import chips

        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {sorted(PRESETS)}, got model={self.model!r}")
        chips.get(self.chip)  # names the known chips
        if not isinstance(self.page_size, int) or self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two (an int), got page_size={self.page_size!r}")
        for name, least in (("max_seqs", 1), ("prefill_tokens", 0), ("decodes", 0), ("headroom_bytes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {name}={value!r}")
        if self.decodes + (self.prefill_tokens > 0) > self.max_seqs:
            raise ValueError(f"decodes plus the prefill sequence must fit max_seqs, got decodes={self.decodes} "
                             f"prefill_tokens={self.prefill_tokens} max_seqs={self.max_seqs}")

    @property
    def name(self) -> str:
        return f"step/{self.model}/L{self.page_size}/{self.chip}"


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What compiling a :class:`StepCase` gave.

    Attributes:
      case: the case.
      status: ``"ok"`` (compiled, and argument + output + temporary bytes,
        less what outputs alias, fit the chip's usable HBM), ``"over"``
        (compiled, but does not fit) or ``"error"``.
      seconds: compile time, seconds (tracing and lowering included).
      num_pages: pages in the pool (the null page included).
      tokens: tokens the pool holds.
      weight_bytes, pool_bytes: bytes of the weights and of the K/V pool.
      argument_bytes, output_bytes, alias_bytes, temp_bytes: the compiled
        program's memory analysis, bytes.
      peak_bytes: ``argument + output - alias + temp``, bytes.
      hbm_bytes: the chip's usable memory (``Chip.usable_hbm_bytes``), bytes.
      flops, bytes_accessed: the compiled program's cost analysis (XLA's
        estimate: it counts a loop's body once, so the layer scan's 32
        layers count as one; the kernels' custom calls as XLA sees them).
      kernels: Pallas kernels in the program (TPU: Mosaic custom calls of
        the compiled program; GPU: Triton kernels compiled to PTX). 0
        means the step ran interpreted kernels, or none.
      message: the error, if any.
    """

    case: StepCase
    status: str
    seconds: float = 0.0
    num_pages: int = 0
    tokens: int = 0
    weight_bytes: int = 0
    pool_bytes: int = 0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    peak_bytes: int = 0
    hbm_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    kernels: int = 0
    message: str = ""

    def row(self) -> dict:
        """A flat dict, for CSV and JSON."""
        row = dataclasses.asdict(self)
        row.update(dataclasses.asdict(self.case))
        row.pop("case")
        return row


def step_structs(case: StepCase, sharding):
    """The arguments of :func:`paged_jax.engine.step.device_step` for ``case``, as
    ``jax.ShapeDtypeStruct`` (nothing is allocated: an 8B model is 16 GB),
    and its static options.

    The call is a mixed one: ``decodes`` sequences of one token and one
    prefill chunk of ``prefill_tokens``, each sampling (temperature and
    top-p: the general sampler). The pool takes the chip's HBM less the
    weights and ``headroom_bytes``.

    Returns:
      ``(args, static, sizes)``: the positional arguments after the model,
      ``device_step``'s keyword arguments (``model`` included), and
      ``(num_pages, weight_bytes, pool_bytes)``.

    Raises:
      ValueError: the weights alone leave no room for a pool of the
        call's tokens.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.presets import random_model
    from models.ragged import RaggedModel
    from paged_jax.attention.batch import Tiling, batch_shape
    from paged_jax.engine.step import StepInputs
    from paged_jax.paging import page_state as ps
    from pallas_kernels import chips

    chip = chips.get(case.chip)
    abstract = nnx.eval_shape(lambda: random_model(case.model))
    model = RaggedModel(abstract, impl="pallas_tpu" if chip.platform == "tpu" else "pallas_gpu")
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    one_page = jax.eval_shape(lambda: model.make_kv_pool(2, case.page_size, jnp.bfloat16))
    page_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one_page)) // 2
    num_pages = (chip.usable_hbm_bytes - weight_bytes - case.headroom_bytes) // page_bytes
    S, T = case.max_seqs, case.prefill_tokens + case.decodes
    max_pages_per_seq = min(num_pages - 1, math.ceil(8192 / case.page_size))
    if num_pages - 1 < math.ceil(T / case.page_size) + case.decodes:
        raise ValueError(f"{case.model}'s weights ({weight_bytes:,} B) leave {chip.description} "
                         f"({chip.usable_hbm_bytes:,} B usable) room for {max(num_pages, 0)} pages, "
                         f"fewer than the call's tokens")
    kv = jax.eval_shape(lambda: model.make_kv_pool(num_pages, case.page_size, jnp.bfloat16))
    state = jax.eval_shape(lambda: ps.init_page_state(num_pages=num_pages, max_seqs=S,
                                                      max_pages_per_seq=max_pages_per_seq, page_size=case.page_size))
    q_lens = np.array([case.prefill_tokens] + [1] * case.decodes + [0] * (S - case.decodes - 1), np.int32)
    shape = batch_shape(q_lens, num_seq_rows=S, tiling=Tiling(), num_samples=case.decodes + 1)
    Tb, R = shape.num_tokens, shape.num_logits
    i32, f32 = np.int32, np.float32
    sizes = dict(first_kept=(S, i32), free_mask=(S, bool), num_hit=(S, i32), hit_pages=((S, max_pages_per_seq), i32),
                 hit_tokens=(S, i32), num_new=(S, i32), q_lens=(S, i32), min_pages=(S, i32), fork_pre=(S, i32),
                 fork_src=(S, i32), tokens=(Tb, i32), from_prev=(Tb, bool), positions=(Tb, i32),
                 token_rows=(Tb, i32), q_starts=(S, i32), logits_rows=(R, i32), logits_slots=(R, i32),
                 temperature=(R, f32), top_p=(R, f32), seeds=(R, np.uint32), streams=(R, i32), steps=(R, i32),
                 prompt_rows=(0, i32), prompt_targets=(0, i32), verify_rows=(0, i32), verify_proposals=(0, i32),
                 verify_params=(0, i32), verify_steps=(0, i32))
    missing = {f.name for f in dataclasses.fields(StepInputs)} ^ set(sizes)
    if missing:  # a field added to StepInputs must be sized here
        raise ValueError(f"StepInputs fields not sized by step_structs: {sorted(missing)}")
    inputs = StepInputs(**{k: np.zeros(s, d) for k, (s, d) in sizes.items()})

    def struct(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    args = jax.tree.map(struct, (model.params, state, kv, np.zeros(S, np.int32), inputs))
    static = dict(model=model, shape=shape, greedy_only=False, top_k=0)
    return args, static, (num_pages, weight_bytes, num_pages * page_bytes)


def compile_step(case: StepCase) -> StepResult:
    """Compiles the engine's step for ``case`` in this process (the
    ``.venv-aot`` interpreter) and reads its memory and cost analyses.

    TPU: the whole program, compiled by libtpu for the chip's topology. GPU:
    lowered for ``cuda`` and its Triton kernels compiled to PTX (XLA's GPU
    compile of the rest needs a GPU): no memory analysis.
    """
    import jax

    from paged_jax.engine.step import device_step
    from pallas_kernels import chips

    chip = chips.get(case.chip)
    start = time.perf_counter()
    try:
        with chips.target(chip):
            if chip.platform == "tpu":
                device, sharding = aot.tpu_device(chip)
                with jax.default_device(device):
                    args, static, (num_pages, weight_bytes, pool_bytes) = step_structs(case, sharding)
                    compiled = device_step.trace(static.pop("model"), *args, **static).lower().compile()
                mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
            else:
                args, static, (num_pages, weight_bytes, pool_bytes) = step_structs(case, None)
                module = device_step.trace(static.pop("model"), *args, **static).lower(
                    lowering_platforms=("cuda",)).compiler_ir("stablehlo")
                mem, cost, kernels = None, {}, len(aot.compile_triton(module, chip))
    except Exception as e:  # noqa: BLE001 (the compilers raise their own types)
        return StepResult(case=case, status="error", seconds=time.perf_counter() - start,
                          message=f"{type(e).__name__}: {str(e)[:600]}")
    seconds = time.perf_counter() - start
    sizes = dict(num_pages=num_pages, tokens=(num_pages - 1) * case.page_size, weight_bytes=weight_bytes,
                 pool_bytes=pool_bytes, hbm_bytes=chip.usable_hbm_bytes, flops=float(cost.get("flops", 0.0)),
                 bytes_accessed=float(cost.get("bytes accessed", 0.0)), kernels=kernels)
    if mem is None:
        return StepResult(case=case, status="ok", seconds=seconds, message="lowered; Triton kernels compiled to PTX; "
                          "XLA's GPU compile needs a GPU", **sizes)
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return StepResult(case=case, status="ok" if peak <= chip.usable_hbm_bytes else "over", seconds=seconds,
                      argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                      alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes, peak_bytes=peak,
                      **sizes)


def run_step(case: StepCase, *, python: Path | str = aot.AOT_PYTHON, timeout: float = 900.0) -> StepResult:
    """Compiles the engine's step for ``case`` in a worker process of
    ``python`` (libtpu may abort the process: then the result is
    ``"aborted"`` with the end of its stderr).

    Raises:
      FileNotFoundError: ``python`` does not exist (run ``make setup``).
      TimeoutError: it took longer than ``timeout`` seconds.
    """
    if not Path(python).exists():
        raise FileNotFoundError(f"no compilers' interpreter at {python}: run `make setup` (it builds .venv-aot)")
    try:
        proc = subprocess.run([str(python), "-m", "experiments.lib.aot_step", "--worker"], cwd=aot.ROOT, env=aot.aot_env(),
                              input=json.dumps(dataclasses.asdict(case)), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"compiling {case.name} took over {timeout} s") from None
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        tail = " | ".join(line for line in proc.stderr.splitlines() if "Check failed" in line or "Error" in line)
        return StepResult(case=case, status="aborted", message=f"exit {proc.returncode}: {(tail or proc.stderr)[-600:]}")
    row = rows[-1]
    fields = {f.name for f in dataclasses.fields(StepResult)} - {"case"}
    return StepResult(case=case, **{k: row[k] for k in fields})


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        print(json.dumps(compile_step(StepCase(**json.loads(sys.stdin.read()))).row()), flush=True)
    else:
        sys.exit("usage: python -m experiments.lib.aot_step --worker (a StepCase as JSON on stdin); "
                 "the table: python -m experiments.kernels.compile_kernels")
