"""The committed GPU runs behind notebook 04 and the lab notes, as data: ``data/results/H200/tuning/index.json``.

The loaders of :mod:`.design_runs`, :mod:`.traces` and :mod:`.ladder` read their files through this index, never by
a path written in code. Each entry of the file's ``runs`` is one run (one or several files) under a short key:

    what                  one line: what was measured
    files                 its files, relative to the repository root
    script                the script that wrote them
    notes                 the lab notes that report it (``tests/lab/test_tuning_index.py`` checks each exists)
    labels                candidate name → the label a table gives it; or ``labels_by_precision``: path → that
    default               the label of the run's "default" candidate, where one label fits every row; or
    default_by_run        what "default" ran at each commit (or round) of the file, by path, as bands
    candidate_bands       by commit or round ("*": any), a candidate's label as bands, where it depends on T
    others                "own name": a candidate no rule names keeps its name ("left out" otherwise), unless
                          its name starts with one of ``left_out_prefixes``
    columns_first         the labels a table puts first, in this order
    options               what else one loader needs of the run (a base candidate, a variant's suffix, ...)

A band list is ``[[first token count, label], ...]`` in ascending order: a row of T tokens takes the label of the
last band that starts at or below T (``null``: the row is left out). "default" stood for the code of the day, so a
run's "default" is only ever named through ``default`` or ``default_by_run``; commits are matched by prefix (at least
seven hex digits), rounds exactly.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from .results import RESULTS_DIR, resolve_path

TUNING_DIR = RESULTS_DIR / "H200" / "tuning"  # the tuning scripts' committed outputs
INDEX_FILE = TUNING_DIR / "index.json"
PRECISIONS = ("fast", "faithful")


def band_label(bands, num_tokens: int) -> str | None:
    """The label of the band ``num_tokens`` falls in (``bands``: ``[[first token count, label], ...]`` ascending);
    None before the first band."""
    label = None
    for first, name in bands:
        if num_tokens < first:
            break
        label = name
    return label


def _matches(key: str, run_id) -> bool:
    """Whether ``key`` of a by-run table names the run ``run_id``: "*", the same round, or a prefix of its commit."""
    run_id = str(run_id)
    return key == "*" or key == run_id or (len(key) >= 7 and run_id.startswith(key))


@dataclass(frozen=True)
class Run:
    """One entry of the index (see the module's docstring for each field)."""

    key: str
    what: str
    files: tuple[str, ...]
    script: str | None = None
    notes: tuple[str, ...] = ()
    labels: dict = field(default_factory=dict, repr=False)
    labels_by_precision: dict = field(default_factory=dict, repr=False)
    default: str | None = None
    default_by_run: dict = field(default_factory=dict, repr=False)
    candidate_bands: dict = field(default_factory=dict, repr=False)
    others: str = "left out"
    left_out_prefixes: tuple[str, ...] = ()
    columns_first: tuple[str, ...] = ()
    options: dict = field(default_factory=dict, repr=False)

    @property
    def paths(self) -> tuple[Path, ...]:
        """Its files as absolute paths."""
        return tuple(resolve_path(name) for name in self.files)

    @property
    def path(self) -> Path:
        """Its one file (a run of several files has no single path)."""
        if len(self.files) != 1:
            raise ValueError(f"run {self.key!r}: {len(self.files)} files, not one: use .paths")
        return self.paths[0]

    def labels_for(self, precision: str | None = None) -> dict:
        """candidate → label: the run's ``labels``, or those of ``precision`` where the labels differ by path."""
        if self.labels_by_precision:
            if precision not in self.labels_by_precision:
                raise ValueError(f"run {self.key!r}: labels for {sorted(self.labels_by_precision)}, not {precision!r}")
            return self.labels_by_precision[precision]
        return self.labels

    def label(self, config: str, precision: str, num_tokens: int, run_id=None) -> str | None:
        """The column a row of this run goes to (None: left out): a candidate's bands at ``run_id`` (a commit or a
        round), then what "default" ran there, then the labels of ``precision``, then the candidate's own name where
        ``others`` keeps it."""
        for key, bands in self.candidate_bands.items():
            if _matches(key, run_id) and config in bands:
                return band_label(bands[config], num_tokens)
        if config == "default" and (self.default is not None or self.default_by_run):
            if self.default is not None:
                return self.default
            ran = next((by_path for key, by_path in self.default_by_run.items() if _matches(key, run_id)), {})
            return band_label(ran[precision], num_tokens) if precision in ran else None
        labels = self.labels_for(precision)
        if config in labels:
            return labels[config]
        if self.others == "own name" and not config.startswith(self.left_out_prefixes):
            return config
        return None


_FIELDS = {
    "what",
    "files",
    "script",
    "notes",
    "labels",
    "labels_by_precision",
    "default",
    "default_by_run",
    "candidate_bands",
    "others",
    "left_out_prefixes",
    "columns_first",
    "options",
}


def _run(key: str, entry: dict, source: Path) -> Run:
    unknown = set(entry) - _FIELDS
    if unknown or "files" not in entry or "what" not in entry:
        raise ValueError(f"{source}: run {key!r}: needs 'what' and 'files'; unknown fields {sorted(unknown)}")
    if entry.get("others", "left out") not in ("own name", "left out"):
        raise ValueError(f"{source}: run {key!r}: others is 'own name' or 'left out', not {entry['others']!r}")
    tuples = {
        name: tuple(entry[name]) for name in ("files", "notes", "left_out_prefixes", "columns_first") if name in entry
    }
    return Run(key=key, **{**entry, **tuples})


@functools.cache
def load(path: Path = INDEX_FILE) -> dict[str, Run]:
    """The index's runs by key."""
    document = json.loads(Path(path).read_text())
    return {key: _run(key, entry, Path(path)) for key, entry in document["runs"].items()}


def run(key: str) -> Run:
    """The run of the index under ``key``."""
    runs = load()
    if key not in runs:
        raise KeyError(f"no run {key!r} in {INDEX_FILE.name}; known: {', '.join(runs)}")
    return runs[key]
