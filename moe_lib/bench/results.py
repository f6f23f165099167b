"""The results files of the benchmark: schema, names, summaries and their text tables.

Under ``<out>/<gpu key>/`` (``H200``, ``H100-SXM``, ..., ``cpu``),
``<YYYY-MM-DD>-<problem>-<dtype>[-<mode>][-small][-<tag>]`` (``mode``: what was timed, :mod:`.modes`):

- ``.csv``, long form, one row per implementation × case, with the columns of :data:`CSV_COLUMNS` plus
  ``rel_error_<output>`` for each output after ``rel_error`` and ``element_pass_fraction_<output>`` (the share of
  that output's elements within the element rule) after ``element_pass_fraction`` (``wall_s``: the wall-clock
  seconds the row took, setup, compilation and autotuning included; ``peak_mem_gb``: the device memory one call
  allocated beyond what was allocated before it, at its peak; ``sol_ms_datasheet_<gpu>``: T_sol on the datasheet
  figures of each GPU of :data:`moe_lib.roofline.DATASHEET_GPUS`; files written before these columns were
  named after the GPU keys call them ``sol_ms_datasheet_h100`` and ``sol_ms_datasheet_h200``);
- ``.json``: provenance (:func:`run_provenance`) and per implementation geomean_ms (over its correct
  cases), roofline_fraction (geomean of T_sol/T, measured ceilings), sol_score (geomeans of T, the best
  baseline peer correct on every case, and T_sol), all_correct and n_cases.

The model suite (:mod:`.models`) writes files of the same form tagged ``models``, whose JSON says
``"suite": "models"`` (:data:`MODEL_SUITE`) and whose rows carry the model and its shape's axes; readers
of the benchmark's one-shape runs leave them out.

Every file is written whole or not at all (:func:`write_whole`: a temporary file renamed over it), and a run's
JSON last (:func:`write_run`), so that a run interrupted anywhere leaves whole files, and a CSV without a JSON
(which the loaders leave out) until it finishes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import torch

from .. import problems, roofline
from . import timing
from .checks import WRONG_REL_ERROR
from .provenance import (
    git_commit,
    git_dirty,
    git_status_lines,
    gpu_key,
    package_version,
    recorded_commit,
    run_context,
)

DEFAULT_OUT = problems.DATA_DIR / "results"
RECORDED_ENVIRONMENT = (
    "LIGER_FUSED_MOE_AUTOTUNE",
    "TRITON_CACHE_AUTOTUNING",
    "TRITON_INTERPRET",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_VISIBLE_DEVICES",
)
MODEL_SUITE = "models"  # the "suite" of a model-suite file's JSON (the benchmark's own files have none)
# column -> GPU key of the datasheet T_sol it holds
DATASHEET_COLUMNS = {f"sol_ms_datasheet_{key}": key for key in roofline.DATASHEET_GPUS}

CSV_COLUMNS = [
    "problem",
    "mode",
    "impl",
    "num_tokens",
    "dtype",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "reps",
    "timing",
    "official_ms",
    "official_p20_ms",
    "official_p80_ms",
    "official_status",
    "peak_mem_gb",
    "sol_ms",
    "roofline_fraction",
    *DATASHEET_COLUMNS,
    "flops",
    "bytes",
    "rel_error",
    "element_pass_fraction",
    "correct",
    "passes_element_rule",
    "status",
    "small",
    "device",
    "gpu",
    "wall_s",
]


def geomean(values) -> float:
    """Geometric mean of positive values (NaN when empty or when any is not positive)."""
    values = [float(v) for v in values]
    if not values or any(not v > 0 for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def format_ms(ms, missing: str = "-") -> str:
    """A time in ms as "12.3 µs", "4.56 ms" or "1.23 s"; ``missing`` when there is none."""
    if ms is None or pd.isna(ms):
        return missing
    if ms < 1:
        return f"{ms * 1e3:.1f} µs"
    if ms < 1000:
        return f"{ms:.2f} ms"
    return f"{ms / 1e3:.2f} s"


# ---------------------------------------------------------------------------------------------
# files


def result_stem(problem: str, dtype_name: str, *, small: bool, tag: str | None, date: str, mode: str = "op") -> str:
    """``<YYYY-MM-DD>-<problem>-<dtype>[-<mode>][-small][-<tag>]`` (the mode named unless it is ``op``)."""
    return (
        f"{date}-{problem}-{dtype_name}"
        + (f"-{mode}" if mode != "op" else "")
        + ("-small" if small else "")
        + (f"-{tag}" if tag else "")
    )


def result_paths(out, device: torch.device, stem: str) -> tuple[Path, Path]:
    """(CSV, JSON) paths of ``stem`` in ``<out>/<gpu key of device>/``, the folder created."""
    folder = Path(out) / gpu_key(device)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{stem}.csv", folder / f"{stem}.json"


def json_ready(value):
    """NaN/inf -> None, recursively, so the JSON is standard."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_whole(path, write) -> None:
    """Writes ``path`` whole or not at all: ``write(temporary)`` writes a file beside it, which then replaces
    ``path`` in one rename, so that a run interrupted at any point (an exception, ``KeyboardInterrupt``) leaves
    the file as it was or complete, never half written. The temporary file is removed if ``write`` fails."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # hidden, and no ``*.csv`` a loader globs
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all (:func:`write_whole`)."""
    write_whole(path, lambda temporary: temporary.write_text(text))


def write_csv(path, frame: pd.DataFrame) -> None:
    """Writes ``frame`` (without its index) to ``path`` whole or not at all (:func:`write_whole`)."""
    write_whole(path, lambda temporary: frame.to_csv(temporary, index=False))


def write_json(path, document: dict) -> None:
    """Writes ``document`` as indented, standard JSON (NaN/inf as null), whole or not at all."""
    write_text(path, json.dumps(json_ready(document), indent=2, ensure_ascii=False) + "\n")


def write_run(csv_path, frame: pd.DataFrame, json_path, document: dict) -> None:
    """A run's CSV and the JSON beside it, so that an interruption leaves both of this run or no JSON (which the
    loaders need): the JSON of an earlier run of the same name goes first, the new one comes last."""
    Path(json_path).unlink(missing_ok=True)
    write_csv(csv_path, frame)
    write_json(json_path, document)


def results_frame(rows: list[dict], output_names: list[str], shape_columns=()) -> pd.DataFrame:
    """The long-form table: :data:`CSV_COLUMNS` with ``rel_error_<output>`` after ``rel_error``, and
    ``shape_columns`` after ``mode`` (the model suite's ``model`` and the axes of its shapes, so that one
    file holds cases of several shapes)."""
    split = CSV_COLUMNS.index("rel_error") + 1
    columns = CSV_COLUMNS[:split] + [f"rel_error_{name}" for name in output_names] + CSV_COLUMNS[split:]
    split = columns.index("element_pass_fraction") + 1
    columns[split:split] = [f"element_pass_fraction_{name}" for name in output_names]
    after_mode = columns.index("mode") + 1
    columns[after_mode:after_mode] = list(shape_columns)
    return pd.DataFrame(rows).reindex(columns=columns)


def working_tree_state() -> dict:
    """``git_dirty`` and ``git_status`` of the tree that runs; both None where the commit recorded
    (``GIT_COMMIT``) is not the HEAD of the .git beside it (a copy of the tree whose .git is older): what
    git would compare against is then not the commit that runs."""
    commit, head = recorded_commit(), git_commit()
    if commit is not None and head is not None and commit != head:
        return dict(git_dirty=None, git_status=None)
    return dict(git_dirty=git_dirty(), git_status=git_status_lines())


def run_provenance(args, device: torch.device, ceilings: dict, suite: dict, reference_dtype, started) -> dict:
    """Where, when and how a harness run was made (``args``: the parsed command line)."""
    return dict(
        run_context(device, started, "moe_lib.bench"),
        device=str(device),
        liger_kernel=package_version("liger-kernel"),
        **working_tree_state(),
        ceilings=ceilings,
        seed=args.seed,
        suite=suite,
        small=args.small,
        reference_precision=reference_dtype,
        allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        timing=dict(
            warmup=args.warmup,
            reps=args.reps,
            l2_flush_bytes=timing.L2_FLUSH_BYTES,
            long_case_ms=timing.LONG_CASE_MS,
            min_long_case_reps=timing.MIN_LONG_CASE_REPS,
            official=bool(getattr(args, "official", False)),
        ),
        wrong_rel_error=WRONG_REL_ERROR,
        environment={name: os.environ.get(name) for name in RECORDED_ENVIRONMENT},
    )


# ---------------------------------------------------------------------------------------------
# summaries


def summarize_impls(frame: pd.DataFrame, impls: list[str], baselines) -> tuple[dict, dict]:
    """Per implementation: geomean_ms over its correct cases, roofline_fraction (geomean of T_sol/T),
    sol_score against the fastest of ``baselines`` (labels) correct on every case, all_correct, n_cases.
    Returns (per-impl summaries, baseline description)."""
    summary = {}
    sol_geomean = geomean(frame.drop_duplicates("num_tokens")["sol_ms"])
    for label in impls:
        rows = frame[frame["impl"] == label]
        ok = rows[rows["status"] == "ok"]
        element = [v for v in ok["passes_element_rule"] if v is not None and not pd.isna(v)]
        summary[label] = dict(
            geomean_ms=geomean(ok["median_ms"]),
            roofline_fraction=geomean(ok["sol_ms"] / ok["median_ms"]),
            sol_score=None,
            all_correct=bool(len(rows) > 0 and len(ok) == len(rows)),
            passes_element_rule=bool(all(element)) if element else None,
            n_cases=int(len(rows)),
            n_correct=int(len(ok)),
            timing=sorted(set(ok["timing"].dropna())),
            official_geomean_ms=geomean(ok["official_ms"]) if "official_ms" in ok else math.nan,
        )
    candidates = {label: s["geomean_ms"] for label, s in summary.items() if label in baselines and s["all_correct"]}
    baseline = dict(impl=None, geomean_ms=None, sol_geomean_ms=sol_geomean)
    if candidates:
        best = min(candidates, key=candidates.get)
        baseline.update(impl=best, geomean_ms=candidates[best])
        for s in summary.values():
            if s["all_correct"] and candidates[best] > sol_geomean:
                s["sol_score"] = roofline.sol_score(s["geomean_ms"], candidates[best], sol_geomean)
    return summary, baseline


def _is_false(value) -> bool:
    return value is not None and not pd.isna(value) and not bool(value)


def _official_table(frame: pd.DataFrame, order: list) -> pd.DataFrame | None:
    """Per case and implementation, the official-method median (None when no row has one)."""
    if "official_ms" not in frame or frame["official_ms"].isna().all():
        return None
    cells = frame.assign(cell=frame["official_ms"].map(format_ms))
    table = cells.pivot(index="num_tokens", columns="impl", values="cell")
    return table.reindex(index=order, columns=list(dict.fromkeys(frame["impl"])))


def _cell(row) -> str:
    status = row["status"]
    if status == "ok":
        return format_ms(row["median_ms"]) + (" *" if _is_false(row["passes_element_rule"]) else "")
    return status.split(":")[0].upper()


def format_tables(frame: pd.DataFrame, summary: dict, baseline: dict, title: str) -> str:
    """The per-case table (median per implementation) and the summary table, as text."""
    cells = frame.assign(cell=frame.apply(_cell, axis=1))
    per_case = cells.pivot(index="num_tokens", columns="impl", values="cell")
    order = list(dict.fromkeys(frame["num_tokens"]))
    per_case = per_case.reindex(index=order, columns=list(dict.fromkeys(frame["impl"])))
    sol = frame.drop_duplicates("num_tokens").set_index("num_tokens")["sol_ms"].reindex(order)
    per_case["sol (measured)"] = sol.map(format_ms)
    official = _official_table(frame, order)
    rows = []
    for label, s in summary.items():
        rows.append(
            dict(
                impl=label,
                geomean=format_ms(s["geomean_ms"]),
                roofline_fraction="-" if pd.isna(s["geomean_ms"]) else f"{s['roofline_fraction']:.3f}",
                score="-" if s["sol_score"] is None else f"{s['sol_score']:.3f}",
                all_correct=s["all_correct"],
                element_rule=s["passes_element_rule"],
                cases=f"{s['n_correct']}/{s['n_cases']}",
                timing=",".join(s["timing"]) or "-",
                official=format_ms(s.get("official_geomean_ms")),
            )
        )
    table = pd.DataFrame(rows).set_index("impl")
    lines = [title, "", per_case.to_string(), "", table.to_string()]
    if official is not None:
        lines[3:3] = [
            "",
            "the same calls in NVIDIA's harness's method (eager, fresh input addresses, CUPTI span "
            "from first kernel start to last kernel end):",
            official.to_string(),
        ]
    base = baseline["impl"]
    if base:
        lines.append(
            f"score baseline: {base} ({format_ms(baseline['geomean_ms'])} geomean), "
            f"T_sol geomean {format_ms(baseline['sol_geomean_ms'])}"
        )
    else:
        lines.append("score baseline: none (no baseline peer correct on every case)")
    lines.append("* = passes the 5e-2 rule but fails the element rule; WRONG = not timed")
    problems_found = frame[~frame["status"].isin(["ok"])]
    for _, row in problems_found.iterrows():
        lines.append(f"  {row['impl']} @ {row['num_tokens']}: {row['status']}")
    return "\n".join(lines)
