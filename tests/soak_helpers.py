"""Measuring what a long-lived engine or server holds: the size of every container reachable from it."""

from __future__ import annotations

import collections

PROJECT = ("paged_jax", "server", "models")


def container_sizes(root, name: str = "root", max_depth: int = 8) -> dict[str, int]:
    """``{path: size}`` of every list, tuple, dict, set and deque reachable from ``root`` through the
    attributes of the project's own objects (and the containers holding them). A container's elements share
    one path (``path[]``) and the largest size found there counts, so two snapshots compare path by path
    however many elements each held."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()

    def own(obj) -> bool:
        return type(obj).__module__.split(".")[0] in PROJECT

    def walk(obj, path: str, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque, dict)):
            sizes[path] = max(sizes.get(path, 0), len(obj))
            for item in (obj.values() if isinstance(obj, dict) else obj):
                if own(item) or isinstance(item, (list, tuple, set, collections.deque, dict)):
                    walk(item, path + "[]", depth + 1)
        elif own(obj):
            fields = getattr(obj, "__dict__", None) or {s: getattr(obj, s, None) for s in getattr(obj, "__slots__", ())}
            for key, value in fields.items():
                walk(value, f"{path}.{key}", depth + 1)

    walk(root, name, 0)
    return sizes


def grown(before: dict[str, int], after: dict[str, int], slack: int = 0) -> dict[str, tuple[int, int]]:
    """Paths whose container holds more than ``slack`` more items after than before (new paths count from 0)."""
    return {p: (before.get(p, 0), n) for p, n in after.items() if n > before.get(p, 0) + slack}
