"""The provenance block of every results file, and the check that two runs
of the tables agree in every number but the timings."""

import csv
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.lib import provenance, tables
from experiments.memory import check_reproducible, sharing

SEEDS = {"sharegpt_shuffle": 0, "arrivals": 3}


def record(**kw):
    return provenance.collect("experiments.memory.reproduce", ["--skip-serving"], seeds=SEEDS, **kw)


def git_repo(path):
    """A one-commit repository at ``path``; returns the commit."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*cmd):
        return subprocess.run(["git", "-C", str(path), *cmd], check=True, capture_output=True, text=True,
                              env=env).stdout

    git("init", "-q")
    (path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    return git("rev-parse", "HEAD").strip()


def test_block_has_every_field():
    r = record()
    fields = r.as_dict()
    assert tuple(fields) == provenance.FIELDS
    assert r.command == "python -m experiments.memory.reproduce --skip-serving"
    if (provenance.REPO / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit)
    assert r.dirty == "no" or r.dirty.startswith("yes (")
    assert r.python == ".".join(map(str, sys.version_info[:3]))
    assert r.jax == jax.__version__ and r.numpy == np.__version__
    assert r.jaxlib != "not installed" and r.flax != "not installed"
    assert r.backend == jax.default_backend()
    assert r.device_kind == jax.devices()[0].device_kind and r.device_count == str(jax.device_count())
    assert r.seeds == "sharegpt_shuffle=0, arrivals=3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r.date)
    md, comments = provenance.render(r, "markdown"), provenance.render(r, "csv")
    for key, value in fields.items():
        assert f"- {key}: {value}\n" in md
        assert f"# {key}: {value}\n" in comments


def test_command_line_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/experiments/sharing.py", "--parts", "a", "--out", "my results"])
    r = provenance.collect("experiments.memory.sharing")
    assert r.command == "python -m experiments.memory.sharing --parts a --out 'my results'"
    assert provenance.collect("experiments.memory.sharing", []).seeds == "none"


@pytest.mark.parametrize("seeds", [{"a": True}, {"a": 1.0}, {"a b": 1}, {"a=b": 1}, {"": 1}])
def test_bad_seeds_are_refused(seeds):
    with pytest.raises(ValueError, match="seed"):
        provenance.collect("experiments.memory.reproduce", [], seeds=seeds)


def test_dirty_flag(tmp_path):
    commit = git_repo(tmp_path)
    r = record(repo=tmp_path)
    assert (r.commit, r.dirty) == (commit, "no")
    (tmp_path / "a.py").write_text("x = 2\n")
    first = record(repo=tmp_path).dirty
    assert re.fullmatch(r"yes \(1 paths, diff sha256 [0-9a-f]{12}\)", first)
    (tmp_path / "a.py").write_text("x = 3\n")
    assert record(repo=tmp_path).dirty != first  # another edit, another hash
    (tmp_path / "new.py").write_text("")  # an untracked file counts too
    with_new = record(repo=tmp_path).dirty
    assert with_new.startswith("yes (2 paths")
    (tmp_path / "new.py").write_text("y = 1\n")  # and its contents: git diff HEAD leaves it out
    assert record(repo=tmp_path).dirty not in (with_new, first)


def test_outside_a_git_checkout(tmp_path, monkeypatch):
    r = record(repo=tmp_path)
    assert (r.commit, r.dirty) == ("unknown (not a git checkout)", "unknown")
    git_repo(tmp_path)
    (tmp_path / "sub").mkdir()
    assert record(repo=tmp_path / "sub").commit == "unknown (not a git checkout)"  # inside, but not its root
    assert record(repo=tmp_path / "missing").commit == "unknown (not a git checkout)"
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    r = record(repo=tmp_path)
    assert (r.commit, r.dirty) == ("unknown (git not found)", "unknown")
    assert r.jax == jax.__version__  # the rest of the record is unaffected


def test_csv_still_parses(tmp_path):
    rows = [{"model": "a, b", "tokens/s": 1.5, "note": 'say "hi"'}, {"model": "c", "tokens/s": 2, "note": "#2"}]
    r = record()
    path = tmp_path / "t.csv"
    provenance.write_csv(path, rows, ["model", "tokens/s", "note"], r)
    prov, read = provenance.read_csv(path)
    assert prov == r.as_dict()
    assert read == [{"model": "a, b", "tokens/s": "1.5", "note": 'say "hi"'},
                    {"model": "c", "tokens/s": "2", "note": "#2"}]
    with open(path, newline="") as f:  # a plain csv reader that skips comment lines
        assert list(csv.DictReader(line for line in f if not line.startswith("#"))) == read
    plain = tmp_path / "plain.csv"  # a file without a block reads too, and a missing cell stays empty
    provenance.write_csv(plain, [{"a": "#1"}], ["a", "b"], r)
    assert provenance.read_csv(plain)[1] == [{"a": "#1", "b": ""}]
    plain.write_text("a,b\n1,2\n")
    assert provenance.read_csv(plain) == ({}, [{"a": "1", "b": "2"}])


def test_markdown_block_round_trip(tmp_path):
    r = provenance.collect("experiments.x", ["--name", "two\nlines", "back\\n"], seeds=SEEDS)
    path = tmp_path / "t.md"
    provenance.write_markdown(path, "# Title\n\n| a |\n|---|\n| 1 |\n", r)
    body, prov = provenance.split_markdown(path.read_text())
    assert body == "# Title\n\n| a |\n|---|\n| 1 |\n"
    assert prov == r.as_dict()  # the newline and the backslash in the command survive
    assert provenance.split_markdown(body) == (body, {})
    with pytest.raises(ValueError, match="already holds"):
        provenance.write_markdown(path, path.read_text(), r)
    with pytest.raises(ValueError, match="style"):
        provenance.render(r, "html")


def test_write_table_writes_both_files_with_the_block(tmp_path):
    rows = [{"mode": "paged", "tokens_per_s": 1.5}, {"mode": "contiguous", "tokens_per_s": 0.5}]
    table = tables.markdown_table(rows, ["mode", "tokens_per_s"], headers=["mode", "tokens/s"],
                                  cell=lambda column, value: f"{value:.2f}" if column == "tokens_per_s" else value)
    assert table == "| mode | tokens/s |\n|---|---|\n| paged | 1.50 |\n| contiguous | 0.50 |"
    with pytest.raises(ValueError, match="headers must name every column"):
        tables.markdown_table(rows, ["mode"], headers=["a", "b"])
    r = record()
    md, csv_path = tables.write_table(tmp_path / "new", "t", rows, ["mode", "tokens_per_s"], "# T\n\n" + table, r)
    assert (md, csv_path) == (tmp_path / "new" / "t.md", tmp_path / "new" / "t.csv")
    assert provenance.split_markdown(md.read_text()) == ("# T\n\n" + table + "\n", r.as_dict())
    assert provenance.read_csv(csv_path) == (r.as_dict(), [{"mode": "paged", "tokens_per_s": "1.5"},
                                                          {"mode": "contiguous", "tokens_per_s": "0.5"}])


def test_sharing_writes_the_block(tmp_path):
    r = provenance.collect("experiments.memory.sharing", ["--parts", "c"], seeds=sharing.SEEDS)
    rows = [{"part": "c", "page_size": 16, "recompute_ms": 1.5}]
    sharing.write(tmp_path, {"c": rows}, {"c": "(c) title"}, "note", r)
    prov, read = provenance.read_csv(tmp_path / "sharing.csv")
    assert prov == r.as_dict() and read == [{"part": "c", "page_size": "16", "recompute_ms": "1.5"}]
    assert provenance.split_markdown((tmp_path / "sharing.md").read_text())[1] == r.as_dict()


def _two_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rows = [{"scheme": "paged", "token states": "98.0%", "sim s": 3.0},
            {"scheme": "contiguous-max", "token states": "18.3%", "sim s": 7.5}]
    md = "## Waste\n\n| scheme | token states | sim s |\n|---|---|---|\n| paged | 98.0% | 3.0 |\n\nA note.\n"
    for folder in (a, b):
        provenance.write_csv(folder / "waste.csv", rows, list(rows[0]), record())
        provenance.write_markdown(folder / "waste.md", md, record())
    return a, b


def test_compare_ignores_timings_and_date(tmp_path):
    a, b = _two_runs(tmp_path)
    for name in ("waste.csv", "waste.md"):
        text = (b / name).read_text()
        text = re.sub(r"date: \S+", "date: 1999-01-01T00:00:00Z", text).replace("3.0", "9.9")
        (b / name).write_text(text)
    result = check_reproducible.compare_dirs(a, b)
    assert result.differences == []
    assert (result.files, result.cells, result.skipped) == (2, 4 + 2, 2 + 1)


def test_compare_names_file_row_and_column(tmp_path):
    a, b = _two_runs(tmp_path)
    (b / "waste.csv").write_text((b / "waste.csv").read_text().replace("18.3%", "18.4%"))
    (b / "waste.md").write_text((b / "waste.md").read_text().replace("A note.", "A nöte."))
    (b / "extra.md").write_text("# no block\n")
    (a / "waste.png").write_text("not a table")  # figures are not compared
    diffs = check_reproducible.compare_dirs(a, b).differences
    assert diffs == [
        f"extra.md: only in {b}",
        "waste.csv: row 2 (contiguous-max), column 'token states': '18.3%' != '18.4%'",
        "waste.md: line 7: 'A note.' != 'A nöte.'",
    ]
    (b / "extra.md").unlink()
    text = (b / "waste.md").read_text()
    (b / "waste.md").write_text(text[: text.index(provenance.MARKER)])
    diffs = check_reproducible.compare_dirs(a, b).differences
    assert any(d.startswith("waste.md: the second run's provenance block lacks command") for d in diffs)


@pytest.mark.slow  # ~30-50 s; `make check-tables` runs the same check, the tests above cover the comparison
def test_reproduce_twice_agrees(tmp_path, capsys):
    # Two fresh processes of `python -m experiments.memory.reproduce` on a small configuration (~15-25 s each).
    assert check_reproducible.main(["--keep", str(tmp_path)]) == 0, capsys.readouterr().out
    assert "reproducible: 13 files" in capsys.readouterr().out
    for path in sorted((tmp_path / "run1").iterdir()):
        if path.suffix == ".csv":
            prov, rows = provenance.read_csv(path)
            assert rows and prov["seeds"] == "sharegpt_shuffle=0, arrivals=0", path.name
            assert prov["command"].startswith("python -m experiments.memory.reproduce --sim-requests 20 ")
        elif path.suffix == ".md":
            assert provenance.split_markdown(path.read_text())[1]["commit"], path.name


def test_check_refuses_its_own_out():
    with pytest.raises(SystemExit):
        check_reproducible.parse_args(["--", "--out", "x"])



def test_tree_edited_between_runs_is_a_note(tmp_path):
    a, b = _two_runs(tmp_path)
    for name in ("waste.csv", "waste.md"):
        (b / name).write_text(re.sub(r"dirty: [^\n]+", "dirty: yes (99 paths, diff sha256 000000000000)",
                                     (b / name).read_text()))
    result = check_reproducible.compare_dirs(a, b)
    assert result.differences == [] and len(result.notes) == 2


def test_check_refuses_empty_folders_and_unwritable_keep(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert check_reproducible.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "no .md or .csv files to compare" in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        check_reproducible.parse_args(["--keep", str(tmp_path / "file" / "sub")])
