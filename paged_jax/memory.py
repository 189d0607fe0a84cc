"""KV-cache sizes, memory waste and a capacity planner: arithmetic only, no arrays on device.

Units. Sizes are in bytes (``int``); lengths and slots in tokens. One *slot*
holds one token's K and V for every layer and KV head, so a slot costs
:meth:`ModelPreset.kv_bytes_per_token` bytes and every waste figure below can
be counted in slots and converted with that one factor. ``GB`` means 10**9
bytes, ``KiB`` 2**10.

KV bytes per token:

* multi-head / grouped-query attention: ``2 (K and V) * layers * KV heads *
  head dim * bytes per element``;
* multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2): the cache holds
  one compressed latent (``kv_lora_rank``) and one shared RoPE key
  (``qk_rope_head_dim``) per layer, no separate V: ``layers * (kv_lora_rank +
  qk_rope_head_dim) * bytes per element``.

Waste for one request that ends with ``used`` tokens:

* contiguous (reserve the declared maximum up front): ``declared - used``
  slots, unbounded as the declaration grows;
* paged: ``ceil(used / page_size) * page_size - used`` slots, always below one
  page (PagedAttention, Kwon et al., SOSP 2023, section 4.1).

Hybrid models (Gemma 2 / 3, gpt-oss) mix sliding-window layers, where a query
at position ``p`` attends only to keys in ``(p - W, p]``, with full-attention
layers. With ``n`` tokens in a sequence (positions ``[0, n)``), page size
``L`` and window ``W``:

* a full layer holds ``ceil(n / L)`` pages;
* a sliding layer, under a *hybrid-aware* manager that frees a page once no
  later query can see any of its slots, holds the pages covering the keys
  the last token attended to, positions ``[max(0, n - W), n)``:
  ``ceil(n / L) - floor(max(0, n - W) / L)`` pages. That is ``min(n, W)``
  tokens rounded up to whole pages, plus one page more when the window
  starts inside a page far enough to spill onto one more: for ``n > W``,
  exactly when ``(n - W) mod L + W > L * ceil(W / L)`` (with ``W`` a
  multiple of ``L``: whenever ``n - W`` is not). Never more than
  ``ceil(W / L) + 1`` pages, whatever ``n``;
* a manager that is not hybrid-aware keeps every layer's pages, ``ceil(n /
  L)`` per layer (this repository's engine does: it leaves the pages before
  the window allocated until the sequence ends).

Each layer holds its own pages of ``2 * KV heads * head dim`` elements per
slot (K and V), so a sequence's bytes are the sum over layers (vLLM's hybrid
KV-cache manager, one ``KVCacheSpec`` per layer group, counts the same way).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from paged_jax.checks import check_bool, check_choice, check_float, check_int

GB = 10**9
KiB = 2**10

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1, "int4": 0.5}
"""Bytes per element for the dtypes the planner knows (``int4`` for weights only)."""


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (a key of :data:`DTYPE_BYTES`).

    Raises:
      ValueError: unknown dtype; the message lists the known ones.
    """
    return DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """The few numbers of a model's published config that size its KV cache.

    Either GQA/MHA (``num_kv_heads`` and ``head_dim`` set, MLA fields 0) or MLA
    (``kv_lora_rank`` and ``qk_rope_head_dim`` set, GQA fields 0).

    Attributes:
      name: preset key, lowercase (``"llama-3-70b"``).
      num_layers: decoder layers (``num_hidden_layers``).
      num_kv_heads: KV heads (``num_key_value_heads``); 0 for MLA.
      head_dim: dimension per head; 0 for MLA.
      kv_lora_rank: MLA latent rank; 0 for GQA.
      qk_rope_head_dim: MLA decoupled RoPE key dimension; 0 for GQA.
      num_params: total parameters (all experts for MoE models).
      source: where the numbers come from.
      sliding_window: W, the keys a sliding layer's query sees (its own
        included); None: every layer is full attention.
      num_sliding_layers: layers that attend within ``sliding_window``; the
        other ``num_layers - num_sliding_layers`` are full attention. Where
        they sit does not change the KV size, so only the count is kept
        (:func:`sliding_layer_count` gives it for the published patterns).

    Raises:
      ValueError: a count that is not an int in range, GQA and MLA fields
        mixed, a ``sliding_window`` that is not an int >= 1, sliding layers
        without a window, or a window on no layer; each names the field.
    """

    name: str
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_params: int
    source: str
    sliding_window: int | None = None
    num_sliding_layers: int = 0

    def __post_init__(self):
        check_int("num_layers", self.num_layers, 1)
        check_int("num_params", self.num_params, 1)
        for name in ("num_kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim"):
            check_int(name, getattr(self, name), 0)
        gqa = self.num_kv_heads > 0 and self.head_dim > 0
        mla = self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0
        gqa_any = self.num_kv_heads > 0 or self.head_dim > 0
        mla_any = self.kv_lora_rank > 0 or self.qk_rope_head_dim > 0
        if gqa == mla or (gqa and mla_any) or (mla and gqa_any):
            raise ValueError(
                "set either num_kv_heads and head_dim (GQA) or kv_lora_rank and "
                f"qk_rope_head_dim (MLA), got {self.num_kv_heads=} {self.head_dim=} "
                f"{self.kv_lora_rank=} {self.qk_rope_head_dim=}"
            )
        if self.sliding_window is None:
            if self.num_sliding_layers != 0:
                raise ValueError(f"num_sliding_layers={self.num_sliding_layers!r} needs a sliding_window, got "
                                 "sliding_window=None")
        else:
            check_int("sliding_window", self.sliding_window, 1)
            check_int("num_sliding_layers", self.num_sliding_layers, 1, self.num_layers + 1)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers slide (a window on every layer counts too)."""
        return self.num_sliding_layers > 0

    @property
    def num_full_layers(self) -> int:
        """Layers that attend to every earlier position."""
        return self.num_layers - self.num_sliding_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_elements_per_layer_token(self) -> int:
        """Cached elements per token in one layer."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token, all layers."""
        return self.num_layers * self.kv_elements_per_layer_token

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """Bytes of KV cache per token (one slot), all layers."""
        return math.ceil(self.kv_elements_per_token * dtype_bytes(dtype))

    def kv_bytes(self, num_tokens: int, dtype: str = "bfloat16") -> int:
        """Bytes of KV cache for ``num_tokens`` tokens."""
        check_int("num_tokens", num_tokens, 0)
        return num_tokens * self.kv_bytes_per_token(dtype)

    def weight_bytes(self, dtype: str = "bfloat16") -> int:
        """Bytes of weights: parameters * bytes per element."""
        return math.ceil(self.num_params * dtype_bytes(dtype))

    def sequence_kv_bytes(self, num_tokens: int, *, page_size: int = 16, dtype: str = "bfloat16",
                          hybrid_aware: bool = True) -> int:
        """Bytes of KV pages one sequence of ``num_tokens`` tokens holds, all
        layers (the module docstring gives the rule per layer).

        Args:
          num_tokens: n, tokens in the sequence (>= 0).
          page_size: L, tokens per page (>= 1; 1 counts tokens, unpaged).
          dtype: KV dtype, a key of :data:`DTYPE_BYTES`.
          hybrid_aware: sliding layers hold only the pages their window
            covers; False: every layer keeps all ``ceil(n / L)`` pages.

        Returns:
          ``ceil(layer slots * elements per layer slot * bytes per element)``,
          where layer slots sum each layer's pages times ``L``.

        Raises:
          ValueError: an argument out of range or an unknown dtype.
        """
        check_bool("hybrid_aware", hybrid_aware)
        full = layer_pages(num_tokens, page_size)
        sliding = layer_pages(num_tokens, page_size, self.sliding_window) if hybrid_aware and self.is_hybrid else full
        slots = (self.num_full_layers * full + self.num_sliding_layers * sliding) * page_size
        return math.ceil(slots * self.kv_elements_per_layer_token * dtype_bytes(dtype))


def sliding_layer_count(num_layers: int, global_every: int) -> int:
    """Sliding layers in a stack where every ``global_every``-th layer is
    global (full attention) and the others slide: layer ``i`` (from 0) is
    global iff ``(i + 1) % global_every == 0``, the rule transformers
    applies to Gemma 2 (2), Gemma 3 (6, its ``sliding_window_pattern``) and
    the alternation gpt-oss's ``layer_types`` spells out (2).

    Returns:
      ``num_layers - num_layers // global_every``.

    Raises:
      ValueError: ``num_layers`` not an int >= 1, or ``global_every`` not an
        int >= 2 (1 would make every layer global: no pattern).
    """
    check_int("num_layers", num_layers, 1)
    check_int("global_every", global_every, 2)
    return num_layers - num_layers // global_every


def layer_pages(num_tokens: int, page_size: int, window: int | None = None) -> int:
    """Pages one layer holds for a sequence of ``num_tokens`` tokens.

    Full attention (``window`` None): ``ceil(n / L)``. Sliding window ``W``:
    the pages covering positions ``[max(0, n - W), n)``, the keys the last
    token attended to, ``ceil(n / L) - floor(max(0, n - W) / L)``: that is
    ``ceil(min(n, W) / L)``, plus one when ``n > W`` and ``(n - W) mod L + W
    > L * ceil(W / L)`` (the window starts far enough inside its first page
    to end on one more page).

    Raises:
      ValueError: ``num_tokens`` not an int >= 0, ``page_size`` or ``window``
        not an int >= 1.
    """
    check_int("num_tokens", num_tokens, 0)
    check_int("page_size", page_size, 1)
    pages = -(-num_tokens // page_size)
    if window is None:
        return pages
    check_int("window", window, 1)
    return pages - max(0, num_tokens - window) // page_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridCapacity:
    """KV bytes per sequence and sequences a KV budget holds at one context,
    hybrid-aware versus every layer's pages kept.

    Attributes:
      model: preset name.
      context: tokens per sequence.
      page_size: tokens per page.
      kv_budget_bytes: bytes of KV pool.
      full_bytes: bytes one sequence holds when every layer keeps its pages.
      hybrid_bytes: bytes when sliding layers keep only their window's pages.
      full_sequences: ``kv_budget_bytes // full_bytes``.
      hybrid_sequences: ``kv_budget_bytes // hybrid_bytes``.
    """

    model: str
    context: int
    page_size: int
    kv_budget_bytes: int
    full_bytes: int
    hybrid_bytes: int
    full_sequences: int
    hybrid_sequences: int

    @property
    def ratio(self) -> float:
        """``full_bytes / hybrid_bytes``: how many times the sequences a
        hybrid-aware manager holds, the limit of ``hybrid_sequences /
        full_sequences`` as the budget grows (each count is floored, which a
        small budget feels)."""
        return self.full_bytes / self.hybrid_bytes


def hybrid_capacity(model: ModelPreset, *, context: int, kv_budget_bytes: int, page_size: int = 16,
                    dtype: str = "bfloat16") -> HybridCapacity:
    """Sequences of ``context`` tokens that ``kv_budget_bytes`` of KV pool
    hold, hybrid-aware and with every layer's pages kept (equal for a model
    without sliding layers). Every sequence is counted at ``context`` tokens,
    its peak.

    Raises:
      ValueError: ``context`` or ``kv_budget_bytes`` not an int >= 1, or a
        bad ``page_size`` / ``dtype``.
    """
    check_int("context", context, 1)
    check_int("kv_budget_bytes", kv_budget_bytes, 1)
    full = model.sequence_kv_bytes(context, page_size=page_size, dtype=dtype, hybrid_aware=False)
    hybrid = model.sequence_kv_bytes(context, page_size=page_size, dtype=dtype, hybrid_aware=True)
    return HybridCapacity(
        model=model.name, context=context, page_size=page_size, kv_budget_bytes=kv_budget_bytes,
        full_bytes=full, hybrid_bytes=hybrid, full_sequences=kv_budget_bytes // full,
        hybrid_sequences=kv_budget_bytes // hybrid,
    )


# Numbers from each model's published Hugging Face config.json (layers =
# num_hidden_layers, KV heads = num_key_value_heads, head dim = hidden_size /
# num_attention_heads unless the config gives head_dim; MLA: kv_lora_rank,
# qk_rope_head_dim) and parameter counts from the model cards / safetensors
# indices.
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # meta-llama/Llama-2-7b-hf: 32 layers, 32 heads, 32 KV heads (no GQA), hidden 4096.
        ModelPreset(
            name="llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128,
            num_params=6_738_415_616, source="meta-llama/Llama-2-7b-hf config.json",
        ),
        # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096.
        ModelPreset(
            name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128,
            num_params=8_030_261_248, source="meta-llama/Meta-Llama-3-8B config.json",
        ),
        # meta-llama/Llama-3.1-8B: Llama-3-8B's shapes, llama3-scaled RoPE.
        ModelPreset(
            name="llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128,
            num_params=8_030_261_248, source="meta-llama/Llama-3.1-8B config.json",
        ),
        # Qwen/Qwen3-8B: 36 layers, 32 heads, 8 KV heads, head_dim 128, untied, no
        # window; 8,190,735,360 = its shapes counted (and torch's count, in public logs).
        ModelPreset(
            name="qwen3-8b", num_layers=36, num_kv_heads=8, head_dim=128,
            num_params=8_190_735_360, source="Qwen/Qwen3-8B config.json",
        ),
        # google/gemma-2-9b: 42 layers, 16 heads, 8 KV heads, head_dim 256; window
        # 4096 on every other layer, sliding first (transformers' Gemma 2 default).
        ModelPreset(
            name="gemma-2-9b", num_layers=42, num_kv_heads=8, head_dim=256,
            num_params=9_241_705_984, source="google/gemma-2-9b config.json",
            sliding_window=4096, num_sliding_layers=sliding_layer_count(42, 2),
        ),
        # google/gemma-3-12b-it text_config: 48 layers, 16 heads, 8 KV heads, head_dim
        # 256, sliding_window 1024, sliding_window_pattern 6 (5 sliding, 1 global).
        # The text decoder's shapes counted; 10,759,151,616 of them outside the
        # embedding: the Gemma 3 report's 10,759M (Table 1). Plus a 417M vision encoder.
        ModelPreset(
            name="gemma-3-12b", num_layers=48, num_kv_heads=8, head_dim=256,
            num_params=11_766_034_176, source="google/gemma-3-12b-it config.json (text_config)",
            sliding_window=1024, num_sliding_layers=sliding_layer_count(48, 6),
        ),
        # google/gemma-3-27b-it text_config: 62 layers, 32 heads, 16 KV heads, head_dim
        # 128, window 1024, pattern 6; counted as above (report: 25,600M non-embedding).
        ModelPreset(
            name="gemma-3-27b", num_layers=62, num_kv_heads=16, head_dim=128,
            num_params=27_009_346_304, source="google/gemma-3-27b-it config.json (text_config)",
            sliding_window=1024, num_sliding_layers=sliding_layer_count(62, 6),
        ),
        # openai/gpt-oss-20b: 24 layers, 64 heads, 8 KV heads, head_dim 64, layer_types
        # alternating sliding (window 128) and full, sliding first; MoE, 20.91 B
        # parameters (model card, arXiv 2508.10925).
        ModelPreset(
            name="gpt-oss-20b", num_layers=24, num_kv_heads=8, head_dim=64,
            num_params=20_910_000_000, source="openai/gpt-oss-20b config.json",
            sliding_window=128, num_sliding_layers=sliding_layer_count(24, 2),
        ),
        # openai/gpt-oss-120b: the same attention, 36 layers; 116.83 B parameters.
        ModelPreset(
            name="gpt-oss-120b", num_layers=36, num_kv_heads=8, head_dim=64,
            num_params=116_830_000_000, source="openai/gpt-oss-120b config.json",
            sliding_window=128, num_sliding_layers=sliding_layer_count(36, 2),
        ),
        # meta-llama/Llama-3.1-405B: 126 layers, 128 heads, 8 KV heads, hidden 16384, FFN 53248
        # ("The Llama 3 Herd of Models", Table 3); 405,853,388,800 = its shapes counted (untied).
        ModelPreset(
            name="llama-3.1-405b", num_layers=126, num_kv_heads=8, head_dim=128,
            num_params=405_853_388_800, source="meta-llama/Llama-3.1-405B config.json",
        ),
        # Qwen/Qwen3-235B-A22B: 94 layers, 64 heads, 4 KV heads, head_dim 128, 128 experts
        # (8 active) of width 1536, hidden 4096, untied; 235,093,658,624 = its shapes counted.
        ModelPreset(
            name="qwen3-235b-a22b", num_layers=94, num_kv_heads=4, head_dim=128,
            num_params=235_093_658_624, source="Qwen/Qwen3-235B-A22B config.json",
        ),
        # meta-llama/Llama-2-70b-hf: 80 layers, 64 heads, 8 KV heads, hidden 8192.
        ModelPreset(
            name="llama-2-70b", num_layers=80, num_kv_heads=8, head_dim=128,
            num_params=68_976_648_192, source="meta-llama/Llama-2-70b-hf config.json",
        ),
        # meta-llama/Meta-Llama-3-70B: 80 layers, 64 heads, 8 KV heads, hidden 8192.
        ModelPreset(
            name="llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128,
            num_params=70_553_706_496, source="meta-llama/Meta-Llama-3-70B config.json",
        ),
        # mistralai/Mixtral-8x7B-v0.1: 32 layers, 32 heads, 8 KV heads, hidden 4096;
        # 46.7 B parameters with all 8 experts.
        ModelPreset(
            name="mixtral-8x7b", num_layers=32, num_kv_heads=8, head_dim=128,
            num_params=46_702_792_704, source="mistralai/Mixtral-8x7B-v0.1 config.json",
        ),
        # Qwen/Qwen2.5-7B: 28 layers, 28 heads, 4 KV heads, hidden 3584.
        ModelPreset(
            name="qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128,
            num_params=7_615_616_512, source="Qwen/Qwen2.5-7B config.json",
        ),
        # HuggingFaceTB/SmolLM2-135M(-Instruct): 30 layers, 9 heads, 3 KV heads,
        # hidden 576 (head dim 64); the GGUF shipped here dequantizes to 134.5 M.
        ModelPreset(
            name="smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64,
            num_params=134_515_008, source="HuggingFaceTB/SmolLM2-135M config.json",
        ),
        # deepseek-ai/DeepSeek-V3: 61 layers, MLA with kv_lora_rank 512 and
        # qk_rope_head_dim 64; 671 B parameters (the card's 685 B adds the 14 B
        # multi-token-prediction module).
        ModelPreset(
            name="deepseek-v3", num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
            num_params=671_000_000_000, source="deepseek-ai/DeepSeek-V3 config.json",
        ),
        # moonshotai/Kimi-K2-Instruct: DeepSeek-V3 architecture, 61 layers, 64
        # heads (V3 has 128), the same MLA dims (kv_lora_rank 512,
        # qk_rope_head_dim 64); about 1.04 T parameters (model card: "1T").
        ModelPreset(
            name="kimi-k2", num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
            num_params=1_040_000_000_000, source="moonshotai/Kimi-K2-Instruct config.json",
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises:
      ValueError: unknown name; the message lists the presets.
    """
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}, got model={name!r}")
    return PRESETS[key]


def _lengths(name: str, values, low: int = 0) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-D sequence of ints, got {name}={values!r}")
    if (arr < low).any():
        raise ValueError(f"{name} must all be >= {low}, got min {name}={int(arr.min())}")
    return arr.astype(np.int64)


def paged_slots(used: Sequence[int], page_size: int) -> np.ndarray:
    """Slots held per request under paging: ``ceil(used / page_size) * page_size``.

    Args:
      used: i64[R] tokens per request (>= 0).
      page_size: tokens per page (>= 1).

    Returns:
      i64[R] slots held.
    """
    check_int("page_size", page_size, 1)
    used = _lengths("used", used)
    return -(-used // page_size) * page_size


def paged_waste(used: Sequence[int], page_size: int) -> np.ndarray:
    """Slots held but unfilled per request under paging; each is < ``page_size``.

    Returns:
      i64[R] ``paged_slots(used) - used``, in ``[0, page_size)``.
    """
    return paged_slots(used, page_size) - _lengths("used", used)


def contiguous_waste(used: Sequence[int], declared: Sequence[int] | int) -> np.ndarray:
    """Slots reserved but unfilled per request when each reserves ``declared``.

    Args:
      used: i64[R] tokens per request.
      declared: i64[R] (or one int for all) slots reserved per request.

    Returns:
      i64[R] ``declared - used``.

    Raises:
      ValueError: a request uses more than it declared.
    """
    used = _lengths("used", used)
    declared = np.broadcast_to(np.asarray(declared, dtype=np.int64), used.shape)
    if (used > declared).any():
        i = int(np.argmax(used > declared))
        raise ValueError(
            f"used must not exceed declared, got used[{i}]={int(used[i])} declared[{i}]={int(declared[i])}"
        )
    return declared - used


def pow2_reservation(used: Sequence[int]) -> np.ndarray:
    """The smallest power of two >= each length (Orca's "Pow2" policy: it
    knows the output length to within 2x). i64[R] slots."""
    used = _lengths("used", used, low=1)
    return 1 << np.ceil(np.log2(used)).astype(np.int64)


def token_state_share(used: Sequence[int], held: Sequence[int]) -> float:
    """Fraction of held slots that hold a token's K/V: ``sum(used) / sum(held)``."""
    used = _lengths("used", used)
    held = _lengths("held", held)
    if used.shape != held.shape:
        raise ValueError(f"used and held must have the same shape, got {used.shape} {held.shape}")
    return float(used.sum() / held.sum())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapacityPlan:
    """How many pages and sequences a deployment's KV budget holds.

    Attributes:
      model: preset name.
      total_memory_bytes: device memory times devices.
      weight_bytes: model weights.
      cache_bytes: KV budget: ``cache_fraction * total - weights``.
      kv_bytes_per_token: bytes per slot.
      page_size: tokens per page.
      num_pages: pages in the pool (``cache_bytes // (page_size * kv_bytes_per_token)``).
      pool_tokens: ``num_pages * page_size`` slots.
      mean_length: mean final length of the distribution, tokens.
      paged_concurrency: sequences that fit at once when each holds
        ``ceil(length / page_size)`` pages at its final length (mean).
      contiguous_concurrency: sequences that fit when each reserves
        ``max_seq_len`` contiguous slots.
      paged_token_share: token states / held slots under paging.
      contiguous_token_share: token states / reserved slots, contiguous.
    """

    model: str
    total_memory_bytes: int
    weight_bytes: int
    cache_bytes: int
    kv_bytes_per_token: int
    page_size: int
    num_pages: int
    pool_tokens: int
    max_seq_len: int
    mean_length: float
    paged_concurrency: int
    contiguous_concurrency: int
    paged_token_share: float
    contiguous_token_share: float


def plan_capacity(
    model: ModelPreset,
    *,
    device_memory_bytes: int,
    num_devices: int = 1,
    cache_fraction: float = 0.9,
    page_size: int = 16,
    kv_dtype: str = "bfloat16",
    weight_dtype: str = "bfloat16",
    lengths: Sequence[int],
    max_seq_len: int = 2048,
) -> CapacityPlan:
    """Pages in the pool and concurrent sequences, paged versus contiguous.

    ``cache_fraction`` is the share of all device memory the server may use
    (vLLM's ``gpu_memory_utilization``); the weights come out of it and the
    rest is KV cache (activations are ignored). Sequences are counted at
    their final lengths (their peak), ``lengths`` drawn from the workload.

    Args:
      model: the model preset.
      device_memory_bytes: memory per device, bytes.
      num_devices: devices sharing the model (weights and KV split across them).
      cache_fraction: in (0, 1].
      page_size: tokens per page.
      kv_dtype, weight_dtype: keys of :data:`DTYPE_BYTES`.
      lengths: i64[R] final lengths (prompt + output), tokens.
      max_seq_len: slots each sequence reserves in the contiguous layout;
        must cover every length.

    Raises:
      ValueError: an argument out of range (the message names it), or the
        weights do not fit in ``cache_fraction`` of the memory.
    """
    check_int("device_memory_bytes", device_memory_bytes, 1)
    check_int("num_devices", num_devices, 1)
    check_int("page_size", page_size, 1)
    check_int("max_seq_len", max_seq_len, 1)
    check_float("cache_fraction", cache_fraction, 0, 1, low_open=True)
    lengths = _lengths("lengths", lengths, low=1)
    if lengths.max() > max_seq_len:
        raise ValueError(
            f"max_seq_len must cover every length, got {max_seq_len=} and a length {int(lengths.max())}"
        )
    total = device_memory_bytes * num_devices
    weights = model.weight_bytes(weight_dtype)
    cache = int(cache_fraction * total) - weights
    if cache <= 0:
        raise ValueError(
            f"weights ({weights / GB:.1f} GB) do not fit in cache_fraction={cache_fraction} of "
            f"{total / GB:.1f} GB (device_memory_bytes={device_memory_bytes}, num_devices={num_devices})"
        )
    per_token = model.kv_bytes_per_token(kv_dtype)
    num_pages = cache // (page_size * per_token)
    pool_tokens = num_pages * page_size
    held = paged_slots(lengths, page_size)
    return CapacityPlan(
        model=model.name,
        total_memory_bytes=total,
        weight_bytes=weights,
        cache_bytes=cache,
        kv_bytes_per_token=per_token,
        page_size=page_size,
        num_pages=num_pages,
        pool_tokens=pool_tokens,
        max_seq_len=max_seq_len,
        mean_length=float(lengths.mean()),
        paged_concurrency=int(pool_tokens // held.mean()),
        contiguous_concurrency=cache // (max_seq_len * per_token),
        paged_token_share=float(lengths.sum() / held.sum()),
        contiguous_token_share=float(lengths.mean() / max_seq_len),
    )
