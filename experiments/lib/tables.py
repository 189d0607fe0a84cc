"""Results tables: one Markdown renderer and one writer of a table's files.

Every script writes its results through :func:`write_table`: ``<name>.md``
(the script's Markdown text, then the run's provenance block) and
``<name>.csv`` (the block as ``#`` comment lines, then the rows under a
header), so every table under ``results/`` has the same form and
:mod:`experiments.memory.check_reproducible` reads them all alike. The block itself
is :mod:`experiments.lib.provenance`'s.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence

from experiments.lib import provenance


def markdown_table(rows: Sequence[Mapping], columns: Sequence[str], *, headers: Sequence[str] | None = None,
                   cell: Callable[[str, object], str] | None = None) -> str:
    """A Markdown table, without a trailing newline: ``| a | b |``, then
    ``|---|---|``, then one line per row.

    Args:
      rows: the rows, each holding every column.
      columns: the keys shown, in order.
      headers: the header cells (default ``columns``), one per column.
      cell: ``(column, value) -> text`` (default ``str(value)``).

    Raises:
      ValueError: ``headers`` of another length than ``columns``.
    """
    headers = list(columns if headers is None else headers)
    if len(headers) != len(columns):
        raise ValueError(f"headers must name every column, got {len(headers)} headers for {len(columns)} columns")
    cell = cell or (lambda column, value: str(value))
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c, row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_table(out: pathlib.Path | str, name: str, rows: Sequence[Mapping], columns: Sequence[str],
                markdown: str, record: provenance.Provenance) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes one table's files into the folder ``out`` (created if absent).

    Args:
      name: the files' stem: ``<out>/<name>.md`` and ``<out>/<name>.csv``.
      rows: the CSV's rows (a key missing from a row leaves its cell empty).
      columns: the CSV's header, in order.
      markdown: the ``.md`` file's text (title, tables, notes), without a
        provenance block.
      record: the run's provenance (:func:`experiments.lib.provenance.collect`),
        written in both files.

    Returns:
      The paths of the ``.md`` and ``.csv`` files.

    Raises:
      ValueError: ``markdown`` already holds a provenance block.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, csv = out / f"{name}.md", out / f"{name}.csv"
    provenance.write_markdown(md, markdown, record)
    provenance.write_csv(csv, rows, columns, record)
    return md, csv
