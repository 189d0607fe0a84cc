"""The serving comparison's policies: a KV reservation policy
(``EngineConfig.reservation``, paper section 6.1), optionally with
automatic prefix caching turned off.

A policy name is a reservation (:data:`POLICIES`: ``paged`` is vLLM,
``max``, ``pow2`` and ``oracle`` the paper's Orca baselines), which keeps
the comparison's prefix-caching setting (on unless ``--no-prefix-caching``),
or a reservation with :data:`NO_CACHE` appended (``paged-nocache``), which
always serves without the prefix cache. The paper's Figure 16 needs both in
one sweep: vLLM sharing the few-shot prefix against Orca-Oracle, which
shares nothing; ``paged-nocache`` separates what paging gains from what
sharing gains.
"""

from __future__ import annotations

from paged_jax.config import RESERVATIONS

POLICIES = RESERVATIONS
"""The reservation policies: ``paged``, ``max``, ``pow2``, ``oracle``."""
NO_CACHE = "-nocache"
"""Appended to a reservation policy: the same policy without prefix caching."""
ALL_POLICIES = POLICIES + tuple(p + NO_CACHE for p in POLICIES)
"""Every policy name a comparison accepts."""
_BASE_LABELS = {"paged": "paged (vLLM)", "max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}
POLICY_LABELS = {**_BASE_LABELS, **{p + NO_CACHE: f"{_BASE_LABELS[p]}, no prefix cache" for p in POLICIES}}
"""Each policy's name in tables and plots (the paper's names for the
reservation policies)."""


def split_policy(policy: str) -> tuple[str, bool]:
    """``(reservation, prefix caching allowed)`` of a policy name:
    ``"oracle-nocache"`` -> ``("oracle", False)``, ``"paged"`` ->
    ``("paged", True)``.

    Raises:
      ValueError: ``policy`` is not one of :data:`ALL_POLICIES`.
    """
    if not isinstance(policy, str) or policy not in ALL_POLICIES:
        raise ValueError(f"policy must be a reservation policy (one of {list(POLICIES)}), optionally followed by "
                         f"{NO_CACHE!r}, got policy={policy!r}")
    if policy.endswith(NO_CACHE):
        return policy[: -len(NO_CACHE)], False
    return policy, True
