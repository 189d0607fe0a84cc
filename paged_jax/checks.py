"""Door checks shared by the configs and entry points of paged_jax, models and
experiments (pallas_kernels, below them, keeps its own in
``pallas_kernels.common``).

Each ``check_*`` returns the value (as a plain Python ``int``, ``float`` or
``bool`` where it converts) or raises ``ValueError`` with a message that
names the argument and the value it got, in one style::

    seed must be an int in [0, 4294967296), got seed=-1
    top_p must be a finite number in (0, 1], got top_p=nan
    ignore_eos must be a bool, got ignore_eos=1
    impl must be one of ('auto', 'xla'), got impl='fast'
    config must be an EngineConfig, got a dict

``is_int`` and ``is_float`` are the same tests as predicates, for callers
that word their own message (a config file's field, a list of token ids).

Integers are Python or NumPy integers, never ``bool`` (``True`` is an int
to Python, but a flag passed as a count is a bug); numbers are those or
Python / NumPy floats, never NaN or infinite. Ranges follow Python's: ``low``
is included, an int's ``high`` is not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set

import numpy as np


def is_int(value, low: int | None = None, high: int | None = None) -> bool:
    """Whether ``value`` is a Python or NumPy integer (not a bool) with
    ``low <= value < high`` (a bound of None is no bound)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return False
    return (low is None or value >= low) and (high is None or value < high)


def check_int(name: str, value, low: int | None = 1, high: int | None = None) -> int:
    """``value`` as an int, if :func:`is_int` (``low <= value < high``; by
    default ``>= 1``).

    Raises:
      ValueError: otherwise, naming ``name``, the range and the value
        (``"n must be an int >= 1, got n=0"``).
    """
    if not is_int(value, low, high):
        if low is not None and high is not None:
            what = f"an int in [{low}, {high})"
        elif low is not None:
            what = f"an int >= {low}"
        elif high is not None:
            what = f"an int < {high}"
        else:
            what = "an int"
        raise ValueError(f"{name} must be {what}, got {name}={value!r}")
    return int(value)


def is_float(value, low: float | None = None, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False) -> bool:
    """Whether ``value`` is a finite Python or NumPy int or float (not a
    bool) in the range from ``low`` to ``high`` (a bound of None is no
    bound; each bound is included unless ``low_open`` / ``high_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        return False
    if low is not None and not (value > low if low_open else value >= low):
        return False
    return high is None or (value < high if high_open else value <= high)


def check_float(name: str, value, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float, if :func:`is_float`: finite, and from ``low`` to
    ``high`` (included unless ``low_open`` / ``high_open``; None is no
    bound). ``check_float("top_p", p, 0, 1, low_open=True)`` takes ``(0, 1]``.

    Raises:
      ValueError: otherwise, naming ``name``, the interval and the value
        (``"top_p must be a finite number in (0, 1], got top_p=1.5"``; a
        closed interval with both bounds reads ``"a number in [0, 1]"``).
    """
    if not is_float(value, low, high, low_open=low_open, high_open=high_open):
        if low is None and high is None:
            what = "a finite number"
        else:
            left = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
            right = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
            closed = low is not None and high is not None and not low_open and not high_open
            what = f"{'a number' if closed else 'a finite number'} in {left}, {right}"
        raise ValueError(f"{name} must be {what}, got {name}={value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """``value`` as a bool, if it is a Python or NumPy bool (not ``0`` / ``1``
    or another truthy value).

    Raises:
      ValueError: otherwise, naming ``name`` and the value
        (``"qkv_bias must be a bool, got qkv_bias=1"``).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {name}={value!r}")
    return bool(value)


def check_choice(name: str, value, choices):
    """``value``, if it is one of ``choices`` (a tuple or list, shown in its
    order; or a set or mapping, whose keys are shown sorted).

    Raises:
      ValueError: otherwise (an unhashable value included), naming ``name``,
        the choices and the value
        (``"dtype must be one of ['bfloat16', 'float32'], got dtype='fp7'"``).
    """
    try:
        ok = value in choices
    except TypeError:  # an unhashable value looked up in a set or mapping
        ok = False
    if not ok:
        shown = choices
        if isinstance(choices, (Mapping, Set)):
            try:
                shown = sorted(choices)
            except TypeError:
                shown = list(choices)
        raise ValueError(f"{name} must be one of {shown!r}, got {name}={value!r}")
    return value


def check_array(name: str, value, shape: tuple, kind: str = "int") -> np.ndarray:
    """``value`` on the host (a NumPy array) when it is an array of exactly
    ``shape`` whose dtype is of ``kind`` (``"int"``: signed or unsigned
    integers, bool excluded; ``"float"``: floating point).

    Raises:
      ValueError: naming ``name``, the shape and dtype expected and got.
    """
    dtype = getattr(value, "dtype", None)
    if kind not in ("int", "float"):
        raise ValueError(f"kind must be 'int' or 'float', got {kind!r}")
    ok = dtype is not None and dtype != np.bool_ and (
        np.issubdtype(dtype, np.integer) if kind == "int" else np.issubdtype(dtype, np.floating)
        or "bfloat16" in str(dtype) or "float8" in str(dtype))
    if not ok or tuple(getattr(value, "shape", ())) != tuple(shape):
        got = f"{dtype}{list(value.shape)}" if dtype is not None else f"a {type(value).__name__}"
        raise ValueError(f"{name} must be {'an integer' if kind == 'int' else 'a float'} array of shape "
                         f"{tuple(shape)}, got {got}")
    return np.asarray(value)

def check_instance(name: str, value, cls: type, *, what: str | None = None):
    """``value``, if it is an instance of ``cls``.

    Args:
      what: how the message names the class (default ``cls.__name__``), e.g.
        ``"models.llama.Llama"`` to say where it lives.

    Raises:
      ValueError: otherwise, naming ``name``, the class and the type got
        (``"model must be a models.llama.Llama, got a dict"``).
    """
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be {_a(what or cls.__name__)}, got {_a(type(value).__name__)}")
    return value


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
