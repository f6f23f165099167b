"""The analysis behind notebooks 03–05: measured results, the roofline model, the kernels' tiling.

- **Results** (notebook 05): :func:`load_results` reads the benchmark's output,
  ``data/results/<GPU>/<date>-<problem>-<dtype>[-small][-<tag>].csv`` and the JSON beside it
  (provenance, per-implementation summary), into :class:`ResultFile`s; the tables of times,
  speed-ups, roofline fractions, scores, correctness and the project's targets are built from them.
- **Roofline** (notebook 03): ridge points, per-case cost tables (from :func:`moe_lib.roofline.cost`),
  where a problem crosses the ridge, measured points and their projection to another GPU, the plots.
- **Kernels** (notebook 04): the tile kinds and grids of the Triton launches, from the configs the
  kernel modules choose, and matplotlib diagrams of them. The kernel modules (and so triton) are
  imported only when these functions run.

Times are in milliseconds (``*_ms``) or microseconds (``*_us``) as the column names say; rates in
FLOP/s, bandwidths in B/s, intensities in FLOP per byte.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import patches

from . import bench, peers, problems, roofline
from .bench import geomean

ROOT = problems.DATA_DIR.parent
RESULTS_DIR = problems.DATA_DIR / "results"
OURS = "triton"  # the implementation the targets are about
IMPLS = ("reference", "torch_eager", "torch_compile", "grouped_mm", "liger", "triton")
IMPL_STYLE = {  # colour and marker of each implementation in every plot
    "reference": ("tab:gray", "o"),
    "torch_eager": ("tab:blue", "s"),
    "torch_compile": ("tab:purple", "D"),
    "grouped_mm": ("tab:orange", "^"),
    "liger": ("tab:green", "v"),
    "triton": ("tab:red", "*"),
}
PROBLEM_SHORT = {"swiglu_down_backward": "P1", "moe_experts_backward": "P2 fp32",
                 "moe_experts_backward_bf16": "P2 bf16"}  # fmt: skip
PROBLEM_TITLES = {
    "swiglu_down_backward": "P1 · swiglu_down_backward (bf16)",
    "moe_experts_backward": "P2 · moe_experts_backward (fp32)",
    "moe_experts_backward_bf16": "P2 · bf16 variant",
}
# problems.md: the fp32 interface of P2 needs bf16×3 products for three of its eight GEMMs to pass the
# element rule, 28·T·K·H·I FLOPs of bf16 tensor work in place of 16·T·K·H·I
P2_FP32_PRECISION_FLOPS_PER_TKHI = 28


def resolve_path(path) -> Path:
    """``path`` as a Path: absolute paths as given, relative ones from the repository root."""
    path = Path(path)
    return path if path.is_absolute() else ROOT / path


def format_ms(ms) -> str:
    """A time in ms as "12.3 µs", "4.56 ms" or "1.23 s"; "–" when missing."""
    return bench.format_ms(ms, missing="–")


# ================================================================ measured results


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
    def key(self) -> str:
        """The file's stem without its date: "<problem>-<dtype>[-small][-<tag>]"."""
        match = re.fullmatch(r"\d{4}-\d{2}-\d{2}-(.+)", self.csv.stem)
        return match.group(1) if match else self.csv.stem

    @property
    def title(self) -> str:
        return PROBLEM_TITLES.get(self.problem, self.problem) + (" · small shapes" if self.small else "")

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
        return roofline.GPUSpec.from_measured(ceilings["copy_bandwidth"], ceilings["bf16_matmul_flops"],
                                              name=f"measured ({self.gpu_key} run of {self.date})")  # fmt: skip

    @property
    def datasheet_spec(self) -> roofline.GPUSpec | None:
        """The datasheet figures of the GPU the run was made on (None for GPUs not in roofline.GPUS)."""
        return roofline.GPUS.get(self.gpu_key)


def _optional_bool(value):
    """True/False as read from a CSV, None where empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    return bool(value)


def load_result_file(csv_path) -> ResultFile:
    """One result file (``.csv`` with its ``.json`` beside it)."""
    csv_path = Path(csv_path)
    json_path = csv_path.with_suffix(".json")
    if not json_path.is_file():
        raise FileNotFoundError(f"{csv_path.name}: no {json_path.name} beside it (the run's provenance)")
    frame = pd.read_csv(csv_path)
    frame["passes_element_rule"] = frame["passes_element_rule"].map(_optional_bool).astype(object)
    frame["correct"] = frame["correct"].map(_optional_bool).astype(object)
    frame["num_tokens"] = frame["num_tokens"].astype(int)
    return ResultFile(csv=csv_path, frame=frame, meta=json.loads(json_path.read_text()))


def load_results(results_dir=RESULTS_DIR, gpu_key: str = "H200") -> dict[str, ResultFile]:
    """The newest benchmark-harness result file of each kind in ``<results_dir>/<gpu_key>/``, keyed by
    :attr:`ResultFile.key`, ordered P1, P2 fp32, P2 bf16 (full-size shapes before small ones).

    ``results_dir`` is relative to the repository root unless absolute. Only files of the problems in
    :mod:`moe_lib.problems` with a JSON beside them are read: other measurements kept there (the
    expert-parallel benchmark's, ``tuning/``) have other columns and are left out.
    """
    root = resolve_path(results_dir)
    folder = root / gpu_key
    if not folder.is_dir():
        available = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise FileNotFoundError(f"no results folder {folder} (GPU folders in {root}: {available or 'none'})")
    newest: dict[str, ResultFile] = {}
    for csv_path in sorted(folder.glob("*.csv")):
        json_path = csv_path.with_suffix(".json")
        if not json_path.is_file() or json.loads(json_path.read_text()).get("problem") not in problems.PROBLEM_NAMES:
            continue
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


def provenance_table(results: dict[str, ResultFile]) -> pd.DataFrame:
    """Where, when and with what each result file was measured: one row per file."""
    rows = {}
    for result in results.values():
        p = result.provenance
        ceilings = p.get("ceilings") or {}
        suite = p.get("suite") or {}
        commit = (p.get("git_commit") or "unknown")[:10] + (" (dirty)" if p.get("git_dirty") else "")
        rows[result.csv.name] = {
            "problem": result.problem,
            "dtype": result.dtype,
            "GPU": p.get("gpu_name") or result.gpu_key,
            "driver": p.get("driver_version"),
            "torch": p.get("torch"),
            "triton": p.get("triton"),
            "liger-kernel": p.get("liger_kernel"),
            "CUDA": p.get("cuda"),
            "commit": commit,
            "date (UTC)": p.get("date_utc"),
            "cases": f"{len(result.tokens)} ({suite.get('provenance', '?')}: {suite.get('source', '?')})",
            "copy TB/s": ceilings.get("copy_bandwidth", math.nan) / 1e12,
            "bf16 TFLOP/s": ceilings.get("bf16_matmul_flops", math.nan) / 1e12,
            "warm-up / reps": f"{(p.get('timing') or {}).get('warmup')} / {(p.get('timing') or {}).get('reps')}",
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def _ok_rows(result: ResultFile) -> pd.DataFrame:
    return result.frame[result.frame["status"] == "ok"]


def _impl_columns(result: ResultFile) -> list[str]:
    present = list(dict.fromkeys(result.frame["impl"]))
    return [impl for impl in IMPLS if impl in present] + [impl for impl in present if impl not in IMPLS]


def _pivot(result: ResultFile, column: str, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    rows = result.frame if rows is None else rows
    table = rows.pivot_table(index="num_tokens", columns="impl", values=column, aggfunc="first", dropna=False)
    table = table.reindex(index=result.tokens, columns=_impl_columns(result))
    table.columns.name = None
    return table


def times_table(result: ResultFile) -> pd.DataFrame:
    """Median ms per case (rows: token counts, ascending) and implementation (NaN where not timed),
    with T_sol against the run's measured ceilings and the GPU's datasheet."""
    table = _pivot(result, "median_ms", _ok_rows(result))
    cases = result.frame.drop_duplicates("num_tokens").set_index("num_tokens")
    table["T_sol (measured)"] = cases["sol_ms"].reindex(table.index)
    spec = result.datasheet_spec
    if spec is not None:
        table[f"T_sol ({result.gpu_key} datasheet)"] = [
            roofline.sol_time(result.problem, t, spec, result.dtype, **result.axes) * 1e3 for t in table.index
        ]
    return table


def best_peer(result: ResultFile) -> pd.DataFrame:
    """Per case, the fastest correct PyTorch peer (``moe_lib.peers.BASELINE_LABELS``): impl, median_ms
    and whether it passes the element rule (None where the problem has none)."""
    rows = _ok_rows(result)
    rows = rows[rows["impl"].isin(peers.BASELINE_LABELS)]
    best = rows.loc[rows.groupby("num_tokens")["median_ms"].idxmin()].set_index("num_tokens")
    table = best[["impl", "median_ms", "passes_element_rule"]].reindex(result.tokens)
    table.index.name = "num_tokens"
    return table


def speedup_table(result: ResultFile) -> pd.DataFrame:
    """Per case: the best PyTorch peer's name and time, and every implementation's speed-up over it
    (best peer's time / its time: above 1 is faster)."""
    times = _pivot(result, "median_ms", _ok_rows(result))
    best = best_peer(result)
    table = times.rdiv(best["median_ms"], axis=0)
    table.insert(0, "best peer (ms)", best["median_ms"])
    names = [impl + (" ✗rule" if passes is False else "")
             for impl, passes in zip(best["impl"].fillna("–"), best["passes_element_rule"], strict=True)]
    table.insert(0, "best peer", names)
    return table


def roofline_fraction_table(result: ResultFile) -> pd.DataFrame:
    """T_sol / T per case and implementation, T_sol from the run's measured ceilings (1 = at the roofline)."""
    return _pivot(result, "roofline_fraction", _ok_rows(result))


def impl_summary(result: ResultFile) -> pd.DataFrame:
    """Per implementation: geomean time over its correct cases, roofline fraction, the benchmark's
    score S = 1 / (1 + (T − T_sol)/(T_b − T_sol)) on geomeans (computed here with
    :func:`moe_lib.roofline.sol_score`, and as the file recorded it), correctness."""
    frame = result.frame
    sol_geomean = geomean(frame.drop_duplicates("num_tokens")["sol_ms"])
    rows = {}
    for impl in _impl_columns(result):
        mine = frame[frame["impl"] == impl]
        ok = mine[mine["status"] == "ok"]
        rows[impl] = {"geomean_ms": geomean(ok["median_ms"]),
                      "roofline_fraction": geomean(ok["sol_ms"] / ok["median_ms"]),
                      "cases_correct": f"{len(ok)}/{len(mine)}",
                      "all_correct": bool(len(mine) and len(ok) == len(mine)),
                      "element_rule": _element_rule_verdict(ok),
                      "worst_rel_error": ok["rel_error"].max() if len(ok) else math.nan}  # fmt: skip
    # the score's baseline, as the benchmark harness picks it: the fastest PyTorch peer correct on every case
    candidates = {impl: row["geomean_ms"] for impl, row in rows.items()
                  if impl in peers.BASELINE_LABELS and row["all_correct"]}  # fmt: skip
    baseline = min(candidates, key=candidates.get) if candidates else None
    baseline_ms = candidates[baseline] if baseline else math.nan
    summary = result.meta.get("summary", {})
    for impl, row in rows.items():
        usable = row["all_correct"] and baseline_ms > sol_geomean
        row["sol_score"] = roofline.sol_score(row["geomean_ms"], baseline_ms, sol_geomean) if usable else math.nan
        recorded = (summary.get(impl) or {}).get("sol_score")
        row["sol_score (file)"] = math.nan if recorded is None else recorded
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.attrs.update(baseline=baseline, baseline_ms=baseline_ms, sol_geomean_ms=sol_geomean)
    return table


def _element_rule_verdict(rows: pd.DataFrame) -> str:
    verdicts = [v for v in rows["passes_element_rule"] if v is not None]
    if not verdicts:
        return "no rule"
    failing = sum(not v for v in verdicts)
    return "passes" if not failing else f"FAILS on {failing}/{len(verdicts)} cases"


def correctness_table(result: ResultFile) -> pd.DataFrame:
    """Per implementation and case: status, worst relative error over the outputs, the element rule's
    pass fraction (worst output) and verdict; a ``flag`` for rows to read twice."""
    columns = ["impl", "num_tokens", "status", "rel_error", "element_pass_fraction", "passes_element_rule"]
    table = result.frame[columns].copy()
    flags = []
    for _, row in table.iterrows():
        if row["status"] != "ok":
            flags.append("not timed: " + row["status"].split(":")[0])
        elif row["passes_element_rule"] is False:
            flags.append("fails the element rule" + (" (ours: must pass)" if row["impl"] == OURS else " (peer)"))
        else:
            flags.append("")
    table["flag"] = flags
    order = {impl: i for i, impl in enumerate(_impl_columns(result))}
    table = table.sort_values(["impl", "num_tokens"], key=lambda c: c.map(order) if c.name == "impl" else c)
    return table.set_index(["impl", "num_tokens"])


def recorded_summary(result: ResultFile) -> dict:
    """{impl: {geomean_ms, all_correct}} as the result's JSON recorded them."""
    return {impl: {"geomean_ms": s.get("geomean_ms"), "all_correct": s.get("all_correct")}
            for impl, s in result.meta.get("summary", {}).items()}  # fmt: skip


def run_benchmark(problem: str, tokens: str, out_dir) -> dict[str, ResultFile]:
    """Runs ``python -m moe_lib.bench --problem <problem> --tokens <tokens> --out <out_dir>`` in this
    process (every implementation available on the device) and returns its result file as
    :func:`load_results` would."""
    from . import bench

    run = bench.run(bench.parse_args(["--problem", problem, "--tokens", tokens, "--out", str(out_dir)]))
    result = load_result_file(run["csv"])
    return {result.key: result}


def _styled(frame: pd.DataFrame, formats, caption: str):
    return frame.style.format(formats, na_rep="–").set_caption(caption)


def styled_times(result: ResultFile):
    """:func:`times_table` as a styled table, the fastest implementation of each case in bold."""
    table = times_table(result)
    impls = [c for c in table.columns if not c.startswith("T_sol")]
    return (_styled(table, format_ms, f"{result.title}: median GPU time per case ({result.csv.name})")
            .highlight_min(subset=impls, axis=1, props="font-weight: bold"))  # fmt: skip


def styled_speedups(result: ResultFile):
    """:func:`speedup_table` styled: speed-ups as "1.23×", green above 1, red below."""
    table = speedup_table(result)
    impls = [c for c in table.columns if not c.startswith("best peer")]

    def colour(value):
        if pd.isna(value) or value == 1:
            return ""
        return "color: #1a7f37" if value > 1 else "color: #cf222e"

    formats = {c: "{:.2f}×" for c in impls} | {"best peer (ms)": format_ms}
    return (_styled(table, formats, f"{result.title}: speed-up over the best PyTorch peer per case "
                    "(✗rule: that peer fails the element rule)").map(colour, subset=impls))  # fmt: skip


def styled_fractions(result: ResultFile):
    """:func:`roofline_fraction_table` styled, shaded from 0 to 1."""
    table = roofline_fraction_table(result)
    return (_styled(table, "{:.3f}", f"{result.title}: roofline fraction T_sol / T (the run's measured ceilings)")
            .background_gradient(cmap="Greens", vmin=0, vmax=1))  # fmt: skip


def styled_summary(result: ResultFile):
    """:func:`impl_summary` styled."""
    table = impl_summary(result)
    baseline = table.attrs["baseline"]
    caption = (f"{result.title}: geomeans over the correct cases; score baseline {baseline} "
               f"({format_ms(table.attrs['baseline_ms'])}), T_sol geomean {format_ms(table.attrs['sol_geomean_ms'])}")
    formats = {"geomean_ms": format_ms, "roofline_fraction": "{:.3f}", "worst_rel_error": "{:.2e}",
               "sol_score": "{:.3f}", "sol_score (file)": "{:.3f}"}  # fmt: skip
    return _styled(table, formats, caption)


def correctness_pivot(result: ResultFile) -> pd.DataFrame:
    """Per case (rows) and implementation: worst relative error, and the element rule's worst pass fraction."""
    errors = _pivot(result, "rel_error").add_suffix(" · rel. error")
    fractions = _pivot(result, "element_pass_fraction").add_suffix(" · elements passing")
    columns = [c for impl in _impl_columns(result) for c in (f"{impl} · rel. error", f"{impl} · elements passing")]
    table = pd.concat([errors, fractions], axis=1)[columns]
    return table.dropna(axis=1, how="all")


def styled_correctness(result: ResultFile):
    """:func:`correctness_pivot` styled: pass fractions below the rule's required fraction in red."""
    table = correctness_pivot(result)
    rule = result.meta.get("element_rule") or {}
    required = rule.get("required_fraction", 0.0)
    passing = [c for c in table.columns if c.endswith("elements passing")]
    formats = {c: "{:.2e}" for c in table.columns if c.endswith("rel. error")} | {c: "{:.4f}" for c in passing}
    caption = f"{result.title}: correctness per case" + (
        f" (element rule: |out − ref| ≤ {rule['atol']} + {rule['rtol']}·|ref| on ≥ {required:.0%} of elements)"
        if rule else " (no element rule: judged by relative error)")  # fmt: skip
    return _styled(table, formats, caption).map(
        lambda v: "color: #cf222e; font-weight: bold" if not pd.isna(v) and v < required else "", subset=passing)


def styled_targets(targets: pd.DataFrame):
    """:func:`targets_table` styled: met in green, not met in red, not settled in grey."""
    shown = targets.drop(columns=["value"]).copy()
    shown["met"] = shown["met"].map(lambda v: "met" if v is True else "NOT MET" if v is False else "not settled")
    colours = {"met": "color: #1a7f37; font-weight: bold", "NOT MET": "color: #cf222e; font-weight: bold",
               "not settled": "color: #57606a"}  # fmt: skip
    return (shown.style.map(lambda v: colours.get(v, ""), subset=["met"]).hide(axis="index")
            .set_properties(**{"text-align": "left"})
            .set_caption("The project's targets (measuring.md) beside our numbers"))  # fmt: skip


def styled_plan(plan: pd.DataFrame, caption: str):
    """A launch plan (:func:`p1_launch_plan`, :func:`p2_launch_plan`) styled, text left-aligned."""
    text = [c for c in plan.columns if plan[c].dtype == object]
    return plan.style.set_properties(subset=text, **{"text-align": "left"}).set_caption(caption)


def per_case_figure(results: dict[str, ResultFile], kind: str):
    """One panel per result file against the token count: ``kind`` "time" (median per implementation,
    log scale, with T_sol), "speedup" (over the best PyTorch peer) or "fraction" (roofline fraction)."""
    tables = {"time": times_table, "speedup": speedup_table, "fraction": roofline_fraction_table}
    labels = {"time": "median GPU time (ms)", "speedup": "speed-up over the best PyTorch peer",
              "fraction": "roofline fraction T_sol / T"}  # fmt: skip
    fig = plt.figure(figsize=(12, 4.8 if len(results) == 1 else 9.6), layout="constrained")
    grid = fig.add_gridspec(1 if len(results) == 1 else 2, max(len(results) - 1, 1))
    # the first file (P1 and its 16 cases) across the top, the others side by side below
    axes = [fig.add_subplot(grid[0, :])] + [fig.add_subplot(grid[1, i]) for i in range(len(results) - 1)]
    for ax, result in zip(axes, results.values(), strict=True):
        table = tables[kind](result)
        for impl in [c for c in table.columns if c in IMPL_STYLE or c in result.impls]:
            color, marker = IMPL_STYLE.get(impl, ("black", "x"))
            size = 9 if impl == OURS else 5
            ax.plot(table.index, table[impl], marker=marker, color=color, label=impl, markersize=size)
        if kind == "time":
            ax.plot(table.index, table["T_sol (measured)"], color="black", linestyle="--", label="T_sol (measured)")
            ax.set_yscale("log")
        elif kind == "speedup":
            ax.axhline(1.0, color="black", linewidth=1)
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="black", linewidth=1)
            ax.set_ylim(0, 1.05)
        ax.set_xscale("log")
        if len(table.index) <= 6:  # few cases: tick exactly those
            ax.set_xticks(list(table.index), [str(t) for t in table.index])
            ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set(xlabel="tokens T", ylabel=labels[kind], title=f"{result.title} · {result.gpu_key} · {result.date}")
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- the project's targets


def p2_fp32_floor_ms(result: ResultFile, num_tokens: int) -> float:
    """P2 fp32's floor at ``num_tokens`` with the run's measured ceilings: max(bytes / copy bandwidth,
    28·T·K·H·I / bf16 rate), the FLOPs counting the precision the element rule needs."""
    spec = result.measured_spec
    sizes = problems.load(result.problem).sizes(num_tokens, **result.axes)
    precision_flops = (P2_FP32_PRECISION_FLOPS_PER_TKHI * num_tokens * sizes["top_k"] * sizes["hidden_size"]
                       * sizes["intermediate_size"])  # fmt: skip
    traffic = roofline.minimal_bytes(result.problem, num_tokens, **result.axes)
    return max(traffic / spec.dram_bandwidth, precision_flops / spec.bf16_dense_flops) * 1e3


def _target(problem, target, value, text, met, note=""):
    return dict(problem=problem, target=target, ours=text, value=value, met=met, note=note)


def targets_table(results: dict[str, ResultFile], impl: str = OURS) -> pd.DataFrame:
    """The targets of measuring.md ("Numbers the project must reach") beside ``impl``'s numbers.

    ``met`` is True or False where the files settle it, None where they do not (a case not measured).
    P1: geomean ≤ 30 µs over the 16 cases, ≥ 1.9× faster than torch.compile, no case slower than it.
    P2 fp32: every case within 1.25× of its floor (:func:`p2_fp32_floor_ms`). P2 bf16: T = 2048 in
    ≤ 7.5 ms, T = 32768 at ≥ 600 TFLOP/s counting 16·T·K·H·I. And ours correct everywhere, passing
    the element rule where the problem has one.
    """
    rows = []
    p1 = find(results, "swiglu_down_backward")
    if p1 is None:
        rows.append(_target("P1", "swiglu_down_backward", math.nan, "not measured", None))
    else:
        times = times_table(p1)
        n_suite = len(problems.load("swiglu_down_backward").suite)
        ours, compiled = times.get(impl), times.get("torch_compile")
        cover = f"over {len(p1.tokens)} of the {n_suite} suite cases" + (" (small shapes)" if p1.small else "")
        complete = len(p1.tokens) == n_suite and not p1.small
        geo = geomean(ours.dropna()) if ours is not None else math.nan
        settled = complete and not pd.isna(geo)  # a geomean over part of the suite settles nothing
        rows.append(_target("P1", "geomean ≤ 30 µs", geo * 1e3, f"{format_ms(geo)} {cover}",
                            bool(geo * 1e3 <= 30) if settled else None))
        if compiled is not None and ours is not None:
            ratio = geomean(compiled.dropna()) / geo
            rows.append(_target("P1", "≥ 1.9× faster than torch.compile (geomeans)", ratio, f"{ratio:.2f}× {cover}",
                                bool(ratio >= 1.9) if settled else None))  # fmt: skip
            slower = [int(t) for t in times.index if ours[t] > compiled[t]]
            rows.append(_target("P1", "no case slower than torch.compile", len(slower),
                                f"{len(slower)} slower" + (f": T = {', '.join(map(str, slower))}" if slower else ""),
                                False if slower else (True if complete else None)))  # fmt: skip
        else:
            rows.append(_target("P1", "≥ 1.9× faster than torch.compile", math.nan, "torch.compile not measured", None))

    p2 = find(results, "moe_experts_backward")
    if p2 is None or p2.measured_spec is None:
        rows.append(_target("P2 fp32", "every case ≤ 1.25× its floor", math.nan, "not measured", None))
    else:
        ours = _ok_rows(p2)[_ok_rows(p2)["impl"] == impl].set_index("num_tokens")["median_ms"]
        ratios = {t: ours[t] / p2_fp32_floor_ms(p2, t) for t in p2.tokens if t in ours.index}
        worst = max(ratios, key=ratios.get) if ratios else None
        n_suite = len(problems.load("moe_experts_backward").suite)
        all_there = len(ratios) == n_suite and not p2.small
        met = False if any(r > 1.25 for r in ratios.values()) else (True if all_there else None)
        text = ("; ".join(f"T={t}: {format_ms(ours[t])} = {r:.2f}× floor" for t, r in ratios.items())
                + f" ({len(ratios)} of {n_suite} suite cases measured)") if ratios else "not measured"  # fmt: skip
        rows.append(_target("P2 fp32", "every case ≤ 1.25× its floor", ratios.get(worst, math.nan), text, met,
                            "floor: max(bytes / copy bandwidth, 28·T·K·H·I / bf16 rate), the run's ceilings"))

    p2b = find(results, "moe_experts_backward_bf16")
    ours = None if p2b is None else _ok_rows(p2b)[_ok_rows(p2b)["impl"] == impl].set_index("num_tokens")
    if ours is not None and 2048 in ours.index:
        ms = ours.loc[2048, "median_ms"]
        rows.append(_target("P2 bf16", "T = 2048 in ≤ 7.5 ms", ms, format_ms(ms), bool(ms <= 7.5)))
    else:
        rows.append(_target("P2 bf16", "T = 2048 in ≤ 7.5 ms", math.nan, "not measured", None))
    if ours is not None and 32768 in ours.index:
        rate = ours.loc[32768, "flops"] / (ours.loc[32768, "median_ms"] * 1e-3) / 1e12
        rows.append(_target("P2 bf16", "T = 32768 at ≥ 600 TFLOP/s (16·T·K·H·I)", rate, f"{rate:.0f} TFLOP/s",
                            bool(rate >= 600)))  # fmt: skip
    else:
        rows.append(_target("P2 bf16", "T = 32768 at ≥ 600 TFLOP/s (16·T·K·H·I)", math.nan, "not measured", None))

    for result in results.values():
        mine = result.frame[result.frame["impl"] == impl]
        if mine.empty:
            continue
        bad = mine[mine["status"] != "ok"]
        rule_failures = mine[mine["passes_element_rule"].map(lambda v: v is False)]
        has_rule = result.meta.get("element_rule") is not None
        what = "correct on every case" + (" and passes the element rule" if has_rule else "")
        text = f"{len(mine) - len(bad)}/{len(mine)} correct"
        if has_rule:
            text += f", {len(rule_failures)} fail the rule"
        rows.append(_target(PROBLEM_SHORT.get(result.problem, result.problem), what,
                            len(bad) + len(rule_failures), text, bool(bad.empty and rule_failures.empty)))
    table = pd.DataFrame(rows)
    table["met"] = pd.Series([row["met"] for row in rows], dtype=object)  # True, False or None, as Python objects
    return table


# ================================================================ roofline


def _spec(gpu) -> roofline.GPUSpec:
    """A GPUSpec from a key of :data:`moe_lib.roofline.GPUS` or a GPUSpec (a clear error otherwise)."""
    return roofline._gpu_spec(gpu)


def measured_specs(results: dict[str, ResultFile]) -> dict[str, roofline.GPUSpec]:
    """The ceilings each result file measured, as GPUSpecs keyed "<GPU> measured (<file key>)"."""
    return {f"{r.gpu_key} measured ({r.key})": r.measured_spec for r in results.values() if r.measured_spec}


def gpu_table(measured: dict[str, roofline.GPUSpec] | None = None) -> pd.DataFrame:
    """Every GPU of :data:`moe_lib.roofline.GPUS` (datasheet figures), then the ``measured`` ceilings:
    bf16 dense rate, DRAM bandwidth, ridge point, SMs and source."""
    specs = {**roofline.GPUS, **(measured or {})}
    rows = {label: {"bf16 dense (TFLOP/s)": s.bf16_dense_flops / 1e12, "DRAM (TB/s)": s.dram_bandwidth / 1e12,
                    "ridge (FLOP/B)": ridge_point(s), "SMs": s.sms, "source": s.source}
            for label, s in specs.items()}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index")


def styled_gpu_table(table: pd.DataFrame, highlight: str):
    """:func:`gpu_table` styled, the row ``highlight`` shaded."""
    formats = {"bf16 dense (TFLOP/s)": "{:.0f}", "DRAM (TB/s)": "{:.2f}", "ridge (FLOP/B)": "{:.0f}", "SMs": "{:.0f}"}
    return (_styled(table, formats, f"Ceilings and ridge points ({highlight} highlighted)")
            .apply(lambda row: ["background: #ddf4ff" if row.name == highlight else "" for _ in row], axis=1))


def ridge_point(gpu) -> float:
    """FLOP per byte where ``gpu`` turns compute-bound: bf16 dense rate / DRAM bandwidth."""
    spec = _spec(gpu)
    return spec.bf16_dense_flops / spec.dram_bandwidth


def attainable(gpu, intensity):
    """The roofline: attainable FLOP/s at ``intensity`` (FLOP/byte), min(peak, intensity · bandwidth)."""
    spec = _spec(gpu)
    return np.minimum(spec.bf16_dense_flops, np.asarray(intensity, dtype=float) * spec.dram_bandwidth)


def cost_table(problem: str, gpu, tokens=None, **axes) -> pd.DataFrame:
    """FLOPs, bytes, arithmetic intensity and roofline times of ``problem`` per case on ``gpu``.

    ``tokens``: the token counts (default: the problem's suite), shown ascending. Times in µs:
    t_memory = bytes / bandwidth, t_compute = FLOPs / bf16 rate, T_sol the larger; ``bound`` names it.
    """
    spec = _spec(gpu)
    tokens = sorted(problems.load(problem).suite if tokens is None else tokens)
    rows = []
    for t in tokens:
        work, traffic = roofline.cost(problem, t, **axes)
        t_memory, t_compute = traffic / spec.dram_bandwidth * 1e6, work / spec.bf16_dense_flops * 1e6
        rows.append(dict(num_tokens=t, flops=work, bytes=traffic, intensity=work / traffic if traffic else math.nan,
                         t_memory_us=t_memory, t_compute_us=t_compute, t_sol_us=max(t_memory, t_compute),
                         bound="compute" if t_compute >= t_memory else "memory"))  # fmt: skip
    return pd.DataFrame(rows).set_index("num_tokens")


def cost_coefficients(problem: str, **axes) -> tuple[int, int, int]:
    """(FLOPs per token a, bytes per token b, fixed bytes c): FLOPs = a·T and bytes = b·T + c.

    Read off :func:`moe_lib.roofline.cost` at 0, 1 and 2 tokens (and checked to be affine)."""
    (f0, b0), (f1, b1), (f2, b2) = (roofline.cost(problem, t, **axes) for t in (0, 1, 2))
    if f0 != 0 or f2 - f1 != f1 - f0 or b2 - b1 != b1 - b0:
        raise ValueError(f"{problem}: FLOPs and bytes are not affine in the token count")
    return f1, b1 - b0, b0


def ridge_crossing(problem: str, gpu, **axes) -> float:
    """The token count T* where ``problem``'s intensity a·T / (b·T + c) reaches ``gpu``'s ridge R:
    T* = R·c / (a − R·b); inf when the intensity never gets there (a ≤ R·b)."""
    a, b, c = cost_coefficients(problem, **axes)
    ridge = ridge_point(gpu)
    return ridge * c / (a - ridge * b) if a > ridge * b else math.inf


def crossing_table(gpus: dict, problem_names=problems.PROBLEM_NAMES) -> pd.DataFrame:
    """Per problem and GPU (``{label: key or GPUSpec}``): the ridge, the crossing T*, the first
    compute-bound token count ⌈T*⌉ and the intensity the problem tends to at large T (a / b)."""
    rows = []
    for problem in problem_names:
        a, b, _ = cost_coefficients(problem)
        for label, gpu in gpus.items():
            crossing = ridge_crossing(problem, gpu)
            rows.append(dict(problem=problem, gpu=label, ridge=ridge_point(gpu), crossing_tokens=crossing,
                             first_compute_bound=math.ceil(crossing) if math.isfinite(crossing) else None,
                             intensity_limit=a / b))  # fmt: skip
    return pd.DataFrame(rows).set_index(["problem", "gpu"])


def regime_table(cases, gpu) -> pd.DataFrame:
    """For ``cases`` [(problem, num_tokens), ...] on ``gpu``: memory and compute time, the bound, and the
    share of the bytes that are the weights and their gradients (the fixed bytes c of
    :func:`cost_coefficients`, read whatever T is)."""
    spec = _spec(gpu)
    rows = []
    for problem, t in cases:
        _, b, c = cost_coefficients(problem)
        row = cost_table(problem, spec, [t]).iloc[0]
        rows.append(dict(problem=problem, num_tokens=t, bound=row["bound"], t_memory_us=row["t_memory_us"],
                         t_compute_us=row["t_compute_us"], weight_bytes_share=c / (b * t + c),
                         weight_bytes_per_sm=c / spec.sms if spec.sms else math.nan))  # fmt: skip
    return pd.DataFrame(rows).set_index(["problem", "num_tokens"])


def styled_cost_table(table: pd.DataFrame, caption: str):
    """:func:`cost_table` styled: GFLOP, MB, FLOP/B and µs, the bound coloured."""
    shown = table.assign(flops=table["flops"] / 1e9, bytes=table["bytes"] / 1e6).rename(
        columns={"flops": "GFLOP", "bytes": "MB", "intensity": "FLOP/B", "t_memory_us": "t_memory (µs)",
                 "t_compute_us": "t_compute (µs)", "t_sol_us": "T_sol (µs)"})  # fmt: skip
    formats = {"GFLOP": "{:.3f}", "MB": "{:.1f}", "FLOP/B": "{:.1f}", "t_memory (µs)": "{:.1f}",
               "t_compute (µs)": "{:.1f}", "T_sol (µs)": "{:.1f}"}  # fmt: skip
    colours = {"memory": "color: #0969da", "compute": "color: #cf222e; font-weight: bold"}
    return _styled(shown, formats, caption).map(lambda v: colours.get(v, ""), subset=["bound"])


def measured_points(results: dict[str, ResultFile]) -> pd.DataFrame:
    """Every timed (ok) row as a point of the roofline plot: intensity and achieved FLOP/s, and the GPU it ran on."""
    frames = []
    for result in results.values():
        ok = _ok_rows(result)
        frames.append(pd.DataFrame({
            "problem": result.problem, "impl": ok["impl"], "num_tokens": ok["num_tokens"], "gpu": result.gpu_key,
            "flops": ok["flops"], "bytes": ok["bytes"], "intensity": ok["flops"] / ok["bytes"],
            "median_ms": ok["median_ms"], "flop_rate": ok["flops"] / (ok["median_ms"] * 1e-3),
            "file": result.csv.name,
        }))  # fmt: skip
    columns = ["problem", "impl", "num_tokens", "gpu", "flops", "bytes", "intensity", "median_ms", "flop_rate", "file"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def project_points(points: pd.DataFrame, to_gpu: str) -> pd.DataFrame:
    """The points with ``projected_rate`` and ``projected_ms`` on ``to_gpu``: each keeps its fraction of the
    roofline, i.e. its rate is scaled by roof(to_gpu, I) / roof(its GPU, I) at its intensity I. Where both
    GPUs are memory-bound at I that is the ratio of the bandwidths, where both are compute-bound the ratio
    of the bf16 rates. Points measured on ``to_gpu`` itself keep their rate; points from a GPU not in
    :data:`moe_lib.roofline.GPUS` get NaN."""
    projected = points.copy()
    ratios = []
    for gpu, intensity in zip(points["gpu"], points["intensity"], strict=True):
        if gpu == to_gpu:
            ratios.append(1.0)
        elif gpu in roofline.GPUS:
            ratios.append(float(attainable(to_gpu, intensity) / attainable(gpu, intensity)))
        else:
            ratios.append(math.nan)
    projected["scale"] = ratios
    projected["projected_rate"] = projected["flop_rate"] * projected["scale"]
    projected["projected_ms"] = projected["median_ms"] / projected["scale"]
    projected["projected"] = projected["gpu"] != to_gpu
    return projected


def points_table(points: pd.DataFrame, gpu: str, impl: str = OURS) -> pd.DataFrame:
    """``impl``'s points (from :func:`project_points`) with the fraction of ``gpu``'s roofline they reach."""
    mine = points[points["impl"] == impl].copy()
    mine["roofline fraction"] = mine["projected_rate"] / attainable(gpu, mine["intensity"])
    mine = mine.sort_values(["problem", "num_tokens"]).set_index(["problem", "num_tokens"])
    return mine[["gpu", "intensity", "flop_rate", "projected_rate", "roofline fraction"]].rename(
        columns={"gpu": "measured on", "flop_rate": "measured FLOP/s", "projected_rate": f"FLOP/s on {gpu}"})


def _label_roofs(ax, spec: roofline.GPUSpec, x_min: float, color: str) -> None:
    ridge = spec.bf16_dense_flops / spec.dram_bandwidth
    ax.annotate(f"DRAM {spec.dram_bandwidth / 1e12:.2f} TB/s", (x_min * 1.5, x_min * 1.5 * spec.dram_bandwidth),
                rotation=33, color=color, fontsize=8, va="bottom")  # fmt: skip
    ax.annotate(f"bf16 dense {spec.bf16_dense_flops / 1e12:.0f} TFLOP/s", (ridge * 1.15, spec.bf16_dense_flops),
                color=color, fontsize=8, va="bottom")  # fmt: skip


def plot_roofline(ax, gpu: str, *, x_range=(0.5, 5000.0), measured: roofline.GPUSpec | None = None) -> None:
    """The two ceilings of ``gpu`` (log-log: attainable FLOP/s against FLOP/byte), its ridge, and
    optionally a run's measured ceilings (dashed)."""
    spec = _spec(gpu)
    x = np.logspace(math.log10(x_range[0]), math.log10(x_range[1]), 400)
    ax.loglog(x, attainable(spec, x), color="black", linewidth=2, label=f"{gpu} roofline (datasheet)")
    ridge = ridge_point(spec)
    ax.axvline(ridge, color="black", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, 0.03), xycoords=ax.get_xaxis_transform(), rotation=90,
                fontsize=8, ha="right", va="bottom")  # fmt: skip
    _label_roofs(ax, spec, x_range[0], "black")
    if measured is not None:
        ax.loglog(x, attainable(measured, x), color="tab:gray", linestyle="--", linewidth=1.2,
                  label=f"{measured.name}: {measured.dram_bandwidth / 1e12:.2f} TB/s, "
                        f"{measured.bf16_dense_flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    ax.set(xlim=x_range, xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP/s")
    ax.grid(alpha=0.3, which="both")


def roofline_figure(gpu: str, points: pd.DataFrame, results: dict[str, ResultFile] | None = None):
    """One roofline panel per problem with points: measured ones (filled) where they ran on ``gpu``,
    projected ones (hollow, labelled so) where they ran elsewhere. Returns the figure."""
    projected = project_points(points, gpu)
    names = [p for p in problems.PROBLEM_NAMES if p in set(points["problem"])] or list(problems.PROBLEM_NAMES)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 5.6 * len(names)), sharex=True, squeeze=False)
    y_min = max(1e9, projected["projected_rate"].min() / 3) if len(projected) else 1e10
    for ax, problem in zip(axes[:, 0], names, strict=True):
        result = find(results, problem) if results else None
        same_gpu = result is not None and result.gpu_key == gpu
        plot_roofline(ax, gpu, measured=result.measured_spec if same_gpu else None)
        mine = projected[projected["problem"] == problem]
        for impl in [i for i in IMPLS if i in set(mine["impl"])] + sorted(set(mine["impl"]) - set(IMPLS)):
            rows = mine[mine["impl"] == impl]
            color, marker = IMPL_STYLE.get(impl, ("black", "x"))
            for was_projected, group in rows.groupby("projected"):
                source = ", ".join(sorted(set(group["gpu"])))
                label = f"{impl} (projected from {source})" if was_projected else f"{impl} (measured, {source})"
                ax.scatter(group["intensity"], group["projected_rate"], color=color if not was_projected else "none",
                           edgecolors=color, marker=marker, s=70 if impl == OURS else 38, linewidths=1.2,
                           label=label, zorder=3)  # fmt: skip
        ours = mine[mine["impl"] == OURS].sort_values("num_tokens")
        shown = ours if len(ours) <= 4 else ours.iloc[[0, len(ours) // 2, len(ours) - 1]]
        for _, row in shown.iterrows():
            ax.annotate(f"T={row['num_tokens']}", (row["intensity"], row["projected_rate"]), textcoords="offset points",
                        xytext=(5, -11), fontsize=8, color=IMPL_STYLE[OURS][0])  # fmt: skip
        ax.set_ylim(y_min, _spec(gpu).bf16_dense_flops * 4)
        ax.set_title(f"{PROBLEM_TITLES.get(problem, problem)} on {gpu}", fontsize=11)
        ax.legend(fontsize=8, loc="lower right")
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.tight_layout()
    return fig


def intensity_figure(gpu: str, problem_names=problems.PROBLEM_NAMES, measured: dict | None = None):
    """Arithmetic intensity against token count for each problem, its suite cases marked, with the ridge
    of ``gpu`` (and of ``measured``: {label: GPUSpec}) and where each problem crosses it."""
    fig, ax = plt.subplots(figsize=(9, 5))
    colors = dict(zip(problems.PROBLEM_NAMES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    t = np.unique(np.logspace(0, math.log10(65536), 300).astype(int))
    ridges = {f"{gpu} ridge (datasheet)": _spec(gpu), **(measured or {})}
    for problem in problem_names:
        a, b, c = cost_coefficients(problem)
        suite = np.array(problems.load(problem).suite)
        color = colors.get(problem, "black")
        ax.loglog(t, a * t / (b * t + c), color=color, label=PROBLEM_TITLES.get(problem, problem))
        label = "suite cases" + (" (assumed)" if problems.load(problem).suite_provenance == "assumed" else "")
        ax.scatter(suite, a * suite / (b * suite + c), color=color, s=18, zorder=3, label=f"  {label}")
        crossing = ridge_crossing(problem, gpu)
        if math.isfinite(crossing):
            ax.axvline(crossing, color=color, linestyle=":", linewidth=1)
            ax.annotate(f"T* = {crossing:.0f}", (crossing, 0.03), xycoords=ax.get_xaxis_transform(), rotation=90,
                        color=color, fontsize=8, ha="right", va="bottom")  # fmt: skip
    for (label, spec), style in zip(ridges.items(), ("--", "-."), strict=False):
        ax.axhline(ridge_point(spec), color="black", linestyle=style, linewidth=1,
                   label=f"{label}: {ridge_point(spec):.0f} FLOP/B")  # fmt: skip
    ax.set_ylim(bottom=0.5)
    ax.set(xlabel="tokens T", ylabel="arithmetic intensity (FLOP / byte)",
           title=f"Where each problem turns compute-bound on {gpu}")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", framealpha=0.95)
    fig.tight_layout()
    return fig


# ================================================================ kernels: tiling and grids


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextlib.contextmanager
def _interpreter_setting(on: bool):
    """TRITON_INTERPRET set to ``on`` for the duration; :func:`choose_config` of P1 reads it when called."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def p1_config(num_tokens: int, hidden_size: int, intermediate_size: int, *, interpreter: bool):
    """The TileConfig P1's kernel chooses on a GPU (``interpreter=False``) or under the interpreter."""
    from .kernels import swiglu_down_backward as kernel

    with _interpreter_setting(interpreter):
        return kernel.choose_config(num_tokens, hidden_size, intermediate_size)


def split_ranges(length: int, split: int, block_k: int) -> list[tuple[int, int]]:
    """[k_start, k_end) of each split of a reduction of ``length`` (the kernel's ``_split_range``):
    BLOCK_K-aligned pieces of ⌈⌈length / split⌉ / block_k⌉ · block_k; trailing ones may be empty."""
    per_split = _cdiv(_cdiv(length, split), block_k) * block_k
    return [(min(s * per_split, length), min((s + 1) * per_split, length)) for s in range(split)]


def rows_read(k_start: int, k_end: int, intermediate_size: int) -> str:
    """Which weight a dx program's reduction range [k_start, k_end) over the 2I rows of [Wg; Wu] reads."""
    if k_start >= k_end:
        return "empty"
    if k_end <= intermediate_size:
        return "Wg"
    return "Wu" if k_start >= intermediate_size else "Wg and Wu"


def p1_launch_plan(num_tokens: int, hidden_size: int, intermediate_size: int, config) -> pd.DataFrame:
    """The tile kinds of P1's two launches under ``config`` (a TileConfig), in program order.

    Per kind: what it computes, its output [M, N], the reduction, tile shape, split, tiles and
    programs (tiles × split) and the range of program ids it gets in its launch; the kernels put the
    weight-gradient kinds (long reductions over T) first.
    """
    T, H, I = num_tokens, hidden_size, intermediate_size
    kinds = [  # (launch, kind, computes, M, N, reduction name, reduction length, config field)
        (1, "dWd", "dWd = dyᵀ · intermediate", H, I, "T", T, config.grad_down),
        (1, "dA", "dA = dy · Wd, epilogue dGate, dUp", T, I, "H", H, config.d_intermediate),
        (2, "dWg", "dWg = dGateᵀ · x", I, H, "T", T, config.grad_gate_up),
        (2, "dWu", "dWu = dUpᵀ · x", I, H, "T", T, config.grad_gate_up),
        (2, "dx", "dx = dGate · Wg + dUp · Wu", T, H, "2I", 2 * I, config.grad_x),
    ]
    rows, first = [], {1: 0, 2: 0}
    for launch, kind, computes, m, n, reduce_name, reduce_length, (bm, bn, bk, split) in kinds:
        tiles = _cdiv(m, bm) * _cdiv(n, bn)
        programs = tiles * split
        rows.append(dict(launch=launch, kind=kind, computes=computes, output=f"[{m}, {n}]", M=m, N=n,
                         reduce=f"{reduce_name} = {reduce_length}", reduce_length=reduce_length,
                         tile=f"{bm}×{bn}×{bk}", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split=split, tiles=tiles,
                         programs=programs, first_program=first[launch]))  # fmt: skip
        first[launch] += programs
    return pd.DataFrame(rows)


def p1_grid_table(token_counts, hidden_size: int, intermediate_size: int, *, interpreter: bool = False) -> pd.DataFrame:
    """Per token count: the tile shape and split of each kind and the programs of each launch, with
    the configs :func:`p1_config` gives (GPU by default)."""
    rows = {}
    for t in token_counts:
        plan = p1_launch_plan(t, hidden_size, intermediate_size,
                              p1_config(t, hidden_size, intermediate_size, interpreter=interpreter))  # fmt: skip
        row = {f"{r.kind} tile (split)": f"{r.tile} ({r.split})" for r in plan.itertuples() if r.kind != "dWu"}
        row.update({f"launch {n} programs": int(plan[plan["launch"] == n]["programs"].sum()) for n in (1, 2)})
        rows[t] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "num_tokens"
    return table


def p2_config(num_tokens: int, num_experts: int, top_k: int, *, input_bytes: int, interpreter: bool):
    """The LaunchConfig P2's kernels choose for T·K slots over E experts."""
    from .kernels import moe_experts_backward as kernel

    return kernel.launch_config(num_tokens * top_k, num_experts, input_bytes=input_bytes, interpreter=interpreter)


def p2_weight_grad_grids(hidden_size: int, intermediate_size: int, config) -> list[dict]:
    """Kernel W's two launches under ``config``: dWg·dWu ([I, H] per expert) and dWd ([H, I]), each with
    its tile (BLOCK_M, BLOCK_N, BLOCK_ROWS), M-tiles, N-tiles, N-tiles per program n and N-groups."""
    H, I = hidden_size, intermediate_size
    grids = []
    for name, size_m, size_n, tile in (("dWg·dWu", I, H, config.grad_gate_up_tile),
                                       ("dWd", H, I, config.grad_down_tile)):  # fmt: skip
        m_tiles, n_tiles = _cdiv(size_m, tile[0]), _cdiv(size_n, tile[1])
        n = min(config.n_tiles_per_program, n_tiles)
        grids.append(dict(name=name, size_m=size_m, size_n=size_n, tile=tile, m_tiles=m_tiles, n_tiles=n_tiles,
                          n=n, n_groups=_cdiv(n_tiles, n)))  # fmt: skip
    return grids


def p2_launch_plan(num_tokens: int, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                   config) -> pd.DataFrame:  # fmt: skip
    """P2's backward under ``config`` (a LaunchConfig): routing, then kernels A, W (twice), D and C, each
    with its grid, programs (0 where it is not launched: A, D and C need T·K > 0) and what one program does."""
    T, H, I, E, K = num_tokens, hidden_size, intermediate_size, num_experts, top_k
    i_tiles, dx_tiles, R = _cdiv(I, config.block_i), _cdiv(H, config.block_h_dx), config.row_split
    sum_tiles = _cdiv(H, config.block_h_sum)
    launched = T * K > 0
    gate_up, down = p2_weight_grad_grids(H, I, config)

    def weight_grad(grid, dims, outputs):
        bm, bn, rows = grid["tile"]
        m_tiles, n, n_groups = grid["m_tiles"], grid["n"], grid["n_groups"]
        up_to = "up to " if grid["n_tiles"] % n else ""  # the last group of N-tiles has fewer
        tiles = f"one tile of {bm}×{bn} ({dims})" if n == 1 else f"{up_to}{n} tiles of {bm}×{bn} ({dims}) in turn"
        text = f"{outputs} on {tiles}, each reduced over all the expert's rows in steps of {rows}; exact zeros for an "
        text += "expert with no rows"
        return dict(grid=f"{E} × {m_tiles} × {n_groups}", programs=E * m_tiles * n_groups, one_program=text)

    rows = [
        dict(step="0 · routing", grid="torch ops on the device", programs=0,
             one_program="sort the T·K slots by expert (stable); expert_offsets by searchsorted"),
        dict(step="A · per (expert, I-tile, r)", grid=f"{E} × {i_tiles} × {R}", programs=E * i_tiles * R * launched,
             one_program=f"gᵀ, uᵀ, (Wdᵀdy)ᵀ on an I-tile of {config.block_i} (M side) for row blocks r, r+R, … of "
                         f"{config.block_m} rows (N side), over H in steps of {config.block_h}; dSwiGLU and "
                         "⟨Wdᵀdy, a⟩ in the epilogue"),
        dict(step="W_gate_up · per (expert, I-tile, group of H-tiles)", **weight_grad(gate_up, "I×H", "dWg and dWu")),
        dict(step="W_down · per (expert, H-tile, group of I-tiles)", **weight_grad(down, "H×I", "dWd")),
        dict(step="D · per (expert, H-tile, r)", grid=f"{E} × {dx_tiles} × {R}", programs=E * dx_tiles * R * launched,
             one_program=f"dX_slotᵀ = Wgᵀdgᵀ + Wuᵀduᵀ on an H-tile of {config.block_h_dx} (M side) for row blocks "
                         f"r, r+R, … of {config.block_m} rows (N side), over I in steps of {config.block_i_dx}"),
        dict(step="C · per (token, H-tile)", grid=f"{T} × {sum_tiles}", programs=T * sum_tiles * launched,
             one_program=f"grad_hidden_states[t] = Σ_k dX_slot[t·K + k] on {config.block_h_sum} columns; "
                         "grad_topk_weights summed over the I-tiles' partials"),
    ]  # fmt: skip
    return pd.DataFrame(rows).set_index("step")


def p2_grid_table(token_counts, problem: str = "moe_experts_backward", *, interpreter: bool = False) -> pd.DataFrame:
    """Per token count at ``problem``'s shape: the row split R and the programs of each launch (kernel A,
    kernel W_gate_up and W_down for the two launches of W, D and C), named after the plan's steps."""
    definition = problems.load(problem)
    input_bytes = 4 if definition.dtype == problems.DTYPES["float32"] else 2
    rows = {}
    for t in token_counts:
        s = definition.sizes(t)
        config = p2_config(t, s["num_experts"], s["top_k"], input_bytes=input_bytes, interpreter=interpreter)
        plan = p2_launch_plan(t, s["hidden_size"], s["intermediate_size"], s["num_experts"], s["top_k"], config)
        rows[t] = {"slots per expert (mean)": t * s["top_k"] / s["num_experts"], "row split R": config.row_split,
                   **{f"kernel {step.split(' ')[0]} programs": int(n) for step, n in plan["programs"].items()
                      if not step.startswith("0")}}  # fmt: skip
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "num_tokens"
    return table


_KIND_COLORS = {"dWd": "tab:blue", "dA": "tab:orange", "dWg": "tab:green", "dWu": "tab:olive", "dx": "tab:red"}


def _draw_matrix(ax, row, max_tiles: int = 4096) -> None:
    """One output matrix in element units (N across, M down) with its tile grid, hatched where split-K."""
    color = _KIND_COLORS.get(row.kind, "tab:gray")
    ax.add_patch(patches.Rectangle((0, 0), row.N, row.M, facecolor=color, alpha=0.18, edgecolor=color, lw=1.5))
    if row.tiles <= max_tiles:
        for i in range(0, row.M, row.BLOCK_M):
            for j in range(0, row.N, row.BLOCK_N):
                ax.add_patch(patches.Rectangle((j, i), min(row.BLOCK_N, row.N - j), min(row.BLOCK_M, row.M - i),
                                               fill=False, edgecolor=color, lw=0.6,
                                               hatch="///" if row.split > 1 else None))  # fmt: skip
    ax.set(xlim=(0, row.N), ylim=(row.M, 0), xticks=[0, row.N], yticks=[0, row.M])
    ax.set_box_aspect(min(max(row.M / row.N, 0.08), 2.7))  # the matrix's shape, within reason
    ax.tick_params(labelsize=7)
    split = f"split-K ×{row.split} over {row.reduce}" if row.split > 1 else f"reduces over {row.reduce}"
    ax.set_title(f"{row.computes}\n{row.output}: {row.tiles} tiles of {row.BLOCK_M}×{row.BLOCK_N}\n{split}; "
                 f"programs {row.first_program}–{row.first_program + row.programs - 1}", fontsize=8)  # fmt: skip


def p1_tiling_figure(num_tokens: int, hidden_size: int, intermediate_size: int, config):
    """P1's two launches: each tile kind's output matrix with its tile grid (hatched where split-K), and
    a bar of the launch's program ids coloured by kind (the order the kernel hands them out)."""
    plan = p1_launch_plan(num_tokens, hidden_size, intermediate_size, config)
    fig = plt.figure(figsize=(13, 10), layout="constrained")
    for subfig, n in zip(fig.subfigures(2, 1, hspace=0.05), (1, 2), strict=True):
        kinds = plan[plan["launch"] == n]
        grid = subfig.add_gridspec(2, len(kinds), height_ratios=[6, 1])
        for column, row in enumerate(kinds.itertuples()):
            _draw_matrix(subfig.add_subplot(grid[0, column]), row)
        total = int(kinds["programs"].sum())
        bar_ax = subfig.add_subplot(grid[1, :])
        for row in kinds.itertuples():
            bar_ax.barh(0, row.programs, left=row.first_program, color=_KIND_COLORS[row.kind], alpha=0.7,
                        edgecolor="black", hatch="///" if row.split > 1 else None)  # fmt: skip
            bar_ax.text(row.first_program + row.programs / 2, 0, f"{row.kind}: {row.programs}", ha="center",
                        va="center", fontsize=8)  # fmt: skip
        bar_ax.set(xlim=(0, total), yticks=[], xlabel="program id, tl.program_id(0)")
        subfig.suptitle(f"launch {n}: {total} programs  (T = {num_tokens}, H = {hidden_size}, I = {intermediate_size})",
                        fontsize=11, x=0.01, ha="left")  # fmt: skip
    return fig


def split_k_figure(split: int = 4):
    """How one tile's reduction is split over ``split`` programs and combined deterministically."""
    fig, ax = plt.subplots(figsize=(12, 4.2))
    ax.set(xlim=(0, 12), ylim=(0, 4.4))
    ax.axis("off")

    def box(x, y, w, h, text, color):
        ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=color, alpha=0.25,
                                            edgecolor=color))  # fmt: skip
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", color="black", lw=0.8))

    ax.text(0.1, 4.2, f"one output tile, its reduction over K split into {split} BLOCK_K-aligned ranges",
            fontsize=9, weight="bold")  # fmt: skip
    height = 3.4 / split
    for s in range(split):
        y = 3.6 - (s + 1) * height
        box(0.1, y + 0.05, 3.0, height - 0.15, f"program (tile, split {s})\nacc = Σ over K-range {s}", "tab:blue")
        box(4.0, y + 0.05, 2.2, height - 0.15, f"partials[tile, {s}] (fp32)", "tab:gray")
        arrow(3.15, y + height / 2, 3.95, y + height / 2)
        arrow(6.25, y + height / 2, 7.35, 1.9)
    box(4.0, 3.75, 2.2, 0.35, "counter[tile] += 1 (atomic)", "tab:purple")
    box(7.4, 1.2, 4.4, 1.4, "the program that counts in last:\n"
        + " + ".join(f"p{s}" for s in range(split)) + "  (in split order,\nwhoever arrived when)\n→ epilogue → store",
        "tab:red")  # fmt: skip
    ax.text(7.4, 0.5, "The sum's order is fixed, so the result is the same bit for bit on every run;\n"
            "the counters only grow (by SPLIT per call), so they never need a reset.", fontsize=8)  # fmt: skip
    return fig


def p2_tiling_figure(topk_indices, num_experts: int, hidden_size: int, intermediate_size: int, config):
    """P2's dataflow for one routing: slots in token order and sorted by expert (with expert_offsets),
    the row blocks of each expert and which row-split program r of kernels A and D works on them, and the
    grids of kernels A, W (its two launches in one panel), D and C."""
    from .kernels.routing import route_by_expert

    T, K = topk_indices.shape
    E, R = num_experts, config.row_split
    routing = route_by_expert(topk_indices, E)
    offsets = routing.expert_offsets.tolist()
    experts_in_token_order = topk_indices.reshape(-1).tolist()
    experts_sorted = topk_indices.reshape(-1)[routing.sorted_slot.long()].tolist()
    cmap = plt.get_cmap("tab10" if E <= 10 else "tab20")
    fig = plt.figure(figsize=(13, 8.5))
    grid = fig.add_gridspec(3, 4, height_ratios=[1.1, 1.8, 2.2], hspace=0.6, wspace=0.35)

    ax = fig.add_subplot(grid[0, :])
    for row_y, experts, title in ((1.2, experts_in_token_order, "slots s = t·K + k (token order)"),
                                  (0.0, experts_sorted, "sorted by expert (sorted_slot)")):  # fmt: skip
        for p, e in enumerate(experts):
            ax.add_patch(patches.Rectangle((p, row_y), 1, 0.8, facecolor=cmap(e % cmap.N), edgecolor="white"))
            ax.text(p + 0.5, row_y + 0.4, str(e), ha="center", va="center", fontsize=7 if T * K <= 48 else 5)
        ax.text(-0.5, row_y + 0.4, title, ha="right", va="center", fontsize=8)
    for e, start in enumerate(offsets):
        ax.axvline(start, ymin=0.0, ymax=0.4, color="black", lw=1.2)
        if e < E:
            ax.text(start, -0.35, f"off[{e}]={start}", fontsize=6, rotation=0, ha="left", va="top")
    ax.set(xlim=(-0.2 * T * K - 2, T * K + 0.5), ylim=(-0.8, 2.2))
    ax.axis("off")
    ax.set_title("routing metadata: the number in each cell is its expert", fontsize=10, loc="left")

    ax = fig.add_subplot(grid[1, :])
    counts = [offsets[e + 1] - offsets[e] for e in range(E)]
    block_colors = plt.get_cmap("Set2")
    for e in range(E):
        for b, start in enumerate(range(0, max(counts[e], 1), config.block_m)):
            if counts[e] == 0:
                ax.text(0.5, e, "no rows: W still writes zeros to dWg, dWu, dWd", va="center", fontsize=7)
                break
            rows = min(config.block_m, counts[e] - start)
            ax.barh(e, rows, left=start, color=block_colors(b % R), edgecolor="black", height=0.7)
            ax.text(start + rows / 2, e, f"r={b % R}", ha="center", va="center", fontsize=7)
    ax.set(yticks=range(E), yticklabels=[f"expert {e}" for e in range(E)], xlabel="rows of the expert (its slots)",
           title=f"row blocks of {config.block_m} rows: in kernels A and D, program r = block mod R takes them "
                 f"(R = {R})")  # fmt: skip
    ax.invert_yaxis()
    ax.title.set_fontsize(10)

    i_tiles, dx_tiles = _cdiv(intermediate_size, config.block_i), _cdiv(hidden_size, config.block_h_dx)
    sum_tiles = _cdiv(hidden_size, config.block_h_sum)
    gate_up, down = p2_weight_grad_grids(hidden_size, intermediate_size, config)
    w_ticks = [(f"{m}·{g}", hatch) for grid_, hatch in ((gate_up, None), (down, "////"))
               for m in range(grid_["m_tiles"]) for g in range(grid_["n_groups"])]  # fmt: skip
    panels = (  # title, rows, (tick, hatch) per column, programs per cell, x label
        (f"kernel A: {E}×{i_tiles}×{R} programs", E, [(str(j), None) for j in range(i_tiles)], R,
         "I-tile (R programs each)"),
        (f"kernel W: {E}×{gate_up['m_tiles']}×{gate_up['n_groups']} (dWg·dWu)\n"
         f"+ {E}×{down['m_tiles']}×{down['n_groups']} (dWd, hatched) programs", E, w_ticks, 1,
         "M-tile·N-group: dWg·dWu | dWd"),
        (f"kernel D: {E}×{dx_tiles}×{R} programs", E, [(str(j), None) for j in range(dx_tiles)], R,
         "H-tile (R programs each)"),
        (f"kernel C: {T}×{sum_tiles} programs", T, [(str(j), None) for j in range(sum_tiles)], 1, "H-tile"),
    )  # fmt: skip
    for col, (title, rows_, ticks, split, xlabel) in enumerate(panels):
        ax = fig.add_subplot(grid[2, col])
        for i in range(rows_):
            color = cmap(i % cmap.N) if col < 3 else "tab:gray"
            for j, (_, hatch) in enumerate(ticks):
                for r in range(split):
                    ax.add_patch(patches.Rectangle((j + r / split, i), 1 / split, 1, facecolor=color, hatch=hatch,
                                                   alpha=0.35 + 0.5 * r / split, edgecolor="white"))  # fmt: skip
                    if split > 1 and rows_ * len(ticks) * split <= 64:
                        ax.text(j + (r + 0.5) / split, i + 0.5, f"r{r}", ha="center", va="center", fontsize=7)
        step = max(1, rows_ // 16)
        ax.set_xticks([j + 0.5 for j in range(len(ticks))], [tick for tick, _ in ticks])
        ax.set_yticks([i + 0.5 for i in range(0, rows_, step)], [str(i) for i in range(0, rows_, step)])
        ax.tick_params(labelsize=7)
        ax.set(xlim=(0, len(ticks)), ylim=(rows_, 0), xlabel=xlabel, ylabel="expert" if col < 3 else "token",
               title=title)  # fmt: skip
        if col == 1:  # kernel W: its dWg·dWu launch, then its dWd launch
            ax.axvline(gate_up["m_tiles"] * gate_up["n_groups"], color="black", lw=1.2)
        ax.title.set_fontsize(9)
    return fig


# ================================================================ kernel designs measured on the GPU

TUNING_DIR = RESULTS_DIR / "H200" / "tuning"  # the tuning scripts' committed outputs (scripts/p1_tune.py, p2_tune.py)
P2_KERNEL_COLUMNS = ("A", "G", "Wgu", "Wd", "D", "C", "other")  # scripts/p2_tune.py's per-kernel columns


def _read_json(path) -> list[dict]:
    return json.loads(resolve_path(path).read_text())


def p1_design_times(path=TUNING_DIR / "2026-11-29-p1-tune-onelaunch.json") -> pd.DataFrame:
    """A ``scripts/p1_tune.py`` run as the best time (µs) per token count of each P1 design and the config
    that gave it: "one launch" (the ``one_*`` candidates) and "two launches" (the TileConfig ones). Only
    named candidates count: what "default" stood for depended on the code of the day."""
    rows = pd.DataFrame([r for r in _read_json(path) if "error" not in r and r["config"] != "default"])
    rows = rows[rows["ok"]]
    rows["design"] = np.where(rows["config"].str.startswith("one_"), "one launch", "two launches")
    best = rows.loc[rows.groupby(["T", "design"])["median_us"].idxmin()]
    table = best.pivot(index="T", columns="design", values=["median_us", "config"])
    table.columns = [f"{design} µs" if what == "median_us" else f"{design}: config" for what, design in table.columns]
    table.index.name = "num_tokens"
    return table[sorted(table.columns, key=lambda c: ("config" in c, c))]


def p2_kernel_times(path, labels: dict | None = None) -> pd.DataFrame:
    """A ``scripts/p2_tune.py`` run as one row per (case, config): each kernel's median ms (0 where it
    did not run), the whole call from a CUDA graph, and the worst element-rule pass fraction, in the
    run's order. With ``labels`` (config name -> label) only those configs, named by their labels."""
    rows = []
    for r in _read_json(path):
        if "error" in r or (labels is not None and r["config"] not in labels):
            continue
        row = {"case": r["case"], "config": labels[r["config"]] if labels else r["config"]}
        row.update({k: r["kernels"].get(k, 0.0) for k in P2_KERNEL_COLUMNS})
        row.update(graph_ms=r["graph_ms"], element_rule=r["element_rule"])
        rows.append(row)
    return pd.DataFrame(rows).set_index(["case", "config"])


def kernel_times_figure(table: pd.DataFrame, title: str):
    """Stacked horizontal bars of :func:`p2_kernel_times`: where each (case, config)'s time goes."""
    kernels = [k for k in P2_KERNEL_COLUMNS if table[k].any()]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(table) + 1.2))
    labels = [f"{case}  {config}" for case, config in table.index]
    left = np.zeros(len(table))
    for i, kernel in enumerate(kernels):
        ax.barh(labels, table[kernel], left=left, color=plt.cm.tab10(i), label=kernel)
        left += table[kernel].to_numpy()
    ax.scatter(table["graph_ms"], labels, marker="|", s=200, color="black", label="whole call (graph)", zorder=3)
    ax.invert_yaxis()
    ax.set(xlabel="ms (median per kernel)", title=title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig
