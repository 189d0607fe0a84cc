"""The kernels the real compilers accept: every Pallas kernel compiled for
TPU v5e / v6e (libtpu) and sm80 / sm90 (Triton to PTX) with no device, each
within its chip's on-chip memory (``experiments.lib.aot``), and the pieces that
choose tilings and refuse what a chip cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments.kernels import compile_kernels
from experiments.lib import aot, aot_step
from models.presets import PRESETS
from pallas_kernels import chips, paged_attention_tpu, tuning


def test_the_compiled_heads_are_the_presets():
    from models.deepseek.presets import PRESETS as MLA_PRESETS

    for name, (n, k, h) in aot.HEADS.items():
        c = PRESETS[name]
        assert (c.num_q_heads, c.num_kv_heads, c.head_dim) == (n, k, h), name
    for name, (n, c_dim, r) in aot.LATENT.items():
        c = MLA_PRESETS[name]
        assert (c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim) == (n, c_dim, r), name


def quick_matrix() -> list:
    """The default matrix's cases that decide what the rest do (32 of 124):
    every kernel on every chip at Llama-3-8B's heads (bf16, pages of 64),
    the most on-chip memory (Gemma's head dim 256 in f32 pages of 256),
    fp8 where the chip decides (refused on sm80, taken on sm90), and the
    flat kernels' latent mode at DeepSeek-V3's MLA in bf16."""
    return [c for c in aot.matrix() if (c.model == "llama-3-8b" and c.page_size == 64
                                        and c.kv_dtype in ("bfloat16", "float8_e4m3fn"))
            or (c.model == "gemma-3-12b" and c.page_size == 256)
            or (c.model in aot.LATENT and c.kv_dtype == "bfloat16")]


@pytest.mark.parametrize("cases", [
    pytest.param(quick_matrix, id="quick"),
    # 5 min on 2 cores: the quick cases by default, the whole matrix with -m slow and `make compile-kernels`.
    pytest.param(aot.matrix, id="matrix", marks=pytest.mark.slow)])
def test_every_kernel_compiles_for_every_chip_within_its_memory(cases):
    """The default matrix (124 cases: every kernel on v5e, v6e, sm80, sm90;
    every preset's heads, both page sizes, every pool dtype; the flat
    kernels' latent mode at DeepSeek-V3's MLA), or its quick part. Before this
    round's fixes none of the TPU cases compiled (a (1, keys) -> (keys, 1)
    mask reshape; the flat kernel's one-token DMA into a tiled page) and 15
    GPU cases were over their shared memory; fp8 on sm80 aborted Triton. The
    full product: ``python -m experiments.kernels.compile_kernels --full``."""
    results = aot.run_cases(cases(), jobs=2, timeout=900)
    bad = [f"{r.case.name}: {r.status} {r.on_chip_bytes}/{r.limit_bytes} {r.message[:200]}" for r in results
           if r.status not in ("ok", "refused")]
    assert not bad, "\n".join(bad)
    refused = [r for r in results if r.status == "refused"]
    # Refused exactly where the chip cannot: float8 pools on sm80, by name.
    assert refused and all(r.case.chip == "sm80" and r.case.kv_dtype.startswith("float8") for r in refused)
    assert all("float8" in r.message and "8.9" in r.message for r in refused)
    fp8_sm90 = [r for r in results if r.case.chip == "sm90" and r.case.kv_dtype.startswith("float8")]
    assert fp8_sm90 and all(r.status == "ok" for r in fp8_sm90)
    assert all(0 < r.on_chip_bytes <= r.limit_bytes for r in results if r.status == "ok")


def test_the_engine_step_at_llama_3_8b_compiles_for_v5e_and_fits_its_memory():
    """The engine's whole jitted step (page state, forward, sampling) with
    the real flat kernel, not its interpreter: before, tracing for a TPU
    from a CPU host interpreted the kernels (interpret mode follows the
    default backend), and the program held a copy of the pool in
    temporaries. The kernel writes the donated pool in place: temporaries
    are a few MB against a pool of hundreds."""
    result = aot_step.run_step(aot_step.StepCase(chip="v5e"), timeout=900)
    assert result.status == "ok", result.message
    assert result.kernels >= 2  # the flat kernel's decode and prefill programs
    assert result.weight_bytes == PRESETS["llama-3-8b"].num_params * 2
    assert result.peak_bytes <= chips.CHIPS["v5e"].usable_hbm_bytes == result.hbm_bytes
    assert result.alias_bytes >= result.pool_bytes > 0 and result.temp_bytes < result.pool_bytes / 10
    assert result.flops > 0 and result.bytes_accessed > 0  # XLA's estimate: the layer scan's body counted once


def test_the_engine_step_lowers_for_sm90_and_its_kernels_compile():
    result = aot_step.run_step(aot_step.StepCase(chip="sm90"), timeout=600)
    assert result.status == "ok" and result.kernels >= 2, result.message


def test_kernels_traced_for_a_chip_are_compiled_not_interpreted():
    from pallas_kernels.common import interpret_default

    assert interpret_default(None, "tpu") and interpret_default(None, "gpu")  # the CPU: interpreted
    with chips.target("v5e"):
        assert not interpret_default(None, "tpu") and interpret_default(None, "gpu")
        assert interpret_default(True, "tpu")  # asked for
    with chips.target("sm90"):
        assert interpret_default(None, "tpu") and not interpret_default(None, "gpu")


def test_the_worker_records_an_abort_and_goes_on(tmp_path):
    """A worker that dies (libtpu aborts the process) has its case recorded
    as aborted; the cases after it run in a fresh worker."""
    fake = tmp_path / "python"
    # Skips the first case it reads, answers "ok" for the others, then dies (as if on the first).
    fake.write_text("#!/bin/sh\nread first\nwhile read line; do echo \"$line\" | sed 's/}$/, \"status\": \"ok\", "
                    "\"seconds\": 0, \"on_chip_bytes\": 1, \"limit_bytes\": 2, \"message\": \"\"}/'; done\n"
                    "echo 'F1204 layout.h:268] Check failed: rem == 0' >&2\nkill -6 $$\n")
    fake.chmod(0o755)
    cases = aot.matrix()[:3]
    results = aot.run_cases(cases, jobs=1, python=fake, timeout=60)
    assert results[0].status == "aborted" and "Check failed" in results[0].message
    assert [r.status for r in results] == ["aborted", "ok", "ok"]


def test_a_case_compiles_the_same_whichever_case_its_worker_compiled_before():
    """The tiling is chosen while a kernel is traced, for the chip ``chips.target`` names; the chip is part of
    ``jax.jit``'s cache key, so a worker that compiled the flat kernel for sm90 first traces it again for
    sm80 (it reused sm90's tiling, 217,088 B, over sm80's 166,912 B) and the other way round."""
    sm80, sm90 = (aot.Case(kernel="flat_ragged_gpu", model="gemma-3-12b", page_size=64, kv_dtype="float32",
                           chip=chip) for chip in ("sm80", "sm90"))
    alone = {r.case.chip: r for r in [*aot.run_cases([sm80], jobs=1), *aot.run_cases([sm90], jobs=1)]}
    for order in ([sm90, sm80], [sm80, sm90]):
        for r in aot.run_cases(order, jobs=1):
            assert r.status == "ok", r.message
            assert r.on_chip_bytes == alone[r.case.chip].on_chip_bytes <= r.limit_bytes, (order, r)


def test_run_cases_without_the_compilers_says_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="make setup"):
        aot.run_cases(aot.matrix()[:1], python=tmp_path / "nope")


def test_gpu_smem_model_on_hand_worked_shapes():
    """f32 pool, Llama-3-8B decode (rows 16, keys 64, H 128), 2 stages:
    4*128*(64+16) + 4*16*64 + 1*2*64*128*4 = 40,960 + 4,096 + 65,536 =
    110,592 bytes, Triton's own count for that kernel on sm90."""
    assert tuning.gpu_smem_bytes(rows=16, keys=64, head_dim=128, itemsize=4, num_stages=2) == 110_592
    # Gemma-3-12B ragged (rows 32, H 256), 1 stage: 4*256*96 + 4*32*64 = 106,496 (Triton's count too).
    assert tuning.gpu_smem_bytes(rows=32, keys=64, head_dim=256, itemsize=4, num_stages=1) == 106_496


def test_fit_gpu_tiling_steps_down_stages_then_keys_then_rows():
    want = tuning.GPUTiling(block_q=16, pages_per_compute_block=4, num_stages=2)
    g = lambda bq: max(2, -(-16 // bq))  # noqa: E731  (Gemma's group of 2, padded to 16 rows)
    fits = tuning.fit_gpu_tiling(want, group_pad_for=g, page_size=16, head_dim=128, itemsize=2,
                                 chip=chips.CHIPS["sm90"])
    assert fits is want  # 32 rows, 64 keys, 2 stages: 57,344 bytes
    sm80 = tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=16, pages_per_compute_block=2, num_stages=2),
                                 group_pad_for=g, page_size=128, head_dim=256, itemsize=4, chip=chips.CHIPS["sm80"])
    # 256 keys: over at 2 stages and 1; 128 keys (one page) at 32 rows: 4*256*160 + 4*32*128 = 180,224 > 166,912;
    # half a page, 64 keys: 4*256*96 + 4*32*64 = 106,496 fits.
    assert sm80 == tuning.GPUTiling(block_q=16, pages_per_compute_block=1, num_stages=1, page_splits=2)
    # A page of 256 tokens at head dim 256 (the default test's fp8 case): 294,912 bytes whole on sm90; halved, 155,648.
    sm90 = tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=1),
                                 group_pad_for=lambda bq: 16, page_size=256, head_dim=256, itemsize=1,
                                 chip=chips.CHIPS["sm90"])
    assert sm90.page_splits == 2
    # Rows step down only once keys are at 16 (no page split below that).
    rows = tuning.fit_gpu_tiling(want, group_pad_for=g, page_size=16, head_dim=1024, itemsize=4,
                                 chip=chips.CHIPS["sm80"])
    assert rows == tuning.GPUTiling(block_q=8, pages_per_compute_block=1, num_stages=1)  # 4*1024*32 + 4*16*16
    # DeepSeek-V3's absorbed MLA: 128 heads on one latent of 576 are over sm90 at one token and 16 keys
    # (4*576*144 + 4*128*16 = 339,968); the query group is split last, the fewest times (each split reads the
    # pages again): 64 heads a program, 16 keys (a quarter page), 1 stage: 4*576*80 + 4*64*16 = 188,416.
    mla = tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=2),
                                group_pad_for=lambda bq: 128, page_size=64, head_dim=576, itemsize=2,
                                chip=chips.CHIPS["sm90"])
    assert mla == tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=1, page_splits=4, group_splits=2)
    with pytest.raises(ValueError, match="no GPU tiling fits .* page_size=512, head_dim=2048"):
        tuning.fit_gpu_tiling(want, group_pad_for=g, page_size=512, head_dim=2048, itemsize=4,
                              chip=chips.CHIPS["sm80"])


def test_fp8_is_refused_by_name_below_sm89_and_taken_above():
    with pytest.raises(ValueError, match=r"A100 \(sm80\).*float8_e4m3fn pool needs compute capability >= 8.9"):
        tuning.check_gpu_dtype(jnp.float8_e4m3fn, chips.CHIPS["sm80"])
    tuning.check_gpu_dtype(jnp.float8_e4m3fn, chips.CHIPS["sm90"])
    tuning.check_gpu_dtype(jnp.int8, chips.CHIPS["sm80"])


def test_chips_by_name_target_and_device():
    with pytest.raises(ValueError, match=r"chip must be one of .*'v5e'.* got chip='v9z'"):
        chips.get("v9z")
    assert chips.current() is None  # the CPU
    with chips.target("sm80") as chip:
        assert chips.current() is chip is chips.CHIPS["sm80"]
    assert chips.current() is None
    with pytest.raises(ValueError, match="a GPU has a compute capability"):
        chips.Chip(name="x", platform="cuda", description="x", hbm_bytes=1)


def test_an_unlisted_gpu_is_tuned_as_cautiously_as_its_generation_not_as_an_h100():
    class Device:  # an A10 (compute capability 8.6: 99 KiB of shared memory a block, no float8)
        platform, compute_capability = "gpu", "8.6"

    chip = chips.from_device(Device())
    assert chip.smem_per_block == 99 * 1024 and not chip.fp8 and chip.name == "sm86"
    with chips.target(chip):
        with pytest.raises(ValueError, match="has no float8"):
            tuning.check_gpu_dtype("float8_e4m3fn")
        fitted = tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=16, pages_per_compute_block=4, num_stages=2),
                                       group_pad_for=lambda bq: 8, page_size=64, head_dim=256, itemsize=4)
    assert tuning.gpu_smem_bytes(rows=fitted.block_q * 8, keys=fitted.pages_per_compute_block * 64
                                 // fitted.page_splits, head_dim=256, itemsize=4,
                                 num_stages=fitted.num_stages) <= chip.smem_per_block
    assert chips.generic_gpu("8.9").fp8
    with pytest.raises(ValueError, match="compute_capability must be"):
        chips.generic_gpu("ampere")


@pytest.mark.parametrize("call, words", [
    (lambda: chips.target(123).__enter__(), "chip must be a pallas_kernels.chips.Chip"),
    (lambda: tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=1),
                                   group_pad_for=lambda bq: 16, page_size=16, head_dim=64, itemsize=2,
                                   chip=chips.CHIPS["v5e"]), "chip must be a GPU"),
    (lambda: tuning.fit_gpu_tiling(tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=1),
                                   group_pad_for=lambda bq: 16, page_size=0, head_dim=64, itemsize=2), "page_size"),
    (lambda: tuning.GPUTiling(block_q=1, pages_per_compute_block=1, num_stages=1, page_splits=0), "page_splits"),
    (lambda: tuning.check_gpu_dtype("float8_e4m3fn", "sm80"), "chip must be a pallas_kernels.chips.Chip"),
    (lambda: aot.Case(kernel="flat_ragged_gpu", model="llama-3-8b", page_size=0, kv_dtype="float32", chip="sm90"),
     "page_size must be a power of two"),
    (lambda: aot.Case(kernel="flat_ragged_gpu", model="llama-3-8b", page_size=16, kv_dtype="float13", chip="sm90"),
     "kv_dtype must be one of"),
    (lambda: aot.matrix(chips="sm90"), "chips must be a tuple"),
    (lambda: aot.run_cases(aot.matrix()[:1], jobs=0), "jobs must be an int >= 1"),
    (lambda: aot_step.StepCase(chip="v7"), "chip must be one of"),
    (lambda: aot_step.StepCase(decodes=-1), "decodes must be an int >= 0"),
    (lambda: aot_step.StepCase(headroom_bytes=-(100 << 30)), "headroom_bytes"),
    (lambda: aot_step.StepCase(decodes=64), "must fit max_seqs"),
])
def test_bad_arguments_are_refused_by_name(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_compile_kernels_checks_its_output_folder_before_compiling(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        compile_kernels.parse_args(["--out", str(tmp_path / "file")])
    assert "--out" in capsys.readouterr().err


def test_vmem_is_counted_from_the_pallas_call():
    """The TPU decode kernel at Llama-3-8B heads, bf16 pages of 16, 4 pages a
    block: q and out blocks f32 [4, 128] (G=4 with a unit sublane dim),
    padded to [8, 128], double-buffered: 2 * 2 * 4 KiB = 16 KiB; K and V
    scratch bf16 [2, 4, 16, 128]: 2 * 32 KiB = 64 KiB; 80 KiB in all."""
    s = jax.ShapeDtypeStruct
    args = (s((8, 32, 128), jnp.bfloat16), s((8, 64, 16, 128), jnp.bfloat16), s((8, 64, 16, 128), jnp.bfloat16),
            s((8, 16), jnp.int32), s((8,), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda q, k, v, t, n: paged_attention_tpu.unchecked_paged_attention_tpu(
        q, k, v, t, n, interpret=False))(*args)
    assert aot.vmem_bytes(jaxpr) == 81_920
