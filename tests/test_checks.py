"""paged_jax.checks: each door check takes good values (NumPy scalars too)
and refuses bools, wrong types, NaN / inf and values out of range, naming
the argument and the value."""

import math
import re

import numpy as np
import pytest

from paged_jax.checks import (
    check_bool,
    check_choice,
    check_float,
    check_instance,
    check_int,
    is_float,
    is_int,
)


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2**40), np.uint8(5), 10**30])
def test_check_int_takes_ints_and_returns_plain_ints(value):
    out = check_int("n", value)
    assert out == value and type(out) is int


@pytest.mark.parametrize("value, low, high, expected", [
    (0, 1, None, "an int >= 1"),
    (True, 0, None, "an int >= 0"),
    (np.bool_(True), 0, None, "an int >= 0"),
    (2.0, 1, None, "an int >= 1"),
    ("3", 1, None, "an int >= 1"),
    (None, 1, None, "an int >= 1"),
    (np.array([3]), 1, None, "an int >= 1"),
    (4, 0, 4, "an int in [0, 4)"),
    (-1, 0, 4, "an int in [0, 4)"),
    (5, None, 5, "an int < 5"),
    (1.5, None, None, "an int"),
])
def test_check_int_refuses(value, low, high, expected):
    with pytest.raises(ValueError, match=re.escape(f"n must be {expected}, got n={value!r}")):
        check_int("n", value, low, high)


def test_check_int_bounds():
    assert check_int("seed", 0, 0, 2**32) == 0
    assert check_int("seed", 2**32 - 1, 0, 2**32) == 2**32 - 1
    assert check_int("x", -5, None) == -5
    assert check_int("x", 2, 2) == 2  # low is included


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.25), np.float64(1.0), np.int64(1), 1e-30])
def test_check_float_takes_ints_and_floats_and_returns_plain_floats(value):
    out = check_float("p", value, 0, 1, low_open=True)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value, kwargs, message", [
    (0.0, dict(low=0, high=1, low_open=True), "p must be a finite number in (0, 1], got p=0.0"),
    (1.5, dict(low=0, high=1, low_open=True), "p must be a finite number in (0, 1], got p=1.5"),
    (1.0, dict(low=0, high=1, low_open=True, high_open=True), "p must be a finite number in (0, 1), got p=1.0"),
    (-0.1, dict(low=0, high=1), "p must be a number in [0, 1], got p=-0.1"),
    (float("nan"), dict(low=0, high=1), "p must be a number in [0, 1], got p=nan"),
    (float("inf"), dict(low=0), "p must be a finite number in [0, inf), got p=inf"),
    (-1, dict(low=0), "p must be a finite number in [0, inf), got p=-1"),
    (2, dict(high=1), "p must be a finite number in (-inf, 1], got p=2"),
    (np.float32("nan"), dict(), "p must be a finite number, got p="),
    (-float("inf"), dict(), "p must be a finite number, got p=-inf"),
    (True, dict(low=0, high=1), "p must be a number in [0, 1], got p=True"),
    ("0.5", dict(low=0, high=1), "p must be a number in [0, 1], got p='0.5'"),
    (None, dict(), "p must be a finite number, got p=None"),
    (10**400, dict(), "p must be a finite number, got p=1000"),  # too large for a float
])
def test_check_float_refuses(value, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_float("p", value, **kwargs)


def test_check_float_bounds_are_included_unless_open():
    assert check_float("b", 0, 0, 1) == 0.0
    assert check_float("b", 1, 0, 1) == 1.0
    assert check_float("x", -1e300) == -1e300
    with pytest.raises(ValueError, match=r"b must be a finite number in \(0, 1\]"):
        check_float("b", 0, 0, 1, low_open=True)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_check_bool_takes_bools(value):
    out = check_bool("flag", value)
    assert out == bool(value) and type(out) is bool


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.int8(1), 1.0])
def test_check_bool_refuses_non_bools(value):
    with pytest.raises(ValueError, match=re.escape(f"flag must be a bool, got flag={value!r}")):
        check_bool("flag", value)


def test_check_choice_takes_members():
    assert check_choice("impl", "xla", ("auto", "xla")) == "xla"
    assert check_choice("dtype", "int8", {"int8": 1, "float32": 4}) == "int8"
    assert check_choice("mode", np.str_("swap"), {"swap", "recompute"}) == "swap"
    assert check_choice("k", 2, [1, 2, 3]) == 2


def test_check_choice_refuses_others_and_lists_the_choices():
    with pytest.raises(ValueError, match=re.escape("impl must be one of ('auto', 'xla'), got impl='fast'")):
        check_choice("impl", "fast", ("auto", "xla"))
    # a mapping or set is shown sorted, as a list
    with pytest.raises(ValueError, match=re.escape("dtype must be one of ['float32', 'int8'], got dtype='fp7'")):
        check_choice("dtype", "fp7", {"int8": 1, "float32": 4})
    with pytest.raises(ValueError, match=re.escape("mode must be one of ['recompute', 'swap'], got mode=None")):
        check_choice("mode", None, {"swap", "recompute"})
    # an unhashable value is refused, not a TypeError
    with pytest.raises(ValueError, match=re.escape("dtype must be one of ['int8'], got dtype=['int8']")):
        check_choice("dtype", ["int8"], {"int8": 1})


class Config:
    pass


def test_check_instance():
    config = Config()
    assert check_instance("config", config, Config) is config
    with pytest.raises(ValueError, match=re.escape("config must be a Config, got a dict")):
        check_instance("config", {}, Config)
    with pytest.raises(ValueError, match=re.escape("model must be a models.llama.Llama, got an int")):
        check_instance("model", 3, Config, what="models.llama.Llama")
    with pytest.raises(ValueError, match=re.escape("config must be an EngineConfig, got a NoneType")):
        check_instance("config", None, Config, what="EngineConfig")


def test_predicates_match_the_checks():
    values = [0, 1, -1, 2**31, True, np.bool_(False), np.int16(4), 0.5, np.float32(2.0), math.nan, math.inf,
              "1", None, 10**400]
    for v in values:
        assert is_int(v, 0, 2**31) == _passes(check_int, v, 0, 2**31)
        assert is_float(v, 0, 1, low_open=True) == _passes(check_float, v, 0, 1, low_open=True)
    assert is_int(-(10**20)) and not is_int(1.0)
    assert is_float(7) and not is_float(math.nan) and not is_float(True)


def _passes(check, *args, **kwargs) -> bool:
    try:
        check("x", *args, **kwargs)
    except ValueError:
        return False
    return True


def test_check_array_names_shape_and_dtype():
    from paged_jax.checks import check_array

    assert check_array("x", np.zeros((2, 3), np.int32), (2, 3)).shape == (2, 3)
    assert check_array("p", np.zeros(4, np.float32), (4,), "float").dtype == np.float32
    for value, kind, needle in ((np.zeros(3, bool), "int", r"must be an integer array of shape \(3,\), got bool\[3\]"),
                                (np.zeros(3, np.float32), "int", r"got float32\[3\]"),
                                (np.zeros(2, np.int32), "int", r"of shape \(3,\), got int32\[2\]"),
                                ([1, 2, 3], "int", "got a list"),
                                (np.zeros(3, np.int32), "float", "x must be a float array")):
        with pytest.raises(ValueError, match=needle):
            check_array("x", value, (3,), kind)
