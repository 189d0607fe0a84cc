"""Test set-up: 8 fake CPU devices for sharding tests, f32 matmuls at full precision."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. Each XLA CPU
    executable holds memory mappings; the whole suite compiled in one
    process passes Linux's limit of 65,530 per process
    (``vm.max_map_count``), and XLA then crashes in the next compilation."""
    yield
    jax.clear_caches()
    gc.collect()


SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")


def _slow_nodes() -> dict[str, float]:
    """tests/slow.txt: node id -> the seconds it was measured at. A ``#``
    starts a comment (a whole line or a line's end).

    Raises:
      pytest.UsageError: the file is missing or unreadable, or a line is
        not ``<seconds> <node id>``; names the file, the line and its text.
    """
    nodes = {}
    try:
        with open(SLOW_LIST, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise pytest.UsageError(f"{SLOW_LIST}: cannot read the list of slow tests ({e})") from e
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        fields = text.split()
        try:
            seconds = float(fields[0])
        except ValueError:
            seconds = None
        if len(fields) != 2 or seconds is None or "::" not in fields[1]:
            raise pytest.UsageError(f"{SLOW_LIST}:{number}: expected '<seconds> <node id>', got {line!r}")
        nodes[fields[1]] = seconds
    return nodes


def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in tests/slow.txt ``slow`` (its header says
    why), and warns about listed ids that a whole-suite collection did not
    find (a renamed test or parameter would otherwise silently rejoin the
    default run)."""
    nodes = _slow_nodes()
    for item in items:
        if item.nodeid in nodes:
            item.add_marker(pytest.mark.slow)
    whole = not config.args or [os.path.normpath(a) for a in config.args] in (["tests"], ["."])
    missing = sorted(set(nodes) - {item.nodeid for item in items})
    if whole and missing and not config.getoption("keyword"):
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"tests/slow.txt lists {len(missing)} test(s) that were not collected: {missing[:5]}"), stacklevel=2)
