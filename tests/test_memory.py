"""KV-size maths, waste bounds and the capacity planner."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import capacity
from paged_jax.memory import (
    GB,
    KiB,
    PRESETS,
    ModelPreset,
    contiguous_waste,
    dtype_bytes,
    get_preset,
    paged_slots,
    paged_waste,
    plan_capacity,
    pow2_reservation,
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
        "llama-2-7b", "llama-3-8b", "llama-2-70b", "llama-3-70b", "mixtral-8x7b",
        "qwen2.5-7b", "smollm2-135m", "deepseek-v3", "kimi-k2",
    }
    assert sum(p.is_mla for p in PRESETS.values()) == 2
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
