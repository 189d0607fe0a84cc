"""Door checks shared by the configs and entry points of paged_jax, models and
experiments (pallas_kernels, below them, keeps its own in
``pallas_kernels.common``)."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` as an int, if it is a Python or NumPy integer (not a bool)
    and ``>= low``.

    Raises:
      ValueError: otherwise, naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")
    return int(value)
