"""Figures (matplotlib, Agg, PNG): the layout diagram, the declared-maximum sweep,
the waste breakdown, the block-size curves, Figure 14's summary and a
deployment plan.

``python -m experiments.memory.reproduce`` draws the first four; ``python -m
experiments.memory.figures`` the first two alone. The layout diagram is drawn
from the real page allocator: four requests take pages from one pool in turn
(prompt first, then one token per step), so the bottom half shows the
interleaving a running server produces.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from paged_jax.memory import paged_slots  # noqa: E402
from paged_jax.paging import page_state  # noqa: E402

DIAGRAM_LENGTHS = (70, 23, 150, 41)
"""Final lengths (tokens) of the diagram's four requests."""

COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
CATEGORY_COLORS = {
    "token states": "#4C72B0",
    "reserved": "#8DA0CB",
    "internal fragmentation": "#FC8D62",
    "external fragmentation": "#E5C494",
}


def paged_layout(lengths: Sequence[int], page_size: int) -> tuple[np.ndarray, int]:
    """Runs the page allocator for the diagram: every request allocates its
    first half (the prompt), then all grow one token per step until each
    reaches its length.

    Returns:
      ``(block_tables, num_pages)``: i32[len(lengths), max_pages] page ids
      (``NULL_PAGE`` past each request's pages) and the pool size used.
    """
    n = len(lengths)
    max_pages = -(-max(lengths) // page_size)
    num_pages = int(paged_slots(lengths, page_size).sum() // page_size) + 1
    state = page_state.init_page_state(
        num_pages=num_pages, max_seqs=n, max_pages_per_seq=max_pages, page_size=page_size
    )
    lengths = np.asarray(lengths)
    prompts = np.maximum(lengths // 2, 1)
    for i, p in enumerate(prompts):
        state, ok = page_state.allocate(state, np.int32(i), np.int32(p))
        assert bool(ok)
    lens = prompts.copy()
    while (lens < lengths).any():
        active = lens < lengths
        state, ok, _, _ = page_state.append(state, active)
        assert bool(ok)
        lens = lens + active
    return np.asarray(state.block_tables), num_pages


def plot_layout(
    path: pathlib.Path,
    *,
    lengths: Sequence[int] = DIAGRAM_LENGTHS,
    declared_max: int = 256,
    page_size: int = 16,
) -> None:
    """Top: contiguous layout, each request reserving ``declared_max`` slots,
    its unused reservation hatched. Bottom: the same requests in pages of
    ``page_size`` from one shared pool."""
    if declared_max < max(lengths):
        raise ValueError(f"declared_max must cover every length, got {declared_max=} and {max(lengths)}")
    n = len(lengths)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.2), height_ratios=(1, 1.5))

    total = n * declared_max
    for i, length in enumerate(lengths):
        x0 = i * declared_max
        top.add_patch(Rectangle((x0, 0), length, 1, color=COLORS[i]))
        top.add_patch(
            Rectangle((x0 + length, 0), declared_max - length, 1, facecolor="#EEEEEE",
                      edgecolor="#999999", hatch="//", linewidth=0.5)
        )
        top.add_patch(Rectangle((x0, 0), declared_max, 1, fill=False, edgecolor="black", linewidth=1.2))
        top.text(x0 + declared_max / 2, 1.12, f"request {i}: {length} used / {declared_max} reserved",
                 ha="center", fontsize=8)
    used = sum(lengths)
    top.set_xlim(0, total)
    top.set_ylim(-0.1, 1.4)
    top.set_yticks([])
    top.set_xlabel("KV slots (tokens), one contiguous address space")
    top.set_title(
        f"Contiguous: each request reserves its declared maximum ({declared_max} tokens): "
        f"{total} slots held, {used} hold tokens ({used / total:.0%}); hatched = dead space",
        fontsize=9,
    )

    tables, num_pages = paged_layout(lengths, page_size)
    owner = np.full(num_pages, -1)
    fill = np.zeros(num_pages)
    for i, length in enumerate(lengths):
        pages = -(-length // page_size)
        for j in range(pages):
            p = int(tables[i, j])
            owner[p] = i
            fill[p] = min(page_size, length - j * page_size) / page_size
    cols = 12
    rows = -(-(num_pages - 1) // cols)
    for p in range(1, num_pages):
        r, c = divmod(p - 1, cols)
        y = rows - 1 - r
        bottom.add_patch(Rectangle((c, y), 0.92, 0.85, fill=False, edgecolor="black", linewidth=0.8))
        if owner[p] >= 0:
            bottom.add_patch(Rectangle((c, y), 0.92 * fill[p], 0.85, color=COLORS[owner[p]]))
            if fill[p] < 1:
                bottom.add_patch(
                    Rectangle((c + 0.92 * fill[p], y), 0.92 * (1 - fill[p]), 0.85, facecolor="#EEEEEE",
                              edgecolor="#999999", hatch="//", linewidth=0.5)
                )
        bottom.text(c + 0.46, y + 0.42, str(p), ha="center", va="center", fontsize=7, color="white"
                    if owner[p] >= 0 and fill[p] > 0.5 else "black")
    held = int(paged_slots(lengths, page_size).sum())
    bottom.set_xlim(-0.1, cols)
    bottom.set_ylim(-0.1, rows)
    bottom.set_xticks([])
    bottom.set_yticks([])
    bottom.set_title(
        f"Paged: pages of {page_size} tokens from one shared pool (page ids as the allocator handed them out): "
        f"{held} slots held, {used} hold tokens ({used / held:.0%})",
        fontsize=9,
    )
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[i]) for i in range(n)]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="#EEEEEE", edgecolor="#999999", hatch="//"))
    fig.legend(handles, [f"request {i}" for i in range(n)] + ["reserved, unfilled"],
               loc="lower center", ncol=n + 1, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_declared_max_sweep(
    path: pathlib.Path,
    *,
    lengths: Sequence[int] = DIAGRAM_LENGTHS,
    page_size: int = 16,
    declared: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192),
) -> None:
    """Memory held by the diagram's requests versus the declared maximum:
    contiguous grows linearly without bound, paged stays flat."""
    declared = np.asarray(declared)
    used = sum(lengths)
    contiguous = len(lengths) * declared
    paged = np.full_like(declared, int(paged_slots(lengths, page_size).sum()))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(declared, contiguous, "o-", label="contiguous (reserve declared max)")
    ax.plot(declared, paged, "s-", label=f"paged (page {page_size})")
    ax.axhline(used, color="gray", linestyle="--", label=f"token states ({used})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("declared maximum per request (tokens)")
    ax.set_ylabel("KV slots held (tokens)")
    ax.set_title(f"{len(lengths)} requests of {', '.join(map(str, lengths))} tokens", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_waste_breakdown(path: pathlib.Path, rows: Sequence[dict]) -> None:
    """Stacked bars: share of KV memory in use per category, per scheme.

    Args:
      rows: dicts with ``scheme``, the four category shares (keys of
        :data:`CATEGORY_COLORS`, fractions) and ``paper token states``.
    """
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for cat, color in CATEGORY_COLORS.items():
        vals = np.array([r[cat] for r in rows]) * 100
        ax.bar(x, vals, bottom=bottom, color=color, label=cat, width=0.6)
        bottom += vals
    for i, r in enumerate(rows):
        ax.text(i, r["token states"] * 50, f"{r['token states']:.1%}", ha="center", color="white", fontsize=9)
        paper = r.get("paper token states")
        if paper is not None:
            ax.plot([i - 0.3, i + 0.3], [paper * 100] * 2, color="black", linewidth=2)
    ax.plot([], [], color="black", linewidth=2, label="paper: token states (Fig. 2)")
    ax.set_xticks(x, [r["scheme"] for r in rows])
    ax.set_ylabel("share of KV memory in use (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Where KV memory goes (simulation over ShareGPT lengths, Poisson arrivals)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_block_size(path: pathlib.Path, rows: Sequence[dict]) -> None:
    """Token-state share versus page size (simulation and the final-length
    bound) and, where measured, SmolLM2 serving throughput.

    Args:
      rows: dicts with ``page size``, ``token states`` (simulation),
        ``bound`` (final lengths) and optionally ``tokens/s``.
    """
    sizes = [r["page size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(sizes, [r["token states"] * 100 for r in rows], "o-", label="token states, simulation")
    ax.plot(sizes, [r["bound"] * 100 for r in rows], "s--", label="token states, final lengths (bound)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (tokens)")
    ax.set_ylabel("token-state share (%)")
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    tput = [r.get("tokens/s") for r in rows]
    if any(t is not None for t in tput):
        ax2 = ax.twinx()
        pts = [(s, t) for s, t in zip(sizes, tput) if t is not None]
        ax2.plot(*zip(*pts), "^:", color="#C44E52", label="SmolLM2 tokens/s (CPU)")
        ax2.set_ylabel("tokens/s")
        l2, lab2 = ax2.get_legend_handles_labels()
        lines, labels = lines + l2, labels + lab2
    ax.legend(lines, labels, fontsize=8, loc="lower left")
    ax.set_title("Block-size ablation", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_sharing_workloads(path: pathlib.Path, rows: Sequence[dict], *, paper_over_oracle: dict[str, float],
                           paper_saving: dict[str, tuple[float, float, float, float]]) -> None:
    """Figure 14 summarized (:mod:`experiments.serving.serving_fig14`): left, paged's
    requests served per second over each baseline's at the highest rate
    swept, against the sequences per request, one line per (baseline,
    parallel / beam), the paper's vLLM / Orca (Oracle) as stars; right, KV
    saved by sharing (paged), the paper's Figure 15 ranges shaded.

    Args:
      rows: dicts with ``workload`` (``parallel-N``, ``beam-W``),
        ``sequences``, ``policy``, ``served_at_top`` (req/s) and
        ``kv_saved_by_sharing`` (``"41.6%"``).
      paper_over_oracle: workload -> the paper's ratio (``basic`` drawn at
        one sequence).
      paper_saving: ``parallel`` / ``beam`` -> (Alpaca low, high, ShareGPT
        low, high), percent.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    kinds = [k for k in ("parallel", "beam") if any(r["workload"].startswith(k + "-") for r in rows)]
    for i, kind in enumerate(kinds):
        mine = [r for r in rows if r["workload"].startswith(kind + "-")]
        paged = {r["sequences"]: r["served_at_top"] for r in mine if r["policy"] == "paged"}
        for j, policy in enumerate(dict.fromkeys(r["policy"] for r in mine if r["policy"] != "paged")):
            pts = sorted((r["sequences"], paged[r["sequences"]] / r["served_at_top"]) for r in mine
                         if r["policy"] == policy and r["served_at_top"])
            left.plot(*zip(*pts), ("-", "--")[i] + "os^"[j % 3], color=COLORS[j],
                      label=f"{kind}: paged / {policy}")
        saved = sorted((r["sequences"], float(r["kv_saved_by_sharing"].rstrip("%"))) for r in mine
                       if r["policy"] == "paged")
        right.plot(*zip(*saved), ("o-", "s--")[i], color=COLORS[i], label=f"{kind}, measured (paged)")
        lo_a, hi_a, lo_s, hi_s = paper_saving[kind]
        right.axhspan(lo_s, hi_s, color=COLORS[i], alpha=0.12, label=f"{kind}, paper ShareGPT {lo_s:g}-{hi_s:g}%")
        right.axhspan(lo_a, hi_a, color=COLORS[i], alpha=0.25, hatch="//",
                      label=f"{kind}, paper Alpaca {lo_a:g}-{hi_a:g}%")
    for name, value in paper_over_oracle.items():
        k = 1 if name == "basic" else int(name.partition("-")[2])
        left.plot([k], [value], "*", color="black", markersize=11)
        left.annotate(f"paper {name}: {value:g}x", (k, value), textcoords="offset points", xytext=(5, 4), fontsize=7)
    for ax in (left, right):
        ax.set_xlim(0.5, 6.5)
    left.axhline(1, color="gray", linewidth=0.8)
    left.set_xlabel("sequences per request (n or beam width)")
    left.set_ylabel("paged / policy, requests served at the top rate")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    left.set_title("Throughput over the Orca baselines (stars: paper, vs Oracle)", fontsize=9)
    right.set_xlabel("sequences per request (n or beam width)")
    right.set_ylabel("KV saved by sharing (%)")
    right.set_ylim(0, 100)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    right.set_title("KV memory saved by sharing (paper: Figure 15)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_plan(path: pathlib.Path, by_fraction: Sequence[dict], by_page: Sequence[dict], *, title: str) -> None:
    """A deployment plan (:mod:`experiments.simulator.plan`): the rate one
    replica sustains under the SLOs against the cache fraction (left) and
    the page size (right), KV tokens on a second axis.

    Args:
      by_fraction, by_page: rows with ``cache_fraction``, ``page_size``,
        ``sustained_rate`` (req/s) and ``kv_tokens``.
    """
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, rows, key, label in ((axes[0], by_fraction, "cache_fraction", "cache fraction (share of memory)"),
                                 (axes[1], by_page, "page_size", "page size (tokens)")):
        xs = [r[key] for r in rows]
        ax.plot(xs, [r["sustained_rate"] for r in rows], "o-", color=COLORS[0], label="sustained rate")
        ax.set_xlabel(label)
        ax.set_ylabel("sustained rate (req/s)", color=COLORS[0])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if key == "page_size":
            ax.set_xscale("log", base=2)
        ax2 = ax.twinx()
        ax2.plot(xs, [r["kv_tokens"] for r in rows], "s:", color=COLORS[1])
        ax2.set_ylabel("KV tokens", color=COLORS[1])
        ax2.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_host_tier(path: pathlib.Path, rows: Sequence[dict], *, title: str) -> None:
    """The KV tiers' benchmark (:mod:`experiments.serving.kv_tiers`): prefix
    hit rate (left axis) and TTFT p50 of the turns after the first (right
    axis) against the host tier's size, in multiples of the working set's
    K/V; ``rows`` hold ``host_over_working_set``, ``hit_rate``,
    ``later_ttft_p50_ms``."""
    x = [r["host_over_working_set"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(x, [r["hit_rate"] for r in rows], "o-", color=COLORS[0], label="prefix hit rate")
    ax.set_xlabel("host tier size / working set's K/V")
    ax.set_ylabel("prefix hit rate", color=COLORS[0])
    ax.set_ylim(0, 1)
    right = ax.twinx()
    right.plot(x, [r["later_ttft_p50_ms"] for r in rows], "s--", color=COLORS[1], label="TTFT p50, turns 2+")
    right.set_ylabel("TTFT p50 of turns 2+ (ms)", color=COLORS[1])
    right.set_ylim(0, None)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
