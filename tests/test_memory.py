"""KV-size maths, waste bounds and the capacity planner."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.memory import capacity
from paged_jax.memory import (
    GB,
    PRESETS,
    KiB,
    ModelPreset,
    contiguous_waste,
    dtype_bytes,
    get_preset,
    hybrid_capacity,
    layer_pages,
    paged_slots,
    paged_waste,
    plan_capacity,
    pow2_reservation,
    sliding_layer_count,
    token_state_share,
)


def test_70b_gqa_costs_about_300_kb_per_token():
    llama2_70b = get_preset("llama-2-70b")
    # 2 (K, V) * 80 layers * 8 KV heads * 128 head dim * 2 bytes = 327,680 B = 320 KiB.
    assert llama2_70b.kv_bytes_per_token("bfloat16") == 327_680 == 320 * KiB
    assert 300e3 <= llama2_70b.kv_bytes_per_token() <= 330e3
    assert get_preset("llama-3-70b").kv_bytes_per_token() == 320 * KiB


def test_8000_token_conversation_is_about_2_5_gb():
    # 8,000 * 327,680 B = 2.62 GB (2.44 GiB).
    nbytes = get_preset("llama-2-70b").kv_bytes(8000)
    assert nbytes == 2_621_440_000
    assert 2.4 * GB <= nbytes <= 2.7 * GB


def test_8b_gqa_costs_a_quarter_of_7b():
    # Llama-2-7B: 2 * 32 * 32 * 128 * 2 = 512 KiB; Llama-3-8B has 8 KV heads: 128 KiB.
    assert get_preset("llama-2-7b").kv_bytes_per_token() == 512 * KiB
    assert get_preset("llama-3-8b").kv_bytes_per_token() * 4 == get_preset("llama-2-7b").kv_bytes_per_token()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2),  # 128 KiB
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 56 KiB
        ("smollm2-135m", 2 * 30 * 3 * 64 * 2),  # 22.5 KiB
        ("deepseek-v3", 61 * (512 + 64) * 2),  # MLA: latent + RoPE key, 70,272 B
        ("kimi-k2", 61 * (512 + 64) * 2),
    ],
)
def test_preset_kv_bytes(name, expected):
    assert get_preset(name).kv_bytes_per_token("bfloat16") == expected


def test_dtypes_scale_kv_and_weights():
    smol = get_preset("smollm2-135m")
    assert smol.kv_bytes_per_token("float32") == 2 * smol.kv_bytes_per_token("bfloat16") == 46_080
    assert smol.kv_bytes_per_token("float8") == 11_520
    assert smol.weight_bytes("float32") == 4 * 134_515_008
    assert get_preset("llama-3-70b").weight_bytes("int4") == 70_553_706_496 // 2


def test_all_presets_valid_and_named():
    assert set(PRESETS) == {
        "llama-2-7b", "llama-3-8b", "llama-3.1-8b", "qwen3-8b", "gemma-2-9b", "gemma-3-12b", "gemma-3-27b",
        "gpt-oss-20b", "gpt-oss-120b", "llama-3.1-405b", "qwen3-235b-a22b", "llama-2-70b", "llama-3-70b",
        "mixtral-8x7b", "qwen2.5-7b", "smollm2-135m", "deepseek-v3", "kimi-k2",
    }
    assert sum(p.is_mla for p in PRESETS.values()) == 2
    # (layers, KV heads, head dim, window, sliding layers) of the published configs.
    assert {n: (p.num_layers, p.num_kv_heads, p.head_dim, p.sliding_window, p.num_sliding_layers)
            for n, p in PRESETS.items() if p.is_hybrid} == {
        "gemma-2-9b": (42, 8, 256, 4096, 21),
        "gemma-3-12b": (48, 8, 256, 1024, 40),
        "gemma-3-27b": (62, 16, 128, 1024, 52),
        "gpt-oss-20b": (24, 8, 64, 128, 12),
        "gpt-oss-120b": (36, 8, 64, 128, 18),
    }
    assert get_preset("Llama-3-70B") is PRESETS["llama-3-70b"]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_layers": 0, "num_kv_heads": 8, "head_dim": 128}, "num_layers"),
        ({"num_layers": 2, "num_kv_heads": 8}, "GQA"),
        ({"num_layers": 2, "num_kv_heads": 8, "head_dim": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "MLA"),
        ({"num_layers": 2}, "GQA"),
        ({"num_layers": 2, "num_kv_heads": -1, "head_dim": 64}, "num_kv_heads"),
    ],
)
def test_bad_preset(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ModelPreset(name="x", num_params=1, source="test", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sliding_window": 0, "num_sliding_layers": 1}, "sliding_window must be an int >= 1, got sliding_window=0"),
        ({"sliding_window": 4096.0, "num_sliding_layers": 1}, "sliding_window must be an int >= 1"),
        ({"sliding_window": True, "num_sliding_layers": 1}, "sliding_window must be an int >= 1"),
        ({"num_sliding_layers": 2}, "num_sliding_layers=2 needs a sliding_window, got sliding_window=None"),
        ({"sliding_window": 128}, r"num_sliding_layers must be an int in \[1, 5\), got num_sliding_layers=0"),
        ({"sliding_window": 128, "num_sliding_layers": 5}, r"num_sliding_layers must be an int in \[1, 5\)"),
    ],
)
def test_bad_layer_mix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelPreset(name="x", num_layers=4, num_kv_heads=1, head_dim=4, num_params=1, source="test", **kwargs)


def test_sliding_layer_count_follows_the_published_patterns():
    # Gemma 3: layer i global iff (i + 1) % 6 == 0 -> 48 layers: 8 global (5, 11, ..., 47), 40 sliding;
    # 62 layers: 10 global, 52 sliding. Alternating (Gemma 2, gpt-oss): half, the odd layer sliding.
    assert sliding_layer_count(48, 6) == 40 and sliding_layer_count(62, 6) == 52
    assert sliding_layer_count(42, 2) == 21 and sliding_layer_count(5, 2) == 3 and sliding_layer_count(5, 6) == 5
    with pytest.raises(ValueError, match="global_every must be an int >= 2, got global_every=1"):
        sliding_layer_count(48, 1)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got num_layers=0"):
        sliding_layer_count(0, 6)


# A small hybrid model: 3 layers (2 sliding with window W = 10, 1 full), 1 KV head of dim 4 in f32:
# 2 (K, V) * 1 * 4 * 4 B = 32 B per layer per slot; pages of L = 4.
SMALL_HYBRID = ModelPreset(name="small-hybrid", num_layers=3, num_kv_heads=1, head_dim=4, num_params=1,
                           source="test", sliding_window=10, num_sliding_layers=2)


def test_small_hybrid_hand_worked():
    def nbytes(n, hybrid_aware=True):
        return SMALL_HYBRID.sequence_kv_bytes(n, page_size=4, dtype="float32", hybrid_aware=hybrid_aware)

    # n = 33, window not page-aligned: positions [23, 33) lie on pages 5 (20-23) .. 8 (32-35): 4 pages,
    # ceil(10 / 4) = 3 and one more, as 23 mod 4 + 10 = 13 > 12 slots. The full layer: ceil(33 / 4) = 9.
    assert layer_pages(33, 4, 10) == 4 and layer_pages(33, 4) == 9
    # (9 + 2 * 4) pages * 4 slots * 32 B = 2,176 B; every layer full: 3 * 9 * 4 * 32 = 3,456 B.
    assert nbytes(33) == 2176 and nbytes(33, hybrid_aware=False) == 3456
    # n = 30, window aligned: [20, 30) on pages 5 .. 7: 3 pages, no extra. (8 + 2 * 3) * 4 * 32 = 1,792 B.
    assert layer_pages(30, 4, 10) == 3 and nbytes(30) == 1792
    # n = 31: [21, 31) still fits 3 pages (5 .. 7, slots 20-31): misaligned, but 21 mod 4 + 10 = 11 <= 12 slots.
    assert layer_pages(31, 4, 10) == 3
    # n = 7 < W: the sliding layers hold what the full one does, ceil(7 / 4) = 2 pages: 3 * 2 * 4 * 32 = 768 B.
    assert layer_pages(7, 4, 10) == layer_pages(7, 4) == 2 and nbytes(7) == nbytes(7, hybrid_aware=False) == 768
    assert nbytes(0) == 0
    # Page size 1 (no paging): the sliding layers hold exactly min(n, W) tokens: (33 + 2 * 10) * 32 = 1,696 B.
    assert SMALL_HYBRID.sequence_kv_bytes(33, page_size=1, dtype="float32") == 1696
    # 10,000 B of pool at n = 33: 10,000 // 2,176 = 4 sequences hybrid-aware, 10,000 // 3,456 = 2 otherwise.
    cap = hybrid_capacity(SMALL_HYBRID, context=33, kv_budget_bytes=10_000, page_size=4, dtype="float32")
    assert (cap.hybrid_bytes, cap.full_bytes, cap.hybrid_sequences, cap.full_sequences) == (2176, 3456, 4, 2)
    assert cap.ratio == pytest.approx(3456 / 2176)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 600), window=st.integers(1, 300), page_size=st.integers(1, 40))
def test_layer_pages_counts_the_pages_the_window_touches(n, window, page_size):
    touched = {p // page_size for p in range(max(0, n - window), n)}  # the rule, by enumeration
    pages = layer_pages(n, page_size, window)
    assert pages == len(touched)
    rounded = -(-min(n, window) // page_size)
    spills = n > window and (n - window) % page_size + window > page_size * -(-window // page_size)
    assert pages == rounded + spills and pages <= layer_pages(n, page_size)


def test_dense_models_gain_nothing():
    for name in ("llama-3.1-8b", "qwen3-8b", "deepseek-v3"):
        model = get_preset(name)
        for n in (1, 8192, 131_072):
            assert model.sequence_kv_bytes(n) == model.sequence_kv_bytes(n, hybrid_aware=False) \
                == paged_slots([n], 16)[0] * model.kv_bytes_per_token()


def test_gemma3_style_holds_over_4x_the_sequences_at_32k():
    """Issue 21's target. Gemma-3-12B, bf16, pages of 16, 32,768 tokens:
    full layers: 32,768 / 16 = 2,048 pages; sliding: [31,744, 32,768) = 64 pages (aligned).
    Every layer: 48 * 2,048 = 98,304 layer-pages; hybrid-aware: 8 * 2,048 + 40 * 64 = 18,944.
    A layer-page is 16 slots * 2 * 8 heads * 256 * 2 B = 131,072 B, so 12,884,901,888 B against
    2,483,027,968 B: 98,304 / 18,944 = 192 / 37 = 5.19x; 40 GB holds 3 against 16 sequences."""
    cap = hybrid_capacity(get_preset("gemma-3-12b"), context=32_768, kv_budget_bytes=40 * GB, page_size=16)
    assert (cap.full_bytes, cap.hybrid_bytes) == (98_304 * 131_072, 18_944 * 131_072)
    assert (cap.full_sequences, cap.hybrid_sequences) == (3, 16)
    assert cap.ratio == pytest.approx(192 / 37) and cap.ratio >= 4
    # The ratio is the layer pattern's alone: six layers, 5 sliding (window 1,024) to 1 global, any head shape.
    six = ModelPreset(name="g3-style", num_layers=6, num_kv_heads=1, head_dim=2, num_params=1, source="test",
                      sliding_window=1024, num_sliding_layers=sliding_layer_count(6, 6))
    assert hybrid_capacity(six, context=32_768, kv_budget_bytes=GB).ratio == pytest.approx(192 / 37)


def test_hybrid_refusals():
    with pytest.raises(ValueError, match="window must be an int >= 1, got window=0"):
        layer_pages(10, 4, 0)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got num_tokens=-1"):
        layer_pages(-1, 4, 10)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got page_size=0"):
        SMALL_HYBRID.sequence_kv_bytes(10, page_size=0)
    with pytest.raises(ValueError, match="hybrid_aware must be a bool, got hybrid_aware=1"):
        SMALL_HYBRID.sequence_kv_bytes(10, hybrid_aware=1)
    with pytest.raises(ValueError, match="context must be an int >= 1, got context=0"):
        hybrid_capacity(SMALL_HYBRID, context=0, kv_budget_bytes=GB)
    with pytest.raises(ValueError, match="kv_budget_bytes must be an int >= 1, got kv_budget_bytes=40000000000.0"):
        hybrid_capacity(SMALL_HYBRID, context=8, kv_budget_bytes=40e9)


def test_unknown_names():
    with pytest.raises(ValueError, match="model='gpt-5'"):
        get_preset("gpt-5")
    with pytest.raises(ValueError, match="dtype='float64'"):
        dtype_bytes("float64")


@settings(max_examples=200, deadline=None)
@given(
    used=st.lists(st.integers(0, 100_000), min_size=1, max_size=50),
    page_size=st.sampled_from([1, 2, 8, 16, 32, 128, 256]),
)
def test_paged_waste_below_one_page_per_request(used, page_size):
    waste = paged_waste(used, page_size)
    held = paged_slots(used, page_size)
    assert (waste >= 0).all() and (waste < page_size).all()
    assert (held % page_size == 0).all() and (held == np.asarray(used) + waste).all()


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), min_size=1, max_size=30))
def test_contiguous_waste_is_declared_minus_used(pairs):
    used = [min(a, b) for a, b in pairs]
    declared = [max(a, b) for a, b in pairs]
    assert contiguous_waste(used, declared).tolist() == [d - u for u, d in zip(used, declared)]


def test_contiguous_waste_grows_without_bound_paged_does_not():
    used = [70, 23, 150, 41]
    for declared in (256, 2048, 1 << 20):
        assert contiguous_waste(used, declared).sum() == 4 * declared - 284
        assert paged_waste(used, 16).sum() == 320 - 284


def test_waste_errors():
    with pytest.raises(ValueError, match=r"used\[1\]=9 declared\[1\]=8"):
        contiguous_waste([1, 9], [8, 8])
    with pytest.raises(ValueError, match="page_size"):
        paged_waste([1], 0)
    with pytest.raises(ValueError, match="used"):
        paged_waste([-1], 16)
    with pytest.raises(ValueError, match="used"):
        paged_waste([], 16)


def test_pow2_and_token_share():
    assert pow2_reservation([1, 2, 3, 5, 8, 9, 2048, 2049]).tolist() == [1, 2, 4, 8, 8, 16, 2048, 4096]
    assert token_state_share([10, 30], [16, 48]) == 40 / 64


def test_plan_capacity_hand_worked():
    # Llama-2-7B, bf16, one 80 GB device, cache fraction 0.9:
    #   usable   = 0.9 * 80e9                     = 72,000,000,000 B
    #   weights  = 6,738,415,616 * 2              = 13,476,831,232 B
    #   cache    = 72e9 - 13,476,831,232          = 58,523,168,768 B
    #   per token = 2 * 32 * 32 * 128 * 2         = 524,288 B; page (16) = 8,388,608 B
    #   pages    = 58,523,168,768 // 8,388,608    = 6,976  -> 111,616 tokens
    #   lengths 100, 1000 hold 112 + 1008 slots   -> mean 560 -> 111,616 / 560 = 199.3 -> 199
    #   contiguous: 58,523,168,768 // (2048 * 524,288) = 54
    plan = plan_capacity(
        get_preset("llama-2-7b"), device_memory_bytes=80 * GB, cache_fraction=0.9, page_size=16,
        lengths=[100, 1000], max_seq_len=2048,
    )
    assert plan.cache_bytes == 58_523_168_768
    assert plan.num_pages == 6976 and plan.pool_tokens == 111_616
    assert plan.paged_concurrency == 199 and plan.contiguous_concurrency == 54
    assert plan.paged_token_share == pytest.approx(1100 / 1120)
    assert plan.contiguous_token_share == pytest.approx(550 / 2048)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"device_memory_bytes": 80 * GB}, "weights"),  # 141 GB of weights on one 80 GB device
        ({"device_memory_bytes": 80 * GB, "num_devices": 0}, "num_devices"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "cache_fraction": 0.0}, "cache_fraction"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "cache_fraction": 1.5}, "cache_fraction"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "page_size": 0}, "page_size"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "lengths": []}, "lengths"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "lengths": [4096]}, "max_seq_len"),
        ({"device_memory_bytes": 80 * GB, "num_devices": 8, "kv_dtype": "fp7"}, "dtype"),
    ],
)
def test_plan_capacity_bad_inputs(kwargs, name):
    kwargs = {"lengths": [512], **kwargs}
    with pytest.raises(ValueError, match=name):
        plan_capacity(get_preset("llama-3-70b"), **kwargs)


def test_capacity_cli_fixed_length(capsys):
    plan = capacity.main(
        ["--model", "llama-3-70b", "--device-memory-gb", "80", "--num-devices", "8",
         "--cache-fraction", "0.9", "--fixed-length", "512"]
    )
    # 0.9 * 640e9 - 141,107,412,992 = 434,892,587,008 B of KV; 16 * 327,680 B a page.
    assert plan.num_pages == 434_892_587_008 // (16 * 327_680)
    assert plan.paged_concurrency == plan.pool_tokens // 512
    assert plan.contiguous_concurrency == 434_892_587_008 // (2048 * 327_680)
    assert "pages in the pool" in capsys.readouterr().out
