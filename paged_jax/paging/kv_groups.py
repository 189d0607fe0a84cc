"""Layer groups of a hybrid model: which layers share a block table.

A model whose layers all attend alike (every layer full, or every layer a
sliding window of ``W`` tokens) needs one block table per sequence: a page
holds a token range for every layer. A model that mixes kinds (Gemma 2 / 3,
gpt-oss: sliding layers of window ``W`` and full layers) does not: a
sliding layer can return a page once it leaves the window, a full layer
never can, so one table cannot say both. Layers are therefore cut into
*groups* of one kind each, and each group has its own block table per
sequence.

The layout (vLLM v1's hybrid allocator: ``kv_cache_utils.
unify_hybrid_kv_cache_specs`` and ``_get_kv_cache_config_uniform_page_size``,
``kv_cache_coordinator.HybridKVCacheCoordinator``). The group size ``g``
is the smallest layer count among the kinds; each kind's layers are cut,
in layer order, into groups of ``g`` (Gemma 3 12B: 8 full and 40 sliding
layers -> 6 groups of 8: one full, five sliding; Gemma 2: 21 + 21 -> 2
groups of 21). One pool serves every group, and a page of it holds one
token range for the ``g`` layers of whichever group owns it:
``KVPool [g, K, P, L, H]``; layer ``l`` reads and writes row ``index(l)``
of the pages its group's table lists. Why one pool with per-group tables
rather than a pool per kind:

- every group takes pages off one free queue, so memory moves freely
  between kinds: a workload of long contexts fills the full group's tables
  while the sliding groups hold a few pages each, and no split of the
  memory has to be guessed up front (per-kind pools strand the memory of
  whichever kind is short of work);
- a page is one size everywhere, so the page state, the free queue, the
  swap copies and copy-on-write stay what they are for one table: the
  state simply has ``G * S`` rows (row ``group * S + slot``);
- a model with one kind has ``G = 1`` and ``g = num_layers``: exactly the
  pool and the tables it had before.

The price: a kind whose layer count is not a multiple of ``g`` gets a last
group with fewer layers, whose pages carry ``g - n`` unused layer rows
(:attr:`KVGroups.padded_layer_rows`); the standard mixes (5:1, 1:1) have
none.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from paged_jax.checks import check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVGroups:
    """The layer groups of a model (see the module docstring).

    Attributes:
      windows: per group, the sliding window of its layers in tokens, or
        None for full attention.
      layer_group: per layer, its group.
      layer_index: per layer, its row in a page (its index in the group).
      group_size: ``g``, layers a page holds (the pool's layer axis).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_index: tuple[int, ...]
    group_size: int

    def __post_init__(self):
        check_int("group_size", self.group_size)
        if not self.windows:
            raise ValueError("windows must name at least one group, got ()")
        for w in self.windows:
            if w is not None:
                check_int("windows entry", w)
        if len(self.layer_group) != len(self.layer_index) or not self.layer_group:
            raise ValueError(f"layer_group and layer_index must have one entry per layer (>= 1), got "
                             f"{len(self.layer_group)} and {len(self.layer_index)}")
        seen = set()
        for layer, (g, i) in enumerate(zip(self.layer_group, self.layer_index)):
            if not (0 <= g < len(self.windows) and 0 <= i < self.group_size) or (g, i) in seen:
                raise ValueError(f"layer {layer} maps to group {g}, index {i}: expected a distinct (group in "
                                 f"[0, {len(self.windows)}), index in [0, {self.group_size})) per layer")
            seen.add((g, i))
        empty = sorted(set(range(len(self.windows))) - set(self.layer_group))
        if empty:
            raise ValueError(f"groups {empty} have no layer")

    @property
    def num_groups(self) -> int:
        """``G``, block tables per sequence."""
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def padded_layer_rows(self) -> int:
        """Layer rows of a page that no layer uses, summed over the groups
        (``G * g - num_layers``): the waste of a kind whose layer count is
        not a multiple of ``g``, per page of each group."""
        return self.num_groups * self.group_size - self.num_layers

    @property
    def uniform_window(self) -> int | None:
        """The window when there is one group (None: full attention, or
        several groups)."""
        return self.windows[0] if self.num_groups == 1 else None

    def rows(self, slot: int, num_slots: int) -> list[int]:
        """The page-state rows of engine slot ``slot``: ``group * num_slots
        + slot``, group by group."""
        return [g * num_slots + slot for g in range(self.num_groups)]


def kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """Groups the layers by attention kind (module docstring).

    Args:
      layer_windows: per layer, its sliding window in tokens (an int >= 1),
        or None for full attention.

    Returns:
      the groups, kinds in the order of their first layer, each kind's
      groups in layer order.

    Raises:
      ValueError: ``layer_windows`` empty, or an entry neither None nor an
        int >= 1 (named with its layer).
    """
    windows = [w if w is None else check_int(f"layer_windows[{layer}]", w) for layer, w in enumerate(layer_windows)]
    if not windows:
        raise ValueError("layer_windows must have one entry per layer, got none")
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    g = min(len(layers) for layers in kinds.values())
    group_windows: list[int | None] = []
    layer_group = [0] * len(windows)
    layer_index = [0] * len(windows)
    for w, layers in kinds.items():
        for start in range(0, len(layers), g):
            for i, layer in enumerate(layers[start : start + g]):
                layer_group[layer], layer_index[layer] = len(group_windows), i
            group_windows.append(w)
    return KVGroups(windows=tuple(group_windows), layer_group=tuple(layer_group), layer_index=tuple(layer_index),
                    group_size=g)


def single_group(num_layers: int, window: int | None = None) -> KVGroups:
    """One group of ``num_layers`` layers attending ``window`` tokens (None:
    everything): the layout of a model with one kind, or of a hybrid model
    kept whole (every page until the sequence ends)."""
    check_int("num_layers", num_layers)
    return kv_groups([window] * num_layers)
