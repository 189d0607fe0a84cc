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
