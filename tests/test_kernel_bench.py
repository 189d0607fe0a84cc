"""experiments.kernels.kernel_bench: every implementation it times computes
attention (against a float64 per-sequence loop), the tables it writes, its
summary against issue 11's targets, its presets and its argument checks
(tiny sizes, timing loops of one call)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.kernels import device_summary, kernel_bench
from experiments.lib import provenance
from paged_jax import memory
from pallas_kernels import paged_attention_gpu, ragged_paged_attention

ONE_CALL = 1e-6
"""--min-seconds that makes every timed loop one call: the numbers mean nothing, the test is quick."""


def test_main_writes_one_row_per_impl_per_case(tmp_path):
    out = tmp_path / "kb"
    kernel_bench.main(["--batches", "2", "--contexts", "64", "--ragged-batches", "4", "--heads", "smollm2",
                       "--heads", "llama-3-8b", "--layers", "3", "--peak-copy-gb", "0.01",
                       "--min-seconds", str(ONE_CALL), "--out", str(out)])
    record, rows = provenance.read_csv(out.with_suffix(".csv"))
    assert record["seeds"] == f"data={kernel_bench.SEED}"
    assert list(rows[0]) == kernel_bench.CSV_COLUMNS
    impls = ["dense", *kernel_bench.native_impls()]
    # 2 presets x (1 uniform + 1 ragged case), each case: dense and every paged implementation once.
    cases = {}
    for r in rows:
        cases.setdefault((r["heads"], r["workload"], r["batch"]), []).append(r["impl"])
    assert sorted(cases) == [("llama-3-8b", "sharegpt", "4"), ("llama-3-8b", "uniform", "2"),
                             ("smollm2", "sharegpt", "4"), ("smollm2", "uniform", "2")]
    assert all(found == impls for found in cases.values())
    for r in rows:
        for column in ("kv_gb", "ms", "ratio", "gbs", "pct_peak", "pct_copy", "copy_read_gbs", "peak_read_gbs"):
            assert math.isfinite(float(r[column])) and float(r[column]) > 0, (column, r)
        assert float(r["pct_peak"]) == pytest.approx(100 * float(r["gbs"]) / float(r["peak_read_gbs"]), rel=1e-4)
    assert len({r["peak_read_gbs"] for r in rows}) == 1  # measured once per run
    # KV needed: 2 sequences * 64 tokens * K * H * 4 bytes (f32) * 2 (K and V).
    uniform_gb = {r["heads"]: float(r["kv_gb"]) for r in rows if r["workload"] == "uniform"}
    assert uniform_gb == {"smollm2": pytest.approx(2 * 64 * 3 * 64 * 4 * 2 / 1e9, rel=1e-5),  # 6 digits in the CSV
                          "llama-3-8b": pytest.approx(2 * 64 * 8 * 128 * 4 * 2 / 1e9, rel=1e-5)}

    text = out.with_suffix(".md").read_text()
    for words in ("| heads |", "| KV GB |", "| % peak |", "| % copy |", "launch-bound", "stacked pool of 3 layers",
                  "## Summary", "- smollm2 sharegpt (1 case", "CPU: xla_loop <= 0.55x dense", provenance.MARKER):
        assert words in text, words
    assert text.count("| llama-3-8b |") == text.count("| smollm2 |") == 2 * len(impls)


def reference_decode(q, k_pages, v_pages, block_tables, kv_lens, layer):
    """Decode attention as a float64 loop over the sequences, reading each
    one's own pages and tokens only: the truth the benchmarked calls are held to.
    q: [B, N, H]; pages [K, P, L, H] (or [layers, K, P, L, H] read at ``layer``);
    block_tables: i32[B, pages_per_seq]; kv_lens: i32[B]. Returns f64[B, N, H]."""
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    if layer is not None:
        k_pages, v_pages = k_pages[int(layer)], v_pages[int(layer)]
    q = np.asarray(q, np.float64)
    num_kv, _, page_size, head_dim = k_pages.shape
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(kv_lens)):
        pages = np.asarray(block_tables)[b, : -(-n // page_size)]
        k = k_pages[:, pages].reshape(num_kv, -1, head_dim)[:, :n]  # [K, S, H]
        v = v_pages[:, pages].reshape(num_kv, -1, head_dim)[:, :n]
        logits = np.einsum("KGH,KSH->KGS", q[b].reshape(num_kv, -1, head_dim), k) / math.sqrt(head_dim)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[b] = np.einsum("KGS,KSH->KGH", probs, v).reshape(-1, head_dim)
    return out


def poisoned(pages, block_tables, kv_lens, layer):
    """``pages`` with NaN in every slot no sequence owns at the layer read:
    the null page and each sequence's last page past its length."""
    pages = np.array(pages)
    view = pages if layer is None else pages[int(layer)]  # [K, P, L, H], a view: writes reach ``pages``
    page_size = view.shape[2]
    view[:, 0] = np.nan
    for b, n in enumerate(np.asarray(kv_lens)):
        if n % page_size:
            view[:, np.asarray(block_tables)[b, n // page_size], n % page_size:] = np.nan
    return jnp.asarray(pages)


@pytest.mark.parametrize("layers", [1, 3])
def test_every_benchmarked_implementation_computes_attention(layers):
    """Dense attention and every paged implementation the benchmark times
    (the GPU kernels interpreted on CPU) equal a per-sequence float64 loop,
    at ragged lengths around the page size, with NaN in every slot no
    sequence owns (and in every other layer of the stacked pool)."""
    cfg = dataclasses.replace(kernel_bench.HEAD_PRESETS["smollm2"], layers=layers)
    ps = cfg.page_size
    lengths = np.array([1, ps - 1, ps, ps + 1, 3 * ps + 5], np.int32)
    case = kernel_bench.make_case(cfg, lengths, jnp.float32, np.random.default_rng(0))
    want = reference_decode(case.q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens, case.layer)
    assert np.isfinite(want).all()
    dense = kernel_bench.dense_attention(case.q, case.k_dense, case.v_dense, case.kv_lens)
    np.testing.assert_allclose(np.asarray(dense), want, atol=1e-5, rtol=1e-5)
    nan_case = dataclasses.replace(
        case, k_pages=poisoned(case.k_pages, case.block_tables, case.kv_lens, case.layer),
        v_pages=poisoned(case.v_pages, case.block_tables, case.kv_lens, case.layer))
    for impl in dict.fromkeys([*kernel_bench.native_impls(), "pallas_gpu", "pallas_ragged"]):
        got = kernel_bench.paged_decode(impl)(*nan_case.paged_args)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=impl)


def test_a_wrong_implementation_gives_no_row(monkeypatch):
    """The benchmark checks each implementation against dense attention
    before timing it: a fast wrong kernel is an error, not a row."""
    monkeypatch.setattr(kernel_bench, "paged_decode", lambda impl: jax.jit(lambda q, *args: q * 0))
    with pytest.raises(AssertionError, match="xla differs from dense attention"):
        kernel_bench.run_case(kernel_bench.HEAD_PRESETS["smollm2"], np.array([5, 33], np.int32), jnp.float32,
                              ["xla"], np.random.default_rng(0), "sharegpt", peak_read_gbs=1.0,
                              min_seconds=ONE_CALL)


def test_gpu_rows_through_the_stacked_pool():
    """The rows a GPU writes (pallas_gpu and pallas_ragged, interpreted on
    CPU) through a stacked pool whose other layers are NaN: one row each,
    after dense's (their values: the test above)."""
    cfg = dataclasses.replace(kernel_bench.HEAD_PRESETS["smollm2"], layers=3)
    rows = kernel_bench.run_case(cfg, np.array([5, 33], np.int32), jnp.float32, ["pallas_gpu", "pallas_ragged"],
                                 np.random.default_rng(0), "sharegpt", peak_read_gbs=1.0, min_seconds=ONE_CALL)
    assert [r["impl"] for r in rows] == ["dense", "pallas_gpu", "pallas_ragged"]


@pytest.mark.parametrize("name", list(kernel_bench.HEAD_PRESETS))
def test_gpu_kernels_lower_to_triton_at_preset_heads(name):
    """Each preset's heads (Qwen2.5-7B's 7 queries per KV head among them)
    pass Pallas' Triton lowering with the block sizes
    ``attention.paged_attention`` picks for page 16."""
    cfg = kernel_bench.HEAD_PRESETS[name]
    pool = jnp.zeros((3, cfg.num_kv_heads, 8, cfg.page_size, cfg.head_dim), jnp.bfloat16)
    tables, kv_lens = jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 20, jnp.int32)
    ppcb = 64 // cfg.page_size

    def lowered(fn, q):
        return jax.jit(fn).trace(jnp.int32(1), q).lower(lowering_platforms=("cuda",)).as_text()

    decode = lowered(lambda layer, q: paged_attention_gpu.paged_attention_gpu(
        q, pool, pool, tables, kv_lens, None, None, layer=layer, interpret=False,
        block_sizes=paged_attention_gpu.GPUBlockSizes(pages_per_compute_block=ppcb)),
        jnp.zeros((2, cfg.num_q_heads, cfg.head_dim), jnp.bfloat16))
    ragged = lowered(lambda layer, q: ragged_paged_attention.ragged_paged_attention(
        q, pool, pool, tables, kv_lens, jnp.ones((2,), jnp.int32), None, None, layer=layer, interpret=False,
        block_sizes=ragged_paged_attention.RaggedBlockSizes(pages_per_compute_block=ppcb)),
        jnp.zeros((2, 1, cfg.num_q_heads, cfg.head_dim), jnp.bfloat16))
    assert "xla.gpu.triton" in decode and "xla.gpu.triton" in ragged


def test_presets_are_the_models_heads():
    assert {n: (c.num_q_heads, c.num_kv_heads, c.head_dim) for n, c in kernel_bench.HEAD_PRESETS.items()} == {
        "smollm2": (9, 3, 64), "smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
    for name, model in (("smollm2", "smollm2-135m"), ("llama-3-8b", "llama-3-8b"), ("qwen2.5-7b", "qwen2.5-7b")):
        cfg, preset = kernel_bench.HEAD_PRESETS[name], memory.get_preset(model)
        assert (cfg.num_kv_heads, cfg.head_dim) == (preset.num_kv_heads, preset.head_dim)
    # --sizes large: the smallest large case moves >= 1 GB at llama-3-8b heads in bf16 (64 * 4096 * 8 * 128 * 2 * 2).
    llama = kernel_bench.HEAD_PRESETS["llama-3-8b"]
    assert 64 * max(kernel_bench.LARGE_CONTEXTS) * llama.num_kv_heads * llama.head_dim * 2 * 2 >= 1e9


def _row(impl, ratio, pct_peak, *, heads="llama-3-8b", workload="uniform", batch=64, max_len=2048,
         dtype="bfloat16"):
    return dict(heads=heads, workload=workload, batch=batch, mean_len=float(max_len), max_len=max_len, dtype=dtype,
                kv_dtype=dtype, impl=impl, ratio=ratio, pct_peak=pct_peak)


def test_summary_judges_the_targets():
    # % peak = dense's % peak / x dense within a case. pallas_ragged ran in one case only: the
    # best-per-workload line ranks only the implementations that ran every case.
    gpu = [_row("dense", 1.0, 84.0), _row("pallas_gpu", 0.95, 88.4), _row("pallas_ragged", 1.1, 76.4),
           _row("dense", 1.0, 90.0, batch=128), _row("pallas_gpu", 1.2, 75.0, batch=128),
           _row("dense", 1.0, 70.0, batch=32),  # B < 64: outside the target
           _row("pallas_gpu", 3.0, 23.3, batch=32)]
    lines = kernel_bench.summary_lines(gpu, "gpu")
    decode = next(line for line in lines if line.startswith("- GPU decode kernel"))
    assert "**not met (1 of 2 cases)**" in decode
    assert "B=64 len=2048 pallas_gpu 0.95x dense 88.4 % of peak" in decode and "B=32" not in decode
    assert "- llama-3-8b uniform (3 cases): pallas_gpu" in "\n".join(lines)
    assert any(line.startswith("- ShareGPT-like ragged batches of 128") and "not measured" in line for line in lines)
    assert any(line.startswith("- CPU: xla_loop") and "not applicable on gpu" in line for line in lines)

    cpu = [_row("dense", 1.0, 10.0, workload="sharegpt", batch=b, heads="smollm2") for b in (32, 128)]
    cpu += [_row("xla_loop", 0.5, 20.0, workload="sharegpt", batch=32, heads="smollm2"),
            _row("xla_loop", 0.2, 50.0, workload="sharegpt", batch=128, heads="smollm2")]
    lines = kernel_bench.summary_lines(cpu, "cpu")
    assert any(line.startswith("- CPU: xla_loop") and "**met**" in line for line in lines)
    assert any(line.startswith("- ShareGPT-like ragged batches of 128") and "**met**" in line for line in lines)


@pytest.mark.parametrize("argv, flag", [
    (["--heads", "gpt-5"], "--heads"),
    (["--batches", "0"], "--batches"),
    (["--ragged-batches", "-3"], "--ragged-batches"),
    (["--contexts", "long"], "--contexts"),
    (["--peak-copy-gb", "-1"], "--peak-copy-gb"),
    (["--peak-copy-gb", "nan"], "--peak-copy-gb"),
    (["--layers", "0"], "--layers"),
    (["--min-seconds", "0"], "--min-seconds"),
    (["--sizes", "huge"], "--sizes"),
    (["--dtype", "int8"], "--dtype"),
])
def test_bad_arguments_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bad_preset_stops_main_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        kernel_bench.main(["--heads", "no-such-model", "--out", str(tmp_path / "kb")])
    assert not list(tmp_path.iterdir())


def test_device_summary_reads_back_what_the_check_wrote(tmp_path, capsys):
    record = provenance.collect("test", [], seeds={})
    provenance.write_markdown(tmp_path / "kernel_bench.md", "# t\n\n## Summary\n\n- smollm2 uniform: 1.0x dense\n",
                              record)
    serve = tmp_path / "serve_smollm2-135m"
    serve.mkdir()
    cols = ["mode", "tokens_per_s", "wall_s", "compile_s", "programs", "model_over_floor", "host_s", "kv_dtype"]
    rows = [dict(zip(cols, (m, t, 1.0, 2.0, 3, 1.5, 0.1, "bfloat16"))) for m, t in (("paged", 300.0), ("contiguous", 100.0))]
    provenance.write_csv(serve / "serve_sharegpt.csv", rows, cols, record)
    assert device_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernel_bench: - smollm2 uniform: 1.0x dense" in out and "(3.00x)" in out
    assert "simulator_validation" not in out  # a check that wrote none
    provenance.write_markdown(tmp_path / "simulator_validation.md", "# v\n\n**Worst MAPE below the knee: 7.5%** "
                              "(target 10%, Vidur's bar: met). The last column is noise.\n", record)
    assert device_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "simulator_validation: **Worst MAPE below the knee: 7.5%** (target 10%, Vidur's bar: met)." in out
    assert "noise" not in out
    provenance.write_csv(serve / "serve_sharegpt.csv", rows[:1], cols, record)
    assert device_summary.main([str(tmp_path)]) == 1
    assert "unreadable" in capsys.readouterr().out
    assert device_summary.main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("kv_dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_quantized_pages_rows(kv_dtype):
    """--kv-dtype: pages of 1 byte per value with f32 scales in a stacked
    pool (NaN scales in the other layers), each implementation checked
    against dense attention over the values the pages stand for; ``KV GB``
    counts the bytes each row reads, scales included (dense: its f32
    values)."""
    cfg = dataclasses.replace(kernel_bench.HEAD_PRESETS["smollm2"], layers=3)
    lengths = np.array([5, 33], np.int32)
    rows = kernel_bench.run_case(cfg, lengths, jnp.float32, ["xla", "pallas_gpu", "flat_gpu"],
                                 np.random.default_rng(0), "sharegpt", peak_read_gbs=1.0, min_seconds=ONE_CALL,
                                 kv_dtype=jnp.dtype(kv_dtype))
    assert [(r["impl"], r["dtype"], r["kv_dtype"]) for r in rows] == [("dense", "float32", "float32")] + [
        (impl, "float32", kv_dtype) for impl in ("xla", "pallas_gpu", "flat_gpu")]
    # 38 tokens x 3 KV heads x (64 bytes + a 4-byte scale) x 2 (K and V); dense reads the f32 values
    assert [r["kv_gb"] for r in rows] == [pytest.approx(38 * 3 * 64 * 4 * 2 / 1e9)] + [
        pytest.approx(38 * 3 * (64 + 4) * 2 / 1e9)] * 3
    assert rows[0]["gbs"] == pytest.approx(rows[0]["kv_gb"] / rows[0]["ms"] * 1e3)
    case = kernel_bench.make_case(cfg, lengths, jnp.float32, np.random.default_rng(0), jnp.dtype(kv_dtype))
    assert case.k_pages.dtype == jnp.dtype(kv_dtype) and case.k_scales.shape == case.k_pages.shape[:-1]
    assert np.isnan(np.asarray(case.k_scales[0])).all()  # a kernel reading the wrong layer gets NaN


def test_kv_dtype_flag_takes_the_fp8_alias_and_refuses_float_pages(capsys):
    assert kernel_bench.parse_args(["--kv-dtype", "fp8"]).kv_dtype == "float8_e4m3fn"
    with pytest.raises(SystemExit):
        kernel_bench.parse_args(["--kv-dtype", "bfloat16"])
    assert "--kv-dtype: invalid choice: 'bfloat16'" in capsys.readouterr().err
