"""The seed's layout diagram, draggable: one self-contained HTML page.

    python -m experiments.memory.diagram                      # writes docs/diagram/index.html
    python -m experiments.memory.diagram --out DIR --screenshot

Four requests of fixed final lengths (:data:`experiments.lib.plots.DIAGRAM_LENGTHS`,
70, 23, 150 and 41 tokens) are laid out twice. Top: each reserves one
contiguous run of the *declared maximum* D slots, so ``D - used`` slots per
request are dead space. Bottom: the same requests in pages of ``page_size``
slots from one shared pool, which waste only the unused slots of each
request's last page. A slider sets D; a select box picks the model preset
whose KV shapes turn slots into bytes.

Why the page carries a table and not the maths: every number it shows is
computed here, by :mod:`paged_jax.memory` (``contiguous_waste``,
``paged_slots``, ``paged_waste``, ``token_state_share``, ``kv_bytes``,
``sequence_kv_bytes``), for every slider position and every preset of
:data:`paged_jax.memory.PRESETS`, and embedded as JSON; the page's
JavaScript only looks numbers up, formats them and draws. The page ids of
the bottom half come from the real page allocator
(:func:`experiments.lib.plots.paged_layout`), as in ``results/layout.png``. So
the page cannot drift from the Python maths, and ``tests/test_diagram.py``
checks in headless Chromium that it does not.

The page loads nothing (no server, no CDN, no network): CSS, JavaScript and
SVG are inline. ``--screenshot`` also writes ``screenshot.png`` beside it,
taken by headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
``make browser``) through ``selenium`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
import pathlib
import shutil

import numpy as np

from experiments.lib.cli import add_flag, check_flags, check_out_dir, require_positive
from experiments.lib.plots import COLORS, DIAGRAM_LENGTHS, paged_layout
from experiments.lib.provenance import REPO
from paged_jax.checks import check_choice, check_int
from paged_jax.memory import (
    DTYPE_BYTES,
    PRESETS,
    contiguous_waste,
    paged_slots,
    paged_waste,
    token_state_share,
)
from paged_jax.paging.page_state import NULL_PAGE

DEFAULT_OUT = REPO / "docs" / "diagram"
"""Where ``python -m experiments.memory.diagram`` writes ``index.html`` by default."""

KV_DTYPES = tuple(d for d in DTYPE_BYTES if d != "int4")
"""KV dtypes the page can be sized in (``int4`` is for weights only)."""

MAX_POSITIONS = 5000
"""Most slider positions a page may carry: each costs two integers per preset
in the embedded JSON, so this keeps the page under about 1.5 MB."""

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"
"""Executables of Debian's ``chromium`` and ``chromium-driver`` packages."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagramSpec:
    """What one page shows.

    Attributes:
      lengths: final length of each request, tokens (>= 1 each; at most
        ``len(COLORS)`` requests, one colour each).
      page_size: tokens per page (>= 1).
      min_declared: the slider's lowest declared maximum, tokens; None: the
        longest request (a reservation must cover its request).
      max_declared: the slider's highest declared maximum, tokens; it also
        fixes the drawing's scale (a request reserving it spans the width).
      step: tokens between slider positions: the positions are
        ``min_declared``, every multiple of ``step`` above it, and
        ``max_declared``.
      declared: the position the slider starts at (one of the positions).
      preset: the preset the select box starts at (a key of ``PRESETS``).
      kv_dtype: KV element dtype the bytes are counted in (a key of
        ``DTYPE_BYTES`` other than ``int4``).

    Raises:
      ValueError: a field out of range or not one of its choices, naming it
        and its value; ``declared`` not a slider position; more than
        :data:`MAX_POSITIONS` positions.
    """

    lengths: tuple[int, ...] = DIAGRAM_LENGTHS
    page_size: int = 16
    min_declared: int | None = None
    max_declared: int = 2048
    step: int = 8
    declared: int = 256
    preset: str = "llama-3-8b"
    kv_dtype: str = "bfloat16"

    def __post_init__(self):
        if not isinstance(self.lengths, tuple) or not 1 <= len(self.lengths) <= len(COLORS):
            raise ValueError(f"lengths must be a tuple of 1 to {len(COLORS)} ints, got lengths={self.lengths!r}")
        for i, n in enumerate(self.lengths):
            check_int(f"lengths[{i}]", n, 1)
        check_int("page_size", self.page_size, 1)
        check_int("step", self.step, 1)
        longest = max(self.lengths)
        if self.min_declared is not None:
            check_int("min_declared", self.min_declared, longest)
        check_int("max_declared", self.max_declared, self.low)
        check_choice("preset", self.preset, PRESETS)
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        if len(self.positions) > MAX_POSITIONS:
            raise ValueError(f"the slider may have at most {MAX_POSITIONS} positions, got {len(self.positions)} "
                             f"from min_declared={self.low} max_declared={self.max_declared} step={self.step}")
        if self.declared not in self.positions:
            raise ValueError(f"declared must be a slider position ({self.low}, a multiple of step={self.step}, or "
                             f"{self.max_declared}), got declared={self.declared!r}")

    @property
    def low(self) -> int:
        """The slider's lowest declared maximum, tokens."""
        return max(self.lengths) if self.min_declared is None else self.min_declared

    @property
    def positions(self) -> tuple[int, ...]:
        """Declared maxima of the slider's positions, ascending, tokens."""
        first = -(-self.low // self.step) * self.step
        return tuple(sorted({self.low, *range(first, self.max_declared + 1, self.step), self.max_declared}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolPage:
    """One page of the shared pool after the four requests ran.

    Attributes:
      page: page id (``NULL_PAGE`` is the padding page, never allocated).
      owner: index of the request holding it; -1 free or the null page.
      used: slots of it holding a token, in ``[0, page_size]``.
    """

    page: int
    owner: int
    used: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PresetBytes:
    """One preset's bytes: per slider position for the contiguous layout,
    once for the paged one (paging does not depend on the declared maximum).

    Attributes:
      label: the select box's text.
      source: where the preset's numbers come from.
      kv_bytes_per_token: bytes of one slot, all layers.
      reserved_bytes: i64[positions] ``kv_bytes(len(lengths) * D)``.
      dead_bytes: i64[positions] ``kv_bytes(sum(D - used))``.
      used_bytes: ``kv_bytes(sum(used))``.
      paged_held_bytes: ``sum(sequence_kv_bytes(used, hybrid_aware=False))``:
        every layer keeps each page, as drawn.
      paged_unused_bytes: ``kv_bytes(sum(paged_waste(used)))``.
      hybrid_aware_bytes: for a model with sliding layers,
        ``sum(sequence_kv_bytes(used, hybrid_aware=True))``, what a manager
        that frees out-of-window pages holds; None otherwise.
      hybrid_note: how the layers slide (for the page), "" if none do.
    """

    label: str
    source: str
    kv_bytes_per_token: int
    reserved_bytes: list[int]
    dead_bytes: list[int]
    used_bytes: int
    paged_held_bytes: int
    paged_unused_bytes: int
    hybrid_aware_bytes: int | None
    hybrid_note: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagramData:
    """Every number the page shows, R requests and X slider positions. The
    page's JSON is ``dataclasses.asdict`` of this.

    Attributes:
      lengths: i64[R] tokens each request ends with (its used slots).
      colors: R CSS colours, one per request.
      page_size: tokens per page.
      kv_dtype: dtype the bytes are counted in.
      declared: i64[X] declared maximum per slider position, tokens.
      start: index of the slider's first position.
      preset: the select box's first preset.
      dead: i64[X, R] ``D - used`` per position and request (``contiguous_waste``).
      reserved_slots: i64[X] ``R * D``.
      dead_slots: i64[X] sum of ``dead``.
      contiguous_share: f64[X] used / reserved (``token_state_share``).
      ratio: f64[X] contiguous reserved slots / paged held slots.
      pages: i64[R] pages each request holds.
      held: i64[R] slots each holds under paging (``paged_slots``).
      unused: i64[R] unfilled slots of its last page (``paged_waste``).
      pages_total, held_total, unused_total: the sums of ``pages``, ``held``
        and ``unused``.
      block_tables: i64[R, max pages] page ids each request holds, in order,
        from the real allocator (``paged_layout``), trimmed to its pages.
      pool: every page of the pool, by id.
      paged_share: used / held under paging.
      presets: preset name -> its bytes, in ``PRESETS`` order.
    """

    lengths: list[int]
    colors: list[str]
    page_size: int
    kv_dtype: str
    declared: list[int]
    start: int
    preset: str
    dead: list[list[int]]
    reserved_slots: list[int]
    dead_slots: list[int]
    contiguous_share: list[float]
    ratio: list[float]
    pages: list[int]
    held: list[int]
    unused: list[int]
    pages_total: int
    held_total: int
    unused_total: int
    block_tables: list[list[int]]
    pool: list[PoolPage]
    paged_share: float
    presets: dict[str, PresetBytes]


def preset_bytes(name: str, spec: DiagramSpec) -> PresetBytes:
    """The bytes of preset ``name`` for every position of ``spec``.

    Raises:
      ValueError: ``name`` not a key of ``PRESETS``.
    """
    model = PRESETS[check_choice("name", name, PRESETS)]
    used = list(spec.lengths)
    n, dtype = len(used), spec.kv_dtype
    hybrid = None
    note = ""
    if model.is_hybrid:
        hybrid = sum(model.sequence_kv_bytes(u, page_size=spec.page_size, dtype=dtype, hybrid_aware=True)
                     for u in used)
        note = (f"{model.num_sliding_layers} of {model.num_layers} layers attend a sliding window of "
                f"{model.sliding_window:,} tokens")
    return PresetBytes(
        label=f"{name} ({model.kv_bytes_per_token(dtype):,} B per token)",
        source=model.source,
        kv_bytes_per_token=model.kv_bytes_per_token(dtype),
        reserved_bytes=[model.kv_bytes(n * d, dtype) for d in spec.positions],
        dead_bytes=[model.kv_bytes(int(contiguous_waste(used, d).sum()), dtype) for d in spec.positions],
        used_bytes=model.kv_bytes(sum(used), dtype),
        paged_held_bytes=sum(model.sequence_kv_bytes(u, page_size=spec.page_size, dtype=dtype, hybrid_aware=False)
                             for u in used),
        paged_unused_bytes=model.kv_bytes(int(paged_waste(used, spec.page_size).sum()), dtype),
        hybrid_aware_bytes=hybrid,
        hybrid_note=note,
    )


def diagram_data(spec: DiagramSpec) -> DiagramData:
    """Computes every number of the page (:class:`DiagramData`): the
    contiguous layout at each slider position, the paged layout once (from
    the real allocator, so its page ids interleave as a server's do), the
    bytes for every preset. Takes about a second (the allocator runs in JAX)."""
    used = np.asarray(spec.lengths, np.int64)  # i64[R]
    declared = spec.positions
    dead = [contiguous_waste(used, d) for d in declared]  # X x i64[R]
    held = paged_slots(used, spec.page_size)  # i64[R]
    pages = held // spec.page_size
    unused = paged_waste(used, spec.page_size)  # i64[R]
    tables, num_pages = paged_layout(list(spec.lengths), spec.page_size)  # i32[R, max pages]
    owner = {int(tables[r, j]): (r, min(spec.page_size, int(used[r]) - j * spec.page_size))
             for r in range(len(used)) for j in range(int(pages[r]))}
    pool = [PoolPage(page=p, owner=owner.get(p, (-1, 0))[0], used=owner.get(p, (-1, 0))[1])
            for p in range(num_pages)]
    assert pool[NULL_PAGE].owner == -1, "the allocator handed out the null page"
    return DiagramData(
        lengths=used.tolist(),
        colors=list(COLORS[: len(used)]),
        page_size=spec.page_size,
        kv_dtype=spec.kv_dtype,
        declared=list(declared),
        start=declared.index(spec.declared),
        preset=spec.preset,
        dead=[d.tolist() for d in dead],
        reserved_slots=[len(used) * d for d in declared],
        dead_slots=[int(d.sum()) for d in dead],
        contiguous_share=[token_state_share(used, np.full_like(used, d)) for d in declared],
        ratio=[len(used) * d / int(held.sum()) for d in declared],
        pages=pages.tolist(),
        held=held.tolist(),
        unused=unused.tolist(),
        pages_total=int(pages.sum()),
        held_total=int(held.sum()),
        unused_total=int(unused.sum()),
        block_tables=[tables[r, : int(pages[r])].tolist() for r in range(len(used))],
        pool=pool,
        paged_share=token_state_share(used, held),
        presets={name: preset_bytes(name, spec) for name in PRESETS},
    )


def render_page(data: DiagramData) -> str:
    """The HTML page for ``data``: one string, nothing it loads from anywhere."""
    payload = json.dumps(dataclasses.asdict(data), separators=(",", ":")).replace("</", "<\\/")
    options = "\n".join(
        f'      <option value="{html.escape(name)}"{" selected" if name == data.preset else ""}>'
        f"{html.escape(p.label)}</option>"
        for name, p in data.presets.items()
    )
    rows = "\n".join(
        f'        <tr data-request="{r}"><th scope="row"><span class="swatch" style="background:{c}"></span>'
        f'request {r}</th><td class="used">{u:,}</td><td class="reserved"></td><td class="dead"></td></tr>'
        for r, (u, c) in enumerate(zip(data.lengths, data.colors))
    )
    paged_rows = "\n".join(
        f'        <tr data-request="{r}"><th scope="row"><span class="swatch" style="background:{c}"></span>'
        f'request {r}</th><td class="used">{u:,}</td><td class="pages">{p:,}</td><td class="held">{h:,}</td>'
        f'<td class="unused">{w:,}</td><td class="ids">{", ".join(map(str, ids))}</td></tr>'
        for r, (u, c, p, h, w, ids) in enumerate(
            zip(data.lengths, data.colors, data.pages, data.held, data.unused, data.block_tables))
    )
    lo, hi = data.declared[0], data.declared[-1]
    return (_TEMPLATE.replace("@OPTIONS@", options).replace("@ROWS@", rows).replace("@PAGED_ROWS@", paged_rows)
            .replace("@LAST@", str(len(data.declared) - 1)).replace("@START@", str(data.start))
            .replace("@LO@", f"{lo:,}").replace("@HI@", f"{hi:,}").replace("@PAGE@", str(data.page_size))
            .replace("@DTYPE@", data.kv_dtype).replace("@N@", str(len(data.lengths)))
            .replace("@USED@", f"{sum(data.lengths):,}").replace("@DATA@", payload))


def write_page(out: pathlib.Path, spec: DiagramSpec = DiagramSpec()) -> pathlib.Path:
    """Writes ``out/index.html`` for ``spec``; returns its path.

    Raises:
      OSError: ``out`` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(render_page(diagram_data(spec)), encoding="utf-8")
    return path


def open_chromium(*, width: int = 1100, height: int = 900):
    """A headless Chromium under selenium, its console log readable
    (``driver.get_log("browser")``), every host name unresolvable so that a
    page that reached for the network would log an error. Quit it when done.

    Selenium is imported here, not at the top, because it is an optional
    dependency (the ``test`` extra) that only this and ``--screenshot`` need.

    Raises:
      RuntimeError: ``chromium`` or ``chromedriver`` is not on the PATH
        (``make browser`` installs both).
      ImportError: selenium is not installed.
    """
    check_int("width", width, 1)
    check_int("height", height, 1)
    binary, driver_path = shutil.which(CHROMIUM), shutil.which(CHROMEDRIVER)
    if binary is None or driver_path is None:
        raise RuntimeError(f"headless Chromium needs {CHROMIUM!r} and {CHROMEDRIVER!r} on the PATH, found "
                           f"{binary!r} and {driver_path!r}: run `make browser` (apt-get install -y chromium "
                           "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--host-resolver-rules=MAP * ~NOTFOUND", "--hide-scrollbars", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # A driver path given means selenium's manager is not asked to download one.
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def save_screenshot(driver, png: pathlib.Path) -> pathlib.Path:
    """Writes a PNG of ``driver``'s whole page (not only the window's
    viewport: the viewport is first set to the page's size) to ``png``;
    returns ``png``.

    Raises:
      OSError: Chromium could not write ``png``.
    """
    width, height = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    if not driver.save_screenshot(str(png)):
        raise OSError(f"chromium could not write the screenshot {str(png)!r}")
    return png


def screenshot(page: pathlib.Path, png: pathlib.Path, *, width: int = 1100) -> pathlib.Path:
    """Opens ``page`` in headless Chromium and writes a PNG of all of it.

    Raises:
      RuntimeError: Chromium missing (:func:`open_chromium`), or the page
        logged an error to its console.
    """
    driver = open_chromium(width=width)
    try:
        driver.get(page.resolve().as_uri())
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        if errors:
            raise RuntimeError(f"{page} logged errors: {errors}")
        return save_screenshot(driver, png)
    finally:
        driver.quit()


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory.diagram", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                   help=f"folder to write index.html to (default {DEFAULT_OUT.relative_to(REPO)}/)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DIAGRAM_LENGTHS),
                   help="final length of each request, tokens (default %(default)s)")
    add_flag(p, "page_size")
    p.add_argument("--min-declared", type=int, default=None,
                   help="the slider's lowest declared maximum (default: the longest request)")
    p.add_argument("--max-declared", type=int, default=2048, help="the slider's highest (default %(default)s)")
    p.add_argument("--step", type=int, default=8, help="tokens between slider positions (default %(default)s)")
    p.add_argument("--declared", type=int, default=256, help="the slider's first position (default %(default)s)")
    p.add_argument("--preset", default="llama-3-8b", choices=list(PRESETS), help="the first preset shown")
    p.add_argument("--kv-dtype", default="bfloat16", choices=KV_DTYPES, help="KV dtype (default %(default)s)")
    p.add_argument("--screenshot", action="store_true", help="also write screenshot.png (headless Chromium)")
    args = p.parse_args(argv)
    check_flags(p, args)
    require_positive(p, args, "step", "max_declared", "declared")
    if not 1 <= len(args.lengths) <= len(COLORS) or min(args.lengths) < 1:
        p.error(f"--lengths must be 1 to {len(COLORS)} ints >= 1, got {args.lengths}")
    low = max(args.lengths) if args.min_declared is None else args.min_declared
    if low < max(args.lengths):
        p.error(f"--min-declared must cover every length (>= {max(args.lengths)}), got {args.min_declared}")
    if args.max_declared < low:
        p.error(f"--max-declared must be >= {low} (the lowest position), got {args.max_declared}")
    try:
        spec = DiagramSpec(lengths=tuple(args.lengths), page_size=args.page_size, min_declared=args.min_declared,
                           max_declared=args.max_declared, step=args.step, declared=args.declared,
                           preset=args.preset, kv_dtype=args.kv_dtype)
    except ValueError as e:  # the cross-field checks (--declared a position, the positions' count)
        p.error(str(e))
    check_out_dir(p, args.out)
    path = write_page(args.out, spec)
    print(f"wrote {path} ({path.stat().st_size:,} bytes, {len(spec.positions)} slider positions, "
          f"{len(PRESETS)} presets)")
    if args.screenshot:
        png = screenshot(path, args.out / "screenshot.png")
        print(f"wrote {png}")


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>Contiguous reservation versus pages: drag the declared maximum</title>
<style>
  body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 18px auto;
         max-width: 1060px; padding: 0 12px; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 18px 0 4px; }
  p { margin: 4px 0 8px; }
  .controls { display: flex; flex-wrap: wrap; gap: 8px 24px; align-items: center; background: #f4f4f6;
              border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; margin: 10px 0; }
  .controls label { font-weight: 600; }
  #declared-max { width: 440px; vertical-align: middle; }
  #declared-value { display: inline-block; min-width: 3.5em; font-weight: 700; text-align: right; }
  table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 4px 0; }
  th, td { padding: 2px 10px; text-align: right; border-bottom: 1px solid #e4e4e4; }
  th[scope="row"], thead th:first-child { text-align: left; }
  td.ids, th.ids { text-align: left; }
  td.ids { font-size: 12px; color: #555; }
  tfoot th, tfoot td { font-weight: 700; border-top: 2px solid #bbb; }
  .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; border-radius: 2px; }
  .bytes { margin: 6px 0; }
  .bytes b { font-variant-numeric: tabular-nums; }
  .half { border-left: 4px solid #999; padding-left: 12px; }
  .top { border-color: #C44E52; }
  .bottom { border-color: #4C72B0; }
  .note { color: #555; font-size: 12.5px; }
  #summary { font-size: 15px; font-weight: 600; }
  svg text { font: 11px system-ui, sans-serif; fill: #333; }
</style>
</head>
<body>
<h1>Contiguous reservation versus pages</h1>
<p>@N@ requests end with fixed lengths (@USED@ tokens in all). Drag the declared maximum up: the contiguous
layout (top) reserves that many slots per request and fills with dead space; the paged layout (bottom) holds
only whole pages of @PAGE@ slots and does not change. Both halves are drawn at one scale (a slot is as wide
in each). Bytes are the KV cache of the preset chosen, in @DTYPE@.</p>

<div class="controls">
  <span><label for="declared-max">declared maximum</label>
    <input type="range" id="declared-max" min="0" max="@LAST@" step="1" value="@START@"
           aria-describedby="declared-range">
    <output id="declared-value" for="declared-max"></output> tokens
    <span id="declared-range" class="note">(@LO@ to @HI@)</span></span>
  <span><label for="preset">model preset</label>
    <select id="preset">
@OPTIONS@
    </select></span>
</div>
<p id="summary">Contiguous holds <span id="ratio"></span>&times; the slots paging holds.</p>

<section class="half top" id="contiguous">
  <h2>Contiguous: each request reserves the declared maximum</h2>
  <svg id="top-svg" width="1000" height="10" role="img" aria-label="contiguous reservations"></svg>
  <table id="contiguous-table">
    <thead><tr><th>request</th><th>used</th><th>reserved</th><th>dead space</th></tr></thead>
    <tbody>
@ROWS@
    </tbody>
    <tfoot><tr><th scope="row">all</th><td id="c-used-slots">@USED@</td><td id="c-reserved-slots"></td>
      <td id="c-dead-slots"></td></tr></tfoot>
  </table>
  <p class="bytes">reserved <b id="c-reserved-bytes"></b>; used <b id="c-used-bytes"></b>;
    dead space <b id="c-dead-bytes"></b>. Token states fill <b id="c-share"></b> of the reservation.</p>
  <p class="note">Dead space is <i>declared &minus; used</i> per request: slots reserved for tokens that never
    come (the paper's internal fragmentation once a request ends; while it runs, the part ahead of it is
    reserved for its later tokens). Every layer reserves the same slots.</p>
</section>

<section class="half bottom" id="paged">
  <h2>Paged: pages of @PAGE@ slots from one shared pool</h2>
  <svg id="bottom-svg" width="1000" height="10" role="img" aria-label="pages"></svg>
  <table id="paged-table">
    <thead><tr><th>request</th><th>used</th><th>pages</th><th>held</th><th>unused in last page</th>
      <th class="ids">page ids</th></tr></thead>
    <tbody>
@PAGED_ROWS@
    </tbody>
    <tfoot><tr><th scope="row">all</th><td id="p-used-slots">@USED@</td><td id="p-pages"></td>
      <td id="p-held-slots"></td><td id="p-unused-slots"></td><td></td></tr></tfoot>
  </table>
  <p class="bytes">held <b id="p-held-bytes"></b>; unused in last pages <b id="p-unused-bytes"></b>.
    Token states fill <b id="p-share"></b> of the pages.</p>
  <p class="note" id="p-hybrid"></p>
  <p class="note">Page ids are those the real allocator (<code>paged_jax.paging.page_state</code>) handed out as the
    requests grew one token a step after their first half; page 0 is the null page, never allocated.</p>
</section>

<p class="note" id="source"></p>
<p class="note">Every number on this page was computed by <code>paged_jax.memory</code> and embedded by
<code>python -m experiments.memory.diagram</code>; the script on the page only looks them up and draws.
PagedAttention: Kwon et al., SOSP 2023.</p>

<script type="application/json" id="diagram-data">@DATA@</script>
<script>
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("diagram-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const slider = document.getElementById("declared-max");
  const select = document.getElementById("preset");
  const LEFT = 90, WIDTH = 880, ROW = 22, GAP = 8;
  const maxDeclared = DATA.declared[DATA.declared.length - 1];
  const scale = WIDTH / maxDeclared;  // px per slot, both halves
  const R = DATA.lengths.length;

  function group(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ","); }
  function human(n) {
    const units = [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"]];
    for (const [f, u] of units) if (n >= f) return (n / f).toFixed(2) + " " + u;
    return n + " B";
  }
  function bytes(n) { return group(n) + " B (" + human(n) + ")"; }
  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function setText(id, text) { document.getElementById(id).textContent = text; }

  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function defs(svg) {
    const d = el("defs", {}, svg);
    const p = el("pattern", {id: svg.id + "-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                             patternTransform: "rotate(45)"}, d);
    el("rect", {width: 6, height: 6, fill: "#eeeeee"}, p);
    el("line", {x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#999", "stroke-width": 1.5}, p);
    return "url(#" + svg.id + "-hatch)";
  }
  function clear(svg) { while (svg.firstChild) svg.removeChild(svg.firstChild); }
  function axis(svg, y) {
    el("line", {x1: LEFT, y1: y, x2: LEFT + WIDTH, y2: y, stroke: "#bbb"}, svg);
    for (const [x, anchor] of [[0, "start"], [maxDeclared, "end"]]) {
      const t = el("text", {x: LEFT + x * scale, y: y + 13, "text-anchor": anchor}, svg);
      t.textContent = group(x) + " slots";
    }
  }

  function drawTop(i) {
    const svg = document.getElementById("top-svg");
    clear(svg);
    const hatch = defs(svg);
    const D = DATA.declared[i];
    for (let r = 0; r < R; r++) {
      const y = r * (ROW + GAP), used = DATA.lengths[r];
      el("text", {x: 0, y: y + 15}, svg).textContent = "request " + r;
      el("rect", {x: LEFT, y: y, width: used * scale, height: ROW, fill: DATA.colors[r]}, svg);
      el("rect", {x: LEFT + used * scale, y: y, width: DATA.dead[i][r] * scale, height: ROW, fill: hatch}, svg);
      el("rect", {x: LEFT, y: y, width: D * scale, height: ROW, fill: "none", stroke: "#222"}, svg);
    }
    const h = R * (ROW + GAP);
    axis(svg, h);
    svg.setAttribute("height", h + 20);
  }

  function drawBottom() {
    const svg = document.getElementById("bottom-svg");
    clear(svg);
    const hatch = defs(svg);
    const L = DATA.page_size, pw = L * scale;
    for (let r = 0; r < R; r++) {
      const y = r * (ROW + GAP);
      el("text", {x: 0, y: y + 15}, svg).textContent = "request " + r;
      for (let j = 0; j < DATA.pages[r]; j++) {
        const x = LEFT + j * pw, filled = Math.min(L, DATA.lengths[r] - j * L);
        el("rect", {x: x, y: y, width: filled * scale, height: ROW, fill: DATA.colors[r]}, svg);
        if (filled < L) el("rect", {x: x + filled * scale, y: y, width: (L - filled) * scale, height: ROW,
                                    fill: hatch}, svg);
        el("rect", {x: x, y: y, width: pw, height: ROW, fill: "none", stroke: "#222", "stroke-width": 0.6}, svg);
      }
    }
    let y = R * (ROW + GAP);
    axis(svg, y);
    y += 34;
    el("text", {x: 0, y: y + 12}, svg).textContent = "pool, by id";
    el("text", {x: 0, y: y + 26}, svg).textContent = "(zoomed)";
    const box = Math.min(40, WIDTH / DATA.pool.length - 2), bh = 30;
    for (const pg of DATA.pool) {
      const x = LEFT + pg.page * (box + 2);
      if (pg.owner >= 0) {
        const w = box * pg.used / L;
        el("rect", {x: x, y: y, width: w, height: bh, fill: DATA.colors[pg.owner]}, svg);
        if (pg.used < L) el("rect", {x: x + w, y: y, width: box - w, height: bh, fill: hatch}, svg);
      } else {
        el("rect", {x: x, y: y, width: box, height: bh, fill: pg.page === 0 ? "#555" : "#fff"}, svg);
      }
      el("rect", {x: x, y: y, width: box, height: bh, fill: "none", stroke: "#222"}, svg);
      const t = el("text", {x: x + box / 2, y: y + bh / 2 + 4, "text-anchor": "middle"}, svg);
      t.textContent = pg.page === 0 ? "null" : String(pg.page);
      if (pg.page === 0 || (pg.owner >= 0 && pg.used > L / 2)) t.setAttribute("style", "fill:#fff");
    }
    svg.setAttribute("height", y + bh + 4);
  }

  function render() {
    const i = Number(slider.value), P = DATA.presets[select.value];
    document.getElementById("declared-value").textContent = group(DATA.declared[i]);
    slider.setAttribute("aria-valuetext", group(DATA.declared[i]) + " tokens");
    drawTop(i);
    for (const row of document.querySelectorAll("#contiguous-table tbody tr")) {
      const r = Number(row.dataset.request);
      row.querySelector(".reserved").textContent = group(DATA.declared[i]);
      row.querySelector(".dead").textContent = group(DATA.dead[i][r]);
    }
    setText("c-reserved-slots", group(DATA.reserved_slots[i]));
    setText("c-dead-slots", group(DATA.dead_slots[i]));
    setText("c-reserved-bytes", bytes(P.reserved_bytes[i]));
    setText("c-used-bytes", bytes(P.used_bytes));
    setText("c-dead-bytes", bytes(P.dead_bytes[i]));
    setText("c-share", pct(DATA.contiguous_share[i]));
    setText("ratio", DATA.ratio[i].toFixed(1));
    setText("p-held-bytes", bytes(P.paged_held_bytes));
    setText("p-unused-bytes", bytes(P.paged_unused_bytes));
    setText("p-hybrid", P.hybrid_aware_bytes === null ? "" :
      P.hybrid_aware_bytes === P.paged_held_bytes ?
      P.hybrid_note + ": every request fits inside the window, so a hybrid-aware manager holds the same." :
      P.hybrid_note + ": a hybrid-aware manager, which frees the pages that left a window, would hold " +
      bytes(P.hybrid_aware_bytes) + "; the drawing keeps every layer's pages.");
    setText("source", "Preset shapes: " + P.source + "; " + group(P.kv_bytes_per_token) + " B per token (slot), " +
      DATA.kv_dtype + ".");
  }

  setText("p-pages", group(DATA.pages_total));
  setText("p-held-slots", group(DATA.held_total));
  setText("p-unused-slots", group(DATA.unused_total));
  setText("p-share", pct(DATA.paged_share));
  drawBottom();
  slider.addEventListener("input", render);
  select.addEventListener("change", render);
  render();
})();
</script>
</body>
</html>
"""


if __name__ == "__main__":
    main()
