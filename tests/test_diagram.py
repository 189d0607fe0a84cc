"""The draggable layout diagram (:mod:`experiments.memory.diagram`): the page is
self-contained and current, bad arguments are refused by name, and in real
headless Chromium the page loads without console errors, the slider and the
preset box show the numbers :mod:`paged_jax.memory` gives, and a screenshot
is written.

The browser test needs Debian's ``chromium`` and ``chromium-driver`` (``make
browser``, which ``make test`` runs) and selenium (the ``test`` extra). It
skips, saying which is missing, where they cannot be had, except on CI
(``CI`` set), where it fails instead: there they are installed.
"""

import os
import re
import shutil
import struct

import pytest

from experiments.memory import diagram
from paged_jax.memory import PRESETS, contiguous_waste, paged_slots, paged_waste

SPEC = diagram.DiagramSpec()
LENGTHS = list(SPEC.lengths)  # 70, 23, 150, 41 tokens


def _expected(declared: int, preset: str) -> dict[str, str]:
    """What the page must show at ``declared`` for ``preset``, element id ->
    the text it starts with, straight from the memory maths."""
    model = PRESETS[preset]
    dead = contiguous_waste(LENGTHS, declared)
    held = paged_slots(LENGTHS, SPEC.page_size)
    paged_bytes = sum(model.sequence_kv_bytes(u, page_size=SPEC.page_size, dtype=SPEC.kv_dtype, hybrid_aware=False)
                      for u in LENGTHS)
    return {
        "declared-value": f"{declared:,}",
        "c-reserved-slots": f"{len(LENGTHS) * declared:,}",
        "c-dead-slots": f"{int(dead.sum()):,}",
        "c-reserved-bytes": f"{model.kv_bytes(len(LENGTHS) * declared, SPEC.kv_dtype):,} B (",
        "c-used-bytes": f"{model.kv_bytes(sum(LENGTHS), SPEC.kv_dtype):,} B (",
        "c-dead-bytes": f"{model.kv_bytes(int(dead.sum()), SPEC.kv_dtype):,} B (",
        "p-held-slots": f"{int(held.sum()):,}",
        "p-unused-slots": f"{int(paged_waste(LENGTHS, SPEC.page_size).sum()):,}",
        "p-held-bytes": f"{paged_bytes:,} B (",
        "p-unused-bytes": f"{model.kv_bytes(int(paged_waste(LENGTHS, SPEC.page_size).sum()), SPEC.kv_dtype):,} B (",
    }


def test_page_is_self_contained_and_current():
    page = diagram.render_page(diagram.diagram_data(SPEC))
    # Nothing to fetch: no src, no stylesheet, no URL but the SVG namespace (a name, never loaded).
    assert not re.search(r"\bsrc\s*=", page)
    assert re.findall(r"https?://[^\s\"')]+", page) == ["http://www.w3.org/2000/svg"]
    assert re.findall(r"<link[^>]*>", page) == ['<link rel="icon" href="data:,">']
    committed = diagram.DEFAULT_OUT / "index.html"
    assert committed.read_text(encoding="utf-8") == page, (
        f"{committed} is not what the generator writes now: run python -m experiments.memory.diagram --screenshot")
    assert (diagram.DEFAULT_OUT / "screenshot.png").stat().st_size > 10_000


def test_positions_and_data():
    assert SPEC.positions[:3] == (150, 152, 160) and SPEC.positions[-1] == 2048
    assert len(SPEC.positions) == 1 + (2048 - 152) // 8 + 1
    data = diagram.diagram_data(SPEC)
    # Pages of 16: 70 -> 5 pages (10 unused), 23 -> 2 (9), 150 -> 10 (10), 41 -> 3 (7): 20 pages, 320 slots.
    assert (data.pages, data.unused, data.held_total) == ([5, 2, 10, 3], [10, 9, 10, 7], 320)
    assert sorted(p for t in data.block_tables for p in t) == list(range(1, 21))  # page 0 is the null page
    assert data.pool[0].owner == -1
    # gpt-oss-20b slides 12 of 24 layers over 128 tokens: request 2 (150 tokens) holds 9 of its 10 pages there.
    gpt = data.presets["gpt-oss-20b"]
    assert gpt.paged_held_bytes - gpt.hybrid_aware_bytes == 12 * 16 * 2 * 8 * 64 * 2
    assert data.presets["llama-3-8b"].hybrid_aware_bytes is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=0), "page_size"),
    (dict(min_declared=149), "min_declared"),
    (dict(max_declared=100), "max_declared"),
    (dict(step=0), "step"),
    (dict(declared=257), "declared must be a slider position"),
    (dict(preset="gpt-5"), "preset"),
    (dict(kv_dtype="int4"), "kv_dtype"),
    (dict(lengths=()), "lengths"),
    (dict(lengths=(70, 0)), r"lengths\[1\]"),
    (dict(lengths=[70]), "lengths must be a tuple"),
    (dict(step=1, max_declared=6000), "at most 5000 positions"),
])
def test_spec_refuses_bad_arguments_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagram.DiagramSpec(**kwargs)


@pytest.mark.parametrize("argv, flag", [
    (["--page-size", "0"], "--page-size"),
    (["--step", "0"], "--step"),
    (["--lengths", "70", "0"], "--lengths"),
    (["--min-declared", "100"], "--min-declared"),
    (["--max-declared", "149"], "--max-declared"),
    (["--declared", "257"], "declared must be a slider position"),
    (["--preset", "gpt-5"], "--preset"),
    (["--kv-dtype", "int4"], "--kv-dtype"),
])
def test_cli_refuses_bad_flags_by_name(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        diagram.main(["--out", str(tmp_path)] + argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "index.html").exists()


def _browser_or_skip():
    missing = [name for name in (diagram.CHROMIUM, diagram.CHROMEDRIVER) if shutil.which(name) is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        reason = f"the browser test needs {', '.join(missing)}: `make browser` installs chromium and chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(reason + " (on CI it must run)")
        pytest.skip(reason)


def test_in_headless_chromium(tmp_path):
    _browser_or_skip()
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    page = diagram.write_page(tmp_path, SPEC)
    driver = diagram.open_chromium()
    try:
        driver.get(page.as_uri())
        assert driver.title.startswith("Contiguous reservation versus pages")
        slider = driver.find_element(By.ID, "declared-max")
        preset = Select(driver.find_element(By.ID, "preset"))
        assert preset.first_selected_option.get_attribute("value") == SPEC.preset
        assert [o.get_attribute("value") for o in preset.options] == list(PRESETS)

        def text(element_id):
            return driver.find_element(By.ID, element_id).text

        def check(name):
            """The page's numbers at the slider's position for preset ``name``; returns the declared maximum."""
            declared = SPEC.positions[int(slider.get_attribute("value"))]
            for element_id, want in _expected(declared, name).items():
                assert text(element_id).startswith(want), (element_id, text(element_id), want)
            for r, (row, used) in enumerate(zip(driver.find_elements(By.CSS_SELECTOR, "#contiguous-table tbody tr"),
                                                LENGTHS)):
                cells = [row.find_element(By.CLASS_NAME, c).text for c in ("used", "reserved", "dead")]
                assert cells == [f"{used:,}", f"{declared:,}", f"{declared - used:,}"], r
            share = float(text("c-share").rstrip("%"))
            assert share == pytest.approx(100 * sum(LENGTHS) / (len(LENGTHS) * declared), abs=0.051)
            assert float(text("ratio")) == pytest.approx(len(LENGTHS) * declared / 320, abs=0.051)
            return declared

        assert check(SPEC.preset) == SPEC.declared  # as loaded
        slider.send_keys(Keys.HOME)
        assert check(SPEC.preset) == 150
        slider.send_keys(*[Keys.ARROW_RIGHT] * 5)
        assert check(SPEC.preset) == 184  # 150, 152, 160, 168, 176, 184
        width = slider.size["width"]  # a real drag, from 30% of the track to about 60%
        ActionChains(driver).move_to_element_with_offset(slider, int(-0.2 * width), 0).click_and_hold() \
            .move_by_offset(int(0.3 * width), 0).release().perform()
        dragged = check(SPEC.preset)
        assert 600 < dragged < 1800, dragged
        slider.send_keys(Keys.END)
        assert check(SPEC.preset) == 2048

        preset.select_by_value("gpt-oss-20b")  # a hybrid model: the note gives the hybrid-aware bytes
        check("gpt-oss-20b")
        model = PRESETS["gpt-oss-20b"]
        hybrid = sum(model.sequence_kv_bytes(u, page_size=SPEC.page_size, hybrid_aware=True) for u in LENGTHS)
        assert f"would hold {hybrid:,} B (" in text("p-hybrid")
        preset.select_by_value("deepseek-v3")  # MLA
        check("deepseek-v3")
        assert text("p-hybrid") == ""

        png = diagram.save_screenshot(driver, tmp_path / "diagram.png")
        head = png.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", head[16:24])[1] > 900  # the whole page, not one window of it

        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        driver.execute_script("console.error('probe')")  # the log is read: an error would show
        assert [e["level"] for e in driver.get_log("browser")] == ["SEVERE"]
    finally:
        driver.quit()
