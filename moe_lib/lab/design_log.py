"""Notebook 08, the design log: ``notes/index.md`` read back as tables, one row per design or experiment.

The lessons (notebooks 01–06) teach the designs that run; how each came to be — what was tried, predicted, measured
and set aside — lives in the lab notes, ``notes/``, one file per design or experiment. Their index lists every
note with its status and a one-line verdict; :func:`read_index` reads those tables, :func:`styled_log` shows them
with a link to each note, and :func:`status_counts` counts the statuses per problem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd

from .results import ROOT

NOTES_DIR = ROOT / "notes"
INDEX = NOTES_DIR / "index.md"
# the statuses the index defines, in the order the log shows them
STATUSES = ("default", "fallback", "option", "removed", "negative", "analysis")
STATUS_COLOURS = {
    "default": "#1a7f37",
    "fallback": "#0969da",
    "option": "#8250df",
    "removed": "#57606a",
    "negative": "#cf222e",
    "analysis": "#9a6700",
}


def status_kind(status: str) -> str:
    """The first of :data:`STATUSES` that a status cell names ("removed@1051632" -> "removed"; "default (…);
    negative (…)" -> "default"), "other" where it names none."""
    found = [(status.find(kind), kind) for kind in STATUSES if kind in status]
    return min(found)[1] if found else "other"


def read_index(path=INDEX) -> pd.DataFrame:
    """The index's tables as one frame: section (the heading above the table), notes (the note files a row names,
    paths under ``notes/``), design, status, kind (:func:`status_kind`) and verdict. A ``ValueError`` names the file
    and the line of a table row that does not have the four columns."""
    path = Path(path)
    rows, section = [], None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("## "):
            section = line.removeprefix("## ").replace("`", "").strip()
            continue
        if not line.startswith("|") or set(line) <= set("|-: ") or line.startswith("| note |"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise ValueError(
                f"{path}: line {number}: expected 4 columns (note, design, status, verdict), got {len(cells)}"
            )
        note, design, status, verdict = cells
        rows.append(
            dict(
                section=section,
                notes=re.findall(r"`([^`]+\.md)`", note),
                design=design,
                status=status,
                kind=status_kind(status),
                verdict=verdict,
            )
        )
    return pd.DataFrame(rows, columns=["section", "notes", "design", "status", "kind", "verdict"])


def status_counts(log: pd.DataFrame) -> pd.DataFrame:
    """Rows per section (rows) and status kind (columns, :data:`STATUSES` first)."""
    counts = pd.crosstab(log["section"], log["kind"]).reindex(index=list(dict.fromkeys(log["section"])))
    return counts[[kind for kind in (*STATUSES, "other") if kind in counts.columns]]


def _link(note: str, link_from: Path) -> str:
    """An HTML link to ``notes/<note>`` from pages written in ``link_from``."""
    target = os.path.relpath(NOTES_DIR / note, start=Path(link_from).resolve())
    return f'<a href="{target}">{note}</a>'


def _markdown_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def styled_log(log: pd.DataFrame, section: str, link_from):
    """One section of :func:`read_index` as a table: each note a link (relative to the folder ``link_from`` where the
    page is written), the status coloured by its kind."""
    part = log[log["section"] == section]
    shown = pd.DataFrame(
        {
            "note": [", ".join(_link(note, link_from) for note in notes) for notes in part["notes"]],
            "design or experiment": part["design"].map(_markdown_code),
            "status": part["status"].map(_markdown_code),
            "verdict": part["verdict"].map(_markdown_code),
        }
    )
    colours = dict(zip(shown.index, part["kind"].map(STATUS_COLOURS).fillna("#24292f"), strict=True))
    return (
        shown.style.hide(axis="index")
        .set_caption(section)
        .apply(lambda column: [f"color: {colours[i]}; font-weight: bold" for i in column.index], subset=["status"])
        .set_properties(**{"text-align": "left"})
    )


def status_figure(counts: pd.DataFrame):
    """The counts of :func:`status_counts` as stacked horizontal bars, one per section. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.7 * len(counts) + 1.2), layout="constrained")
    left = pd.Series(0, index=counts.index)
    for kind in counts.columns:
        ax.barh(counts.index, counts[kind], left=left, color=STATUS_COLOURS.get(kind, "#24292f"), label=kind)
        left = left + counts[kind]
    ax.invert_yaxis()
    ax.set(xlabel="notes", title="The lab notes by status")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
