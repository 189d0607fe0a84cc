"""Devices and model shapes for a roofline step time
(:class:`paged_jax.simulator.step_time.RooflineStepTime`).

Device figures are the vendors' dense peaks (no structured sparsity) per
dtype and HBM bandwidth and capacity, each with its source. Model shapes
are the published configs' few numbers that set a step's FLOPs and bytes.
"""

from __future__ import annotations

import dataclasses

from paged_jax.checks import check_choice, check_float, check_instance, check_int
from paged_jax.memory import dtype_bytes

TERA, GIGA = 10**12, 10**9


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator chip.

    Attributes:
      name: key (``"a100-40gb"``).
      peak_flops: dtype name -> dense peak FLOP/s of its matmuls.
      hbm_bytes_per_s: memory bandwidth, bytes per second.
      memory_bytes: device memory, bytes.
      link_bytes_per_s: chip-to-chip bandwidth one way, bytes per second
        (NVLink, ICI: half the bidirectional total the datasheet gives), for
        tensor parallelism's all-reduces.
      source: where the numbers come from.
    """

    name: str
    peak_flops: dict
    hbm_bytes_per_s: float
    memory_bytes: int
    link_bytes_per_s: float
    source: str

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype``.

        Raises:
          ValueError: a dtype the device has no figure for.
        """
        check_choice("dtype", dtype, self.peak_flops)
        return self.peak_flops[dtype]


DEVICES = {d.name: d for d in (
    DeviceSpec(name="a100-40gb", peak_flops={"bfloat16": 312 * TERA, "float16": 312 * TERA, "int8": 624 * TERA,
                                             "float32": 19.5 * TERA},
               hbm_bytes_per_s=1555 * GIGA, memory_bytes=40 * GIGA, link_bytes_per_s=300 * GIGA,
               source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40 GB: 312 TFLOPS BF16/FP16 dense, 1,555 GB/s; "
                      "NVLink 600 GB/s)"),
    DeviceSpec(name="a100-80gb", peak_flops={"bfloat16": 312 * TERA, "float16": 312 * TERA, "int8": 624 * TERA,
                                             "float32": 19.5 * TERA},
               hbm_bytes_per_s=2039 * GIGA, memory_bytes=80 * GIGA, link_bytes_per_s=300 * GIGA,
               source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB: 2,039 GB/s; NVLink 600 GB/s)"),
    DeviceSpec(name="h100", peak_flops={"bfloat16": 989 * TERA, "float16": 989 * TERA, "float8": 1979 * TERA,
                                        "int8": 1979 * TERA, "float32": 67 * TERA},
               hbm_bytes_per_s=3350 * GIGA, memory_bytes=80 * GIGA, link_bytes_per_s=450 * GIGA,
               source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 3.35 TB/s, 80 GB; NVLink "
                      "900 GB/s)"),
    DeviceSpec(name="h200", peak_flops={"bfloat16": 989 * TERA, "float16": 989 * TERA, "float8": 1979 * TERA,
                                        "int8": 1979 * TERA, "float32": 67 * TERA},
               hbm_bytes_per_s=4800 * GIGA, memory_bytes=141 * GIGA, link_bytes_per_s=450 * GIGA,
               source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s, 141 GB; NVLink "
                      "900 GB/s)"),
    DeviceSpec(name="tpu-v5e", peak_flops={"bfloat16": 197 * TERA, "int8": 394 * TERA},
               hbm_bytes_per_s=819 * GIGA, memory_bytes=16 * GIGA, link_bytes_per_s=100 * GIGA,
               source="Google Cloud TPU v5e documentation (197 TFLOPS BF16, 394 INT8, 16 GB HBM2 at 819 GB/s; ICI "
                      "1,600 Gbps)"),
    DeviceSpec(name="tpu-v6e", peak_flops={"bfloat16": 918 * TERA, "int8": 1836 * TERA},
               hbm_bytes_per_s=1640 * GIGA, memory_bytes=32 * GIGA, link_bytes_per_s=224 * GIGA,
               source="Google Cloud TPU v6e (Trillium) documentation (918 TFLOPS BF16, 1,836 INT8, 32 GB at "
                      "1,640 GB/s; ICI 3,584 Gbps)"),
)}
"""The device specs by name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What sets a decoder step's FLOPs and bytes.

    Attributes:
      name: key (``"opt-13b"``).
      num_layers, hidden, num_q_heads, num_kv_heads, head_dim, mlp_dim,
        vocab_size: the config's.
      gated_mlp: three MLP matrices (Llama's SwiGLU) or two (OPT's ReLU).
      num_params: every parameter (embeddings included), for the weight
        bytes a step reads.
      source: where the numbers come from.
    """

    name: str
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_size: int
    gated_mlp: bool
    num_params: int
    source: str

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_q_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size",
                  "num_params"):
            check_int(f, getattr(self, f))

    @property
    def layer_matmul_params(self) -> int:
        """Weights one layer multiplies each token by: Q, K, V, O and the
        MLP's two or three matrices (biases and norms left out)."""
        q = self.num_q_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + (3 if self.gated_mlp else 2) * self.hidden * self.mlp_dim

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token, every layer, in ``dtype`` (bytes)."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype))

    def weight_bytes(self, dtype: str) -> int:
        return int(self.num_params * dtype_bytes(dtype))


MODELS = {m.name: m for m in (
    # facebook/opt-13b config.json: 40 layers, hidden 5120, 40 heads, ffn 20480,
    # vocab 50272; 12.85 B parameters (the paper's Table 1 model for Figure 12a).
    ModelShape(name="opt-13b", num_layers=40, hidden=5120, num_q_heads=40, num_kv_heads=40, head_dim=128,
               mlp_dim=20480, vocab_size=50272, gated_mlp=False, num_params=12_853_000_000,
               source="facebook/opt-13b config.json"),
    ModelShape(name="opt-66b", num_layers=64, hidden=9216, num_q_heads=72, num_kv_heads=72, head_dim=128,
               mlp_dim=36864, vocab_size=50272, gated_mlp=False, num_params=65_700_000_000,
               source="facebook/opt-66b config.json"),
    ModelShape(name="opt-175b", num_layers=96, hidden=12288, num_q_heads=96, num_kv_heads=96, head_dim=128,
               mlp_dim=49152, vocab_size=50272, gated_mlp=False, num_params=175_000_000_000,
               source="OPT paper (Zhang et al., 2022), Table 1"),
    ModelShape(name="llama-13b", num_layers=40, hidden=5120, num_q_heads=40, num_kv_heads=40, head_dim=128,
               mlp_dim=13824, vocab_size=32000, gated_mlp=True, num_params=13_016_000_000,
               source="huggyllama/llama-13b config.json"),
    # HuggingFaceTB/SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, mlp 1536.
    ModelShape(name="smollm2-135m", num_layers=30, hidden=576, num_q_heads=9, num_kv_heads=3, head_dim=64,
               mlp_dim=1536, vocab_size=49152, gated_mlp=True, num_params=134_515_008,
               source="HuggingFaceTB/SmolLM2-135M config.json"),
)}
"""The model shapes by name."""


def get_device(name: str) -> DeviceSpec:
    """The device spec ``name`` (one of :data:`DEVICES`).

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    return DEVICES[check_choice("device", name, DEVICES)]


def get_model(name: str) -> ModelShape:
    """The model shape ``name`` (one of :data:`MODELS`).

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    return MODELS[check_choice("model", name, MODELS)]


_KINDS = (("a100", "80gb", "a100-80gb"), ("a100", "", "a100-40gb"), ("h100", "", "h100"), ("h200", "", "h200"),
          ("v5 lite", "", "tpu-v5e"), ("v5e", "", "tpu-v5e"), ("v6 lite", "", "tpu-v6e"), ("v6e", "", "tpu-v6e"))


def device_key(device_kind: str) -> str | None:
    """The :data:`DEVICES` key of a JAX ``device_kind`` (``"NVIDIA H100 80GB
    HBM3"`` -> ``"h100"``, ``"TPU v5 lite"`` -> ``"tpu-v5e"``), or None for a
    device without a spec here (a CPU)."""
    kind = str(device_kind).lower()
    for name, extra, key in _KINDS:
        if name in kind and extra in kind:
            return key
    return None


def kv_pool_tokens(model: ModelShape, device: DeviceSpec, num_devices: int, memory_fraction: float, *,
                   at_least: int = 2048) -> int:
    """KV tokens a server's pool holds: ``memory_fraction`` of its
    ``num_devices`` devices' memory (vLLM's ``gpu_memory_utilization``) less
    the bf16 weights, over the K/V bytes of a token.

    Raises:
      ValueError: an argument out of range (``memory_fraction`` in (0, 1],
        ``num_devices`` and ``at_least`` ints >= 1), or fewer than
        ``at_least`` tokens (one longest request).
    """
    check_instance("model", model, ModelShape, what="ModelShape (get_model)")
    check_instance("device", device, DeviceSpec, what="DeviceSpec (get_device)")
    check_int("num_devices", num_devices)
    check_int("at_least", at_least)
    check_float("memory_fraction", memory_fraction, 0, 1, low_open=True)
    free = memory_fraction * device.memory_bytes * num_devices - model.weight_bytes("bfloat16")
    tokens = int(max(free, 0) // model.kv_bytes_per_token("bfloat16"))
    if tokens < at_least:
        raise ValueError(f"{model.name} on {num_devices} x {device.name} at {memory_fraction:g} of memory leaves "
                         f"{max(free, 0) / 1e9:.1f} GB for K/V, {tokens} tokens: fewer than one {at_least}-token "
                         "request; more devices or a larger fraction")
    return tokens
