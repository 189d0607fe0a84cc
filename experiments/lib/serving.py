"""Serving measured: the engine built from a K/V token budget, one mode's
run timed without compilation, its result row, and the matmul floor.

The serving experiments (``serve_sharegpt``, ``hf_baseline``, ``reproduce``,
``sharing``, ``scaling``, ``train_tiny``) all build their engines here:
:func:`make_engine` sizes the pool from a budget in tokens
(:func:`pool_pages`: whole pages plus the null page, which holds no
sequence's K/V) and :func:`serve` runs requests in one allocation mode
(:data:`MODE_RESERVATIONS`):

* ``paged``: pages handed out as sequences grow (PagedAttention, Kwon et
  al., SOSP 2023);
* ``contiguous``: each request reserves :data:`MAX_SEQ_LEN` tokens when
  admitted, as pre-paging servers did (paper section 3; Orca (Max) in
  section 6.1);
* ``contiguous-pow2``, ``contiguous-oracle``: each reserves its prompt plus
  the next power of two of its output length, or exactly its output length
  (Orca (Pow2), Orca (Oracle); :mod:`paged_jax.engine.config`).

Wall times exclude jit compilation (measured through ``jax.monitoring``),
so that a mode that runs second is not favoured by programs the first one
compiled.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from experiments.lib import provenance, workloads
from experiments.lib.sharegpt import MAX_SEQ_LEN
from experiments.lib.workloads import Workload
from models import llm
from models.ragged import weight_matmuls
from models.sharded import make_data_parallel_engine
from paged_jax.checks import check_choice, check_int
from paged_jax.distributed.data_parallel import DataParallelEngine, merged_stats
from paged_jax.engine.core import Engine, EngineConfig, EngineStats
from paged_jax.engine.outputs import drain
from paged_jax.engine.requests import Request, RequestOutput
from paged_jax.jit_stats import CompileCounts, CompileMonitor
from paged_jax.paging.kv_cache import default_kv_dtype
from paged_jax.profiling import ProfileSpec
from paged_jax.simulator.hardware import device_key, get_device, get_model
from paged_jax.simulator.step_time import RooflineStepTime, profile_rows

MODE_RESERVATIONS = {"paged": "paged", "contiguous": "max", "contiguous-pow2": "pow2", "contiguous-oracle": "oracle"}
"""Each mode :func:`serve` runs, by the name its result row carries, and the
``EngineConfig.reservation`` it runs under (the names follow
``waste_sim``'s layouts; ``contiguous`` is their ``contiguous-max``)."""
MODES = ("paged", "contiguous")
"""The modes the demo (``serve_sharegpt``) compares."""
CSV_COLUMNS = (
    "mode",
    "requests",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "peak_concurrency",
    "mean_concurrency",
    "kv_token_fraction",
    "preemptions",
    "iterations",
    "model_calls",
    "model_s",
    "floor_s",
    "model_over_floor",
    "padding",
    "host_s",
    "compile_s",
    "programs",
    "compiled",
    "weights_dtype",
    "kv_dtype",
)
"""The columns of :class:`ServeResult` a results table shows, in order."""


def pool_pages(kv_tokens: int, page_size: int) -> int:
    """Pages of a pool that holds ``kv_tokens`` tokens of K/V: the whole
    pages they fill (rounded down) plus the null page (page 0, padding for
    unused block-table entries, never handed out).

    Raises:
      ValueError: an argument below 1, or ``kv_tokens`` below one page.
    """
    check_int("kv_tokens", kv_tokens, 1)
    check_int("page_size", page_size, 1)
    if kv_tokens < page_size:
        raise ValueError(f"kv_tokens must hold at least one page, got {kv_tokens=} {page_size=}")
    return kv_tokens // page_size + 1


def engine_config(*, max_seqs: int, max_batched_tokens: int, max_seq_len: int = MAX_SEQ_LEN,
                  **config) -> EngineConfig:
    """The ``EngineConfig`` :func:`make_engine` builds: ``max_batched_tokens``
    raised to ``max_seqs`` (every running sequence decodes in each call),
    ``config`` its further fields.

    Raises:
      ValueError: from ``EngineConfig``.
    """
    return EngineConfig(max_seqs=max_seqs, max_seq_len=max_seq_len,
                        max_num_batched_tokens=max(max_batched_tokens, max_seqs), **config)


def make_engine(model, *, kv_tokens: int, page_size: int, max_seqs: int, max_seq_len: int = MAX_SEQ_LEN,
                max_batched_tokens: int = 256, paged_model=None, mesh=None, stop_ids=(), kv_dtype=None,
                tokenizer=None, **config) -> Engine | DataParallelEngine:
    """An engine serving ``model`` from a fresh pool of ``kv_tokens`` tokens.

    Args:
      model: a ``models.llama.Llama`` or a ``models.deepseek.model.DeepseekModel``
        (its config shapes the pool; no ``mesh`` for the latter).
      kv_tokens: K/V slots in the pool, tokens, rounded down to whole pages
        (:func:`pool_pages`); with ``mesh``, per data shard.
      page_size: tokens per page.
      max_seqs: most sequences running at once.
      max_seq_len: most tokens per sequence, prompt plus output.
      max_batched_tokens: tokens per model call, decode tokens and prefill
        chunks together; raised to ``max_seqs`` so every running sequence
        can decode in one call.
      paged_model: ``models.llm.as_paged_model(model)`` (default a new one);
        pass the same one to several engines to share compiled programs.
        Not used with ``mesh``.
      mesh: a ``(data, model)`` device mesh (``paged_jax.distributed.sharding.make_mesh``):
        one engine per data shard, tensor parallel over its model devices
        (``models.sharded.make_data_parallel_engine``); None for one device.
      stop_ids: token ids that end a request (unless it ignores EOS).
      kv_dtype: dtype of the K/V pages (default
        ``paged_jax.paging.kv_cache.default_kv_dtype()``: f32 on CPU, bf16 on GPU
        and TPU).
      tokenizer: outputs carry text, detokenized as they stream
        (``Engine(tokenizer=...)``); not with ``mesh``.
      config: further :class:`paged_jax.engine.core.EngineConfig` fields
        (``reservation``, ``enable_prefix_caching``, ``preemption_mode``).

    Raises:
      ValueError: ``max_seqs`` or ``max_batched_tokens`` not an int >= 1;
        a tokenizer with a mesh; from :func:`pool_pages`, ``EngineConfig``
        or the engine.
    """
    num_pages = pool_pages(kv_tokens, page_size)
    check_int("max_seqs", max_seqs)
    check_int("max_batched_tokens", max_batched_tokens)
    kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype())
    engine_config_ = engine_config(max_seqs=max_seqs, max_seq_len=max_seq_len, max_batched_tokens=max_batched_tokens,
                                   **config)
    vocab_size = model.config.vocab_size
    if mesh is not None:
        if tokenizer is not None:
            raise ValueError("tokenizer: the data-parallel engine (mesh) does not detokenize; pass tokenizer=None")
        return make_data_parallel_engine(model, mesh, engine_config_, pages_per_shard=num_pages, page_size=page_size,
                                         stop_ids=stop_ids, vocab_size=vocab_size, kv_dtype=kv_dtype)
    paged_model = paged_model or llm.as_paged_model(model)
    pool = paged_model.make_budget_kv_pool(num_pages, page_size, kv_dtype,
                                           grouped=engine_config_.pages_by_layer_group)
    return Engine(paged_model, pool, engine_config_, stop_ids=stop_ids, vocab_size=vocab_size, tokenizer=tokenizer)


def run_timed(engine: Engine | DataParallelEngine, requests: list[Request], *, progress: bool = False,
              stream: bool = False, profile: ProfileSpec | None = None,
              ) -> tuple[list[RequestOutput], float, CompileCounts]:
    """Runs ``requests`` to completion on ``engine``.

    Args:
      stream: every request streams deltas (``output_kind="delta"``), read
        after every step and joined here (ids, text, token times), as a
        server streaming every request would.
      profile: trace a few steps of the run (``--profile``,
        :class:`paged_jax.profiling.StepProfiler`).

    Returns:
      ``(outputs in finishing order, wall seconds less the compilation
      within them, the compilations)``.
    """
    with CompileMonitor() as compiles:
        t0 = time.perf_counter()
        if profile is None:
            outputs = run_streamed(engine, requests) if stream else engine.run(requests, progress=progress)
        else:
            with profile.wrap(engine) as stepper:
                if stream:
                    outputs = run_streamed(engine, requests, stepper=stepper)
                else:
                    for r in requests:
                        engine.add_request(r)
                    outputs = drain(stepper, len(requests), progress)
        wall = time.perf_counter() - t0 - compiles.counts.seconds
    return outputs, wall, compiles.counts


def run_streamed(engine: Engine, requests: list[Request], *, stepper=None) -> list[RequestOutput]:
    """Adds ``requests`` as delta streams, steps ``engine`` (through
    ``stepper``'s ``step()`` if given: a profiler) until it has no work and
    joins each request's deltas into its final output (in finishing
    order)."""
    stepper = engine if stepper is None else stepper
    for r in requests:
        engine.add_request(dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, output_kind="delta")))
    joined: dict = {}
    done = []
    while engine.has_unfinished():
        for out in stepper.step():
            have = joined.setdefault(out.request_id, {})
            for c in out.outputs:
                if c.index not in have:
                    have[c.index] = dataclasses.replace(c, output_ids=list(c.output_ids),
                                                        token_times=list(c.token_times))
                else:
                    h = have[c.index]
                    h.output_ids += c.output_ids
                    h.token_times += c.token_times
                    h.text = None if c.text is None else h.text + c.text
                    h.finish_reason, h.stop_reason = c.finish_reason, c.stop_reason
            if out.finished:
                done.append(dataclasses.replace(out, outputs=[have[i] for i in sorted(have)]))
    return done


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeResult:
    """One mode's row. Times in seconds; ``tokens_per_s`` counts generated
    tokens over ``wall_s`` (compilation excluded). ``model_s``: the model
    calls (page-state update, forward, sampling); ``floor_s``: the model's
    weight matmuls alone at the same calls' padded token counts, measured in
    the same run (``models.ragged.weight_matmuls``); ``padding``: the share of
    token rows that were padding; ``host_s``: the engine's time outside model
    calls; ``programs``: distinct step shapes; ``compiled``: XLA
    compilations during this mode, of any jitted function (the step, the
    page-state free at the end, ...), not served by the persistent cache."""

    mode: str
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    peak_concurrency: int
    mean_concurrency: float
    kv_token_fraction: float
    preemptions: int
    iterations: int
    model_calls: int
    model_s: float
    floor_s: float
    model_over_floor: float
    padding: float
    host_s: float
    compile_s: float
    programs: int
    compiled: int
    weights_dtype: str
    kv_dtype: str
    prefill_tokens: int
    page_size: int
    kv_budget_tokens: int

    def csv_row(self) -> dict:
        """The row of a results table: :data:`CSV_COLUMNS` -> value."""
        return {k: getattr(self, k) for k in CSV_COLUMNS}


def serve(
    model,
    requests: list[Request],
    *,
    mode: str,
    page_size: int = 16,
    kv_budget_tokens: int = 8192,
    max_seqs: int = 64,
    max_batched_tokens: int = 256,
    paged_model=None,
    stop_ids=(),
    progress: bool = True,
    floor: "MatmulFloor | None | bool" = None,
    prefix_caching: bool = True,
    preemption_mode: str = "recompute",
    mesh=None,
    kv_dtype=None,
    stream: bool = False,
    tokenizer=None,
    profile: ProfileSpec | None = None,
) -> tuple[ServeResult, list[RequestOutput]]:
    """Serves ``requests`` in one mode and measures it.

    Args:
      model: a ``models.llama.Llama`` (its config builds the KV pool).
      requests: engine requests.
      mode: a key of :data:`MODE_RESERVATIONS`: "paged", "contiguous"
        (reserve ``MAX_SEQ_LEN`` per request), "contiguous-pow2" or
        "contiguous-oracle".
      page_size: tokens per page (every mode allocates in pages).
      kv_budget_tokens: K/V slots in the pool, tokens; rounded down to whole
        pages; must hold at least one ``MAX_SEQ_LEN`` sequence.
      max_seqs, max_batched_tokens, paged_model, stop_ids, mesh, kv_dtype:
        as :func:`make_engine` (with ``mesh``, ``kv_budget_tokens`` is per
        data shard).
      progress: show a progress bar of finished requests.
      floor: measures the weight-matmul floor of the calls made (default a
        new :class:`MatmulFloor`); False skips it (``floor_s`` 0,
        ``model_over_floor`` NaN).
      prefix_caching: automatic prefix caching (``EngineConfig``).
      preemption_mode: "recompute" or "swap".
      stream: stream every request's deltas (:func:`run_streamed`); the
        row's mode then reads "<mode>, streamed".
      tokenizer: detokenize the outputs (:func:`make_engine`).
      profile: trace a few of the run's steps (:func:`run_timed`).

    Returns:
      ``(the mode's row, outputs sorted by request id)``.

    Raises:
      ValueError: unknown mode or a budget below one maximum-length sequence.
    """
    check_choice("mode", mode, MODE_RESERVATIONS)
    check_int("page_size", page_size, 1)
    check_int("kv_budget_tokens", kv_budget_tokens)
    if not (floor is None or floor is False or isinstance(floor, MatmulFloor)):
        raise ValueError(f"floor must be None, False or a MatmulFloor, got floor={floor!r}")
    pooled_tokens = kv_budget_tokens // page_size * page_size  # whole pages
    if pooled_tokens < MAX_SEQ_LEN:
        raise ValueError(
            f"kv_budget_tokens rounded down to whole pages must hold one maximum-length request "
            f"({MAX_SEQ_LEN} tokens), got {kv_budget_tokens=} {page_size=}"
        )
    kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype())
    engine = make_engine(model, kv_tokens=kv_budget_tokens, page_size=page_size, max_seqs=max_seqs,
                         max_batched_tokens=max_batched_tokens, paged_model=paged_model, mesh=mesh,
                         stop_ids=stop_ids, kv_dtype=kv_dtype, reservation=MODE_RESERVATIONS[mode],
                         enable_prefix_caching=prefix_caching, preemption_mode=preemption_mode, tokenizer=tokenizer)
    outputs, wall, compiles = run_timed(engine, requests, progress=progress, stream=stream, profile=profile)
    # The column reads the pool as allocated, not the flag (a pool silently built in another dtype would show).
    pool_dtype = jnp.dtype((engine.engines[0] if isinstance(engine, DataParallelEngine) else engine).kv.k.dtype)
    st = merged_stats(engine)
    floor_s = 0.0 if floor is False else (floor or MatmulFloor(model)).seconds(st)
    generated = sum(len(o.output_ids) for o in outputs)
    result = ServeResult(
        mode=f"{mode}, streamed" if stream else mode,
        requests=len(outputs),
        generated_tokens=generated,
        wall_s=round(wall, 2),
        tokens_per_s=round(generated / wall, 1),
        peak_concurrency=st.peak_concurrency,
        mean_concurrency=round(st.mean_concurrency, 2),
        kv_token_fraction=round(st.kv_token_fraction, 4),
        preemptions=st.preemptions,
        iterations=st.iterations,
        model_calls=st.model_calls,
        model_s=round(st.model_s, 2),
        floor_s=round(floor_s, 2),
        model_over_floor=round(st.model_s / floor_s, 2) if floor_s else float("nan"),
        padding=round(st.padding, 3),
        host_s=round(st.host_s, 2),
        compile_s=round(compiles.seconds, 1),
        programs=st.num_programs,
        compiled=compiles.compiled,
        weights_dtype=jnp.dtype(model.embed[...].dtype).name,
        kv_dtype=pool_dtype.name,
        prefill_tokens=st.prefill_tokens,
        page_size=page_size,
        kv_budget_tokens=pooled_tokens,
    )
    del engine
    return result, sorted(outputs, key=lambda o: o.request_id)


class MatmulFloor:
    """Seconds the model's weight matmuls alone take at a call's padded
    token count (``models.ragged.weight_matmuls``): the floor a model call
    can approach. Each (tokens, logits rows) shape is compiled once and timed
    as the fastest of ``repeats`` runs (a floor: noise only adds time);
    results are cached per shape."""

    def __init__(self, model, repeats: int = 5):
        self._fn = jax.jit(weight_matmuls, static_argnums=2)
        self._model = model
        self._repeats = repeats
        self._cache: dict[tuple[int, int], float] = {}

    def time(self, num_tokens: int, num_logits: int) -> float:
        key = (num_tokens, num_logits)
        if key not in self._cache:
            x = jnp.ones((num_tokens, self._model.config.model_dim), self._model.embed[...].dtype)
            self._fn(self._model, x, num_logits).block_until_ready()
            times = []
            for _ in range(self._repeats):
                t = time.perf_counter()
                self._fn(self._model, x, num_logits).block_until_ready()
                times.append(time.perf_counter() - t)
            self._cache[key] = min(times)
        return self._cache[key]

    def seconds(self, stats: EngineStats) -> float:
        """The floor summed over an engine's model calls (every call, counted by shape)."""
        return sum(n * self.time(shape.num_tokens, shape.num_logits) for shape, n in stats.calls_by_shape.items())


def load_model(spec: str, dtype=jnp.float32):
    """``(model, tokenizer, name)`` for ``--model``
    (:func:`models.llm.load_model`: ``"smollm2"``, a ``.gguf`` file, a
    Hugging Face folder or a random-weight preset), weights in ``dtype``."""
    return llm.load_model(spec, dtype=dtype)


SIMULATED_VOCAB_SIZE = 49_152
"""Token ids a simulated run draws its requests' ids from and the simulated
engine accepts (``SimulatedEngine(vocab_size=...)``), whatever the model's
vocabulary: the packaged requests' chat template is SmolLM2's (ids up to
34,519), and a simulated engine only compares ids (prefix-cache keys),
never looks them up. The step time counts the model's own vocabulary (its
LM head)."""


def simulated_setup(args, workload: Workload | None = None,
                    max_output_len: int = MAX_SEQ_LEN) -> tuple[RooflineStepTime, list[Request]]:
    """What a simulated-accelerator script serves, from its flags
    (``args.model``, ``device``, ``num_devices``, ``efficiency_profile``,
    ``num_requests``, ``seed``): the step time of the model on
    ``num_devices`` x the device in tensor parallelism
    (:class:`paged_jax.simulator.step_time.RooflineStepTime`), its
    efficiencies assumed or fitted to a step profile's CSV of that device
    (``python -m experiments.simulator.profile_steps``), and the first
    ``num_requests`` requests of ``workload`` (default ``basic``: the
    packaged ShareGPT requests) at their true lengths capped at
    ``max_output_len`` tokens, EOS ignored, ids drawn from
    :data:`SIMULATED_VOCAB_SIZE` ids with ``seed`` (:meth:`experiments.lib.workloads.Workload.requests`
    without a tokenizer), with the workload's sampling.

    Raises:
      ValueError: an unknown model or device, a CSV without a profile's
        columns or values or of another device, ``num_requests`` out of
        range or more than the workload has.
    """
    step_time = RooflineStepTime(model=get_model(args.model), device=get_device(args.device),
                                 num_devices=args.num_devices)
    if args.efficiency_profile is not None:
        path = args.efficiency_profile
        try:
            meta, rows = provenance.read_csv(path)
            works, seconds = profile_rows(rows)
            if not works:
                raise ValueError("no calls in it")
        except ValueError as e:  # a decoding error too
            raise ValueError(f"--efficiency-profile {path}: not a step profile's CSV "
                             f"(python -m experiments.simulator.profile_steps): {e}") from None
        kind = meta.get("device_kind")
        if device_key(kind or "") != args.device:
            raise ValueError(f"--efficiency-profile {path} was profiled on {kind!r}, not on --device "
                             f"{args.device}: a roofline's efficiencies are its own device's")
        step_time = step_time.fitted(works, seconds, source=f"fitted to {path}")
    return step_time, simulated_requests(args, workload or workloads.workload("basic"), max_output_len)


def simulated_requests(args, workload: Workload, max_output_len: int = MAX_SEQ_LEN) -> list[Request]:
    """The first ``args.num_requests`` requests of ``workload`` as
    :func:`simulated_setup` gives them (ids from :data:`SIMULATED_VOCAB_SIZE`
    with ``args.seed``, the workload's sampling), for a script that serves
    several workloads on one step time.

    Raises:
      ValueError: ``num_requests`` out of range or more than the workload has.
    """
    requests, _ = workload.requests(None, vocab_size=SIMULATED_VOCAB_SIZE, num_requests=args.num_requests,
                                    max_output_len=max_output_len, seed=args.seed)
    return workload.apply(requests)
