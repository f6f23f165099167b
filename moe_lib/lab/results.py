"""The benchmark's committed results as the notebooks read them, and what notebooks 03 and 05 share.

:func:`load_results` reads the benchmark's output, ``data/results/<GPU>/<date>-<problem>-<dtype>[-small][-<tag>].csv``
and the JSON beside it (provenance, per-implementation summary), into :class:`ResultFile`s. The
implementations' order and plot styles, the per-case pivots and the table styling live here too.

Times are in milliseconds (``*_ms``) as the column names say.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from .. import problems, roofline
from ..bench import results as bench_results

ROOT = problems.DATA_DIR.parent
RESULTS_DIR = problems.DATA_DIR / "results"
OURS = "triton"  # the implementation the targets are about
IMPLS = ("reference", "torch_eager", "torch_compile", "grouped_mm", "liger", "triton", "triton_fast")
IMPL_STYLE = {  # colour and marker of each implementation in every plot
    "reference": ("tab:gray", "o"),
    "torch_eager": ("tab:blue", "s"),
    "torch_compile": ("tab:purple", "D"),
    "grouped_mm": ("tab:orange", "^"),
    "liger": ("tab:green", "v"),
    "triton": ("tab:red", "*"),
    "triton_fast": ("tab:pink", "P"),
}


def resolve_path(path) -> Path:
    """``path`` as a Path: absolute paths as given, relative ones from the repository root."""
    path = Path(path)
    return path if path.is_absolute() else ROOT / path


def shown_path(path) -> str:
    """``path`` relative to the repository root where it is inside it (as the notebooks name files)."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def format_ms(ms) -> str:
    """A time in ms as "12.3 µs", "4.56 ms" or "1.23 s"; "–" when missing."""
    return bench_results.format_ms(ms, missing="–")


def styled(frame: pd.DataFrame, formats, caption: str):
    """``frame`` as a pandas Styler with ``formats``, "–" for missing values and ``caption``."""
    return frame.style.format(formats, na_rep="–").set_caption(caption)


# ================================================================ result files


@dataclass(frozen=True)
class RunFiles:
    """A measured run as committed: its CSV, named "<date>-...", and the JSON beside it (provenance)."""

    csv: Path
    frame: pd.DataFrame = field(repr=False)
    meta: dict = field(repr=False)

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def provenance(self) -> dict:
        return self.meta.get("provenance", {})

    @property
    def gpu_key(self) -> str:
        return self.provenance.get("gpu_key") or self.csv.parent.name

    @property
    def date(self) -> str:
        return self.csv.stem[:10]


@dataclass(frozen=True)
class ResultFile(RunFiles):
    """One benchmark run: its long-form CSV (one row per implementation × case) and the JSON beside it."""

    @property
    def problem(self) -> str:
        return self.meta["problem"]

    @property
    def definition(self) -> problems.Problem:
        return problems.load(self.problem)

    @property
    def key(self) -> str:
        """The file's stem without its date: "<problem>-<dtype>[-small][-<tag>]"."""
        match = re.fullmatch(r"\d{4}-\d{2}-\d{2}-(.+)", self.csv.stem)
        return match.group(1) if match else self.csv.stem

    @property
    def title(self) -> str:
        return self.definition.title + (" · small shapes" if self.small else "")

    @property
    def small(self) -> bool:
        return bool(self.provenance.get("small"))

    @property
    def impls(self) -> list[str]:
        return list(self.meta.get("impls") or dict.fromkeys(self.frame["impl"]))

    @property
    def tokens(self) -> list[int]:
        """The measured token counts, ascending."""
        return sorted(int(t) for t in self.frame["num_tokens"].unique())

    @property
    def axes(self) -> dict:
        """The constant axes the run used (overrides of the problem's, for small shapes)."""
        return dict(self.meta.get("axes", {}))

    @property
    def measured_spec(self) -> roofline.GPUSpec | None:
        """The ceilings measured in the run, as a GPUSpec (None if the run has none)."""
        ceilings = self.provenance.get("ceilings") or {}
        if not ceilings.get("copy_bandwidth") or not ceilings.get("bf16_matmul_flops"):
            return None
        return roofline.GPUSpec.from_measured(
            ceilings["copy_bandwidth"],
            ceilings["bf16_matmul_flops"],
            name=f"measured ({self.gpu_key} run of {self.date})",
        )

    @property
    def datasheet_spec(self) -> roofline.GPUSpec | None:
        """The datasheet figures of the GPU the run was made on (None for GPUs not in roofline.GPUS)."""
        return roofline.GPUS.get(self.gpu_key)


def optional_bool(value):
    """True/False as read from a CSV, None where empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    return bool(value)


class ResultFileError(ValueError):
    """A committed result file is malformed (the message names the file, and the line for JSON)."""


def read_run_json(path: Path, keys=()) -> dict:
    """The JSON object in ``path``, which must hold ``keys``; :class:`ResultFileError` naming the file
    (and the line) when it does not parse or lacks one."""
    try:
        document = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from exc
    except UnicodeDecodeError as exc:
        raise ResultFileError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    if not isinstance(document, dict):
        raise ResultFileError(f"{path}: line 1: expected a JSON object, got {type(document).__name__}")
    require_keys(document, keys, path)
    return document


def run_date(meta: dict) -> str:
    """When a run was made, as its JSON's provenance records it (``date_utc``, ISO: later sorts later); "" where not
    recorded."""
    return str(meta.get("provenance", {}).get("date_utc", ""))


def require_keys(document: dict, keys, path: Path) -> None:
    """:class:`ResultFileError` naming ``path`` when ``document`` lacks one of ``keys``."""
    missing = [key for key in keys if key not in document]
    if missing:
        raise ResultFileError(f"{path}: missing key(s) {missing}")


def read_run_csv(path: Path, columns=()) -> pd.DataFrame:
    """The CSV in ``path``, which must have ``columns``; :class:`ResultFileError` naming the file (pandas
    names the line of a malformed row) when it does not parse or lacks one."""
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ResultFileError(f"{path}: not a readable CSV ({str(exc).strip()})") from exc
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise ResultFileError(f"{path}: missing column(s) {missing}")
    return frame


RESULT_COLUMNS = ("impl", "num_tokens", "status", "median_ms", "correct", "passes_element_rule")
RESULT_KEYS = ("problem", "dtype")


def load_result_file(csv_path) -> ResultFile:
    """One result file (``.csv`` with its ``.json`` beside it); :class:`ResultFileError` naming the file
    when either is malformed."""
    csv_path = Path(csv_path)
    json_path = csv_path.with_suffix(".json")
    if not json_path.is_file():
        raise FileNotFoundError(f"{csv_path.name}: no {json_path.name} beside it (the run's provenance)")
    meta = read_run_json(json_path, RESULT_KEYS)
    frame = read_run_csv(csv_path, RESULT_COLUMNS)
    frame["passes_element_rule"] = frame["passes_element_rule"].map(optional_bool).astype(object)
    frame["correct"] = frame["correct"].map(optional_bool).astype(object)
    try:
        frame["num_tokens"] = frame["num_tokens"].astype(int)
    except (TypeError, ValueError) as exc:
        raise ResultFileError(f"{csv_path}: column num_tokens: expected integers ({exc})") from exc
    return ResultFile(csv=csv_path, frame=frame, meta=meta)


def load_results(results_dir=RESULTS_DIR, gpu_key: str = "H200") -> dict[str, ResultFile]:
    """The newest benchmark-harness result file of each kind in ``<results_dir>/<gpu_key>/``, keyed by
    :attr:`ResultFile.key`, in the order of :data:`moe_lib.problems.PROBLEM_NAMES` (full-size shapes
    before small ones).

    ``results_dir`` is relative to the repository root unless absolute. Only files of the problems in
    :mod:`moe_lib.problems` with a JSON beside them are read, and only runs of the problem's function
    (mode ``op``) at the problem's own shape: other measurements kept there (the training-step runs, the
    model suite's, the expert-parallel benchmark's, NVIDIA's harness's traces, ``tuning/``) are left out.
    """
    root = resolve_path(results_dir)
    folder = root / gpu_key
    if not folder.is_dir():
        available = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise FileNotFoundError(f"no results folder {folder} (GPU folders in {root}: {available or 'none'})")
    newest: dict[str, ResultFile] = {}
    for csv_path in sorted(folder.glob("*.csv")):
        json_path = csv_path.with_suffix(".json")
        if not json_path.is_file():
            continue
        meta = read_run_json(json_path)
        if meta.get("problem") not in problems.PROBLEM_NAMES or meta.get("mode", "op") != "op":
            continue  # the training-step runs (bench --mode) time layers, not the problem's function
        if meta.get("suite") == bench_results.MODEL_SUITE:
            continue  # the model suite's runs (bench --models) are of other shapes: lab.models reads them
        result = load_result_file(csv_path)
        if result.key not in newest or result.date >= newest[result.key].date:
            newest[result.key] = result

    def order(result: ResultFile):
        return problems.PROBLEM_NAMES.index(result.problem), result.small, result.key

    return {result.key: result for result in sorted(newest.values(), key=order)}


def find(results: dict[str, ResultFile], problem: str) -> ResultFile | None:
    """The result file of ``problem`` (full-size shapes preferred), or None."""
    found = [result for result in results.values() if result.problem == problem]
    return min(found, key=lambda result: result.small) if found else None


# ================================================================ per-case tables


def ok_rows(result: ResultFile) -> pd.DataFrame:
    """The rows of ``result`` that were checked correct and timed."""
    return result.frame[result.frame["status"] == "ok"]


def impl_columns(result: ResultFile) -> list[str]:
    """The implementations of ``result`` in the order of :data:`IMPLS`, others after them."""
    present = list(dict.fromkeys(result.frame["impl"]))
    return [impl for impl in IMPLS if impl in present] + [impl for impl in present if impl not in IMPLS]


def pivot(result: ResultFile, column: str, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """``column`` per case (rows: token counts, ascending) and implementation (columns), from ``rows``
    (default: every row of the file)."""
    rows = result.frame if rows is None else rows
    table = rows.pivot_table(index="num_tokens", columns="impl", values=column, aggfunc="first", dropna=False)
    table = table.reindex(index=result.tokens, columns=impl_columns(result))
    table.columns.name = None
    return table


def times_table(result: ResultFile) -> pd.DataFrame:
    """Median ms per case (rows: token counts, ascending) and implementation (NaN where not timed),
    with T_sol against the run's measured ceilings and the GPU's datasheet."""
    table = pivot(result, "median_ms", ok_rows(result))
    cases = result.frame.drop_duplicates("num_tokens").set_index("num_tokens")
    table["T_sol (measured)"] = cases["sol_ms"].reindex(table.index)
    spec = result.datasheet_spec
    if spec is not None:
        table[f"T_sol ({result.gpu_key} datasheet)"] = [
            roofline.sol_time(result.problem, t, spec, result.dtype, **result.axes) * 1e3 for t in table.index
        ]
    return table
