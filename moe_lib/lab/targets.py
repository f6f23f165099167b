"""Notebook 05: the project's targets beside our numbers.

Each problem lists its targets as data, the ``"targets"`` entry of ``data/problems/<name>/lab.json``:
a ``name`` (what the table shows), a ``kind`` (one of :data:`KINDS`) with its thresholds, an optional
``impl`` (the implementation judged, ours by default) and an optional ``note``. :func:`targets_table`
judges every target against the result file of its problem and adds, per result file, that ours is
correct on every case (and passes the element rule where the problem has one).

Most kinds read the problem's benchmark result file; four read the other committed runs of the same GPU folder:
``official_geomean_us`` NVIDIA's harness (:mod:`.official_runs`), ``layer_faster_than`` and ``layer_tflops`` the
layer's training step (:mod:`.training_step`), ``models_speedup`` the model suite (:mod:`.models`).

A target is met (True), not met (False), or not settled (None) where the files do not settle it: a
case not measured, or a suite only partly measured for a target about the whole suite. The targets are stated
here and nowhere else: notebook 05 and ``docs/methodology.md`` point to this table.
"""

from __future__ import annotations

import math

import pandas as pd

from .. import problems, roofline
from ..bench.results import geomean
from .results import OURS, ResultFile, find, format_ms, ok_rows, times_table

NOT_MEASURED = (math.nan, "not measured", None)  # value, text, met of a target the files cannot judge


def problem_targets(name: str) -> list[dict]:
    """The targets of problem ``name``: the ``"targets"`` list of its ``lab.json`` (empty when it has none)."""
    targets = list(problems.load(name).targets)
    for target in targets:
        if target.get("kind") not in KINDS:
            raise ValueError(
                f"{problems.PROBLEMS_DIR / name / 'lab.json'}: target {target.get('name')!r} has kind "
                f"{target.get('kind')!r}, expected one of {sorted(KINDS)}"
            )
    return targets


def precision_floor_ms(result: ResultFile, num_tokens: int, precision_flops_coefficient: int) -> float:
    """The floor of ``result``'s problem at ``num_tokens`` with the run's measured ceilings when its
    precision costs extra tensor work: max(bytes / copy bandwidth, FLOPs / bf16 rate), the FLOPs being
    ``precision_flops_coefficient`` × the product of the problem's FLOP axes (its own count has its
    ``flops_coefficient`` there)."""
    spec = result.measured_spec
    problem = result.definition
    sizes = problem.sizes(num_tokens, **result.axes)
    precision_flops = precision_flops_coefficient * math.prod(sizes[axis] for axis in problem.flops_axes)
    traffic = roofline.minimal_bytes(result.problem, num_tokens, **result.axes)
    return max(traffic / spec.dram_bandwidth, precision_flops / spec.bf16_dense_flops) * 1e3


def _coverage(result: ResultFile) -> tuple[str, bool]:
    """How much of the suite ``result`` measured, in words, and whether that is all of it at full size."""
    n_suite = len(result.definition.suite)
    text = f"over {len(result.tokens)} of the {n_suite} suite cases" + (" (small shapes)" if result.small else "")
    return text, len(result.tokens) == n_suite and not result.small


def _ours_by_tokens(result: ResultFile, impl: str) -> pd.DataFrame:
    rows = ok_rows(result)
    return rows[rows["impl"] == impl].set_index("num_tokens")


def _geomean_us(target: dict, result: ResultFile, impl: str) -> tuple:
    """The geomean over the suite at most ``at_most`` µs (settled only by the whole suite)."""
    ours = times_table(result).get(impl)
    cover, complete = _coverage(result)
    geo = geomean(ours.dropna()) if ours is not None else math.nan
    settled = complete and not math.isnan(geo)  # a geomean over part of the suite settles nothing
    return geo * 1e3, f"{format_ms(geo)} {cover}", bool(geo * 1e3 <= target["at_most"]) if settled else None


def _speedup_over(target: dict, result: ResultFile, impl: str) -> tuple:
    """The ratio of geomeans, ``peer``'s over ours, at least ``at_least`` (settled only by the whole suite)."""
    times = times_table(result)
    ours, peer = times.get(impl), times.get(target["peer"])
    if ours is None or peer is None:
        return math.nan, f"{impl if ours is None else target['peer']} not measured", None
    cover, complete = _coverage(result)
    geo = geomean(ours.dropna())
    ratio = geomean(peer.dropna()) / geo
    settled = complete and not math.isnan(geo)
    return ratio, f"{ratio:.2f}× {cover}", bool(ratio >= target["at_least"]) if settled else None


def _no_case_slower_than(target: dict, result: ResultFile, impl: str) -> tuple:
    """No case where ours is slower than ``peer`` (met only when the whole suite is measured)."""
    times = times_table(result)
    ours, peer = times.get(impl), times.get(target["peer"])
    if ours is None or peer is None:
        return math.nan, f"{impl if ours is None else target['peer']} not measured", None
    slower = [int(t) for t in times.index if ours[t] > peer[t]]
    text = f"{len(slower)} slower" + (f": T = {', '.join(map(str, slower))}" if slower else "")
    return len(slower), text, False if slower else (True if _coverage(result)[1] else None)


def _floor_ratio(target: dict, result: ResultFile, impl: str) -> tuple:
    """Every case at most ``at_most`` × its :func:`precision_floor_ms`; the value is the worst ratio."""
    if result.measured_spec is None:
        return NOT_MEASURED
    ours = _ours_by_tokens(result, impl)["median_ms"]
    coefficient = target["precision_flops_coefficient"]
    ratios = {t: ours[t] / precision_floor_ms(result, t, coefficient) for t in result.tokens if t in ours.index}
    if not ratios:
        return NOT_MEASURED
    n_suite = len(result.definition.suite)
    all_there = len(ratios) == n_suite and not result.small
    met = False if any(r > target["at_most"] for r in ratios.values()) else (True if all_there else None)
    text = (
        "; ".join(f"T={t}: {format_ms(ours[t])} = {r:.2f}× floor" for t, r in ratios.items())
        + f" ({len(ratios)} of {n_suite} suite cases measured)"
    )
    return max(ratios.values()), text, met


def _case_ms(target: dict, result: ResultFile, impl: str) -> tuple:
    """The case ``num_tokens`` in at most ``at_most`` ms."""
    ours = _ours_by_tokens(result, impl)
    if target["num_tokens"] not in ours.index:
        return NOT_MEASURED
    ms = ours.loc[target["num_tokens"], "median_ms"]
    return ms, format_ms(ms), bool(ms <= target["at_most"])


def _cases_up_to_us(target: dict, result: ResultFile, impl: str) -> tuple:
    """Every measured case with at most ``max_tokens`` tokens in at most ``at_most`` µs; the value is the worst."""
    ours = _ours_by_tokens(result, impl)
    cases = ours[ours.index <= target["max_tokens"]]["median_ms"] * 1e3
    wanted = [t for t in result.definition.suite if t <= target["max_tokens"]]
    if cases.empty:
        return NOT_MEASURED
    worst = float(cases.max())
    all_there = set(wanted) <= set(cases.index) and not result.small
    met = False if worst > target["at_most"] else (True if all_there else None)
    return worst, f"worst {worst:.1f} µs over T = {', '.join(map(str, sorted(cases.index)))}", met


def _case_tflops(target: dict, result: ResultFile, impl: str) -> tuple:
    """The case ``num_tokens`` at least ``at_least`` TFLOP/s, counting the problem's own FLOPs."""
    ours = _ours_by_tokens(result, impl)
    if target["num_tokens"] not in ours.index:
        return NOT_MEASURED
    case = ours.loc[target["num_tokens"]]
    rate = case["flops"] / (case["median_ms"] * 1e-3) / 1e12
    return rate, f"{rate:.0f} TFLOP/s", bool(rate >= target["at_least"])


def _folder(result: ResultFile) -> tuple:
    """(results_dir, gpu_key) of the folder ``result`` was read from: where the other runs of its GPU lie."""
    return result.csv.parent.parent, result.csv.parent.name


def _official_geomean_us(target: dict, result: ResultFile, impl: str) -> tuple:
    """In NVIDIA's harness: every workload passes, and the geomean latency is at most ``at_most`` µs."""
    from .official_runs import PASSED, load_official_runs

    run = load_official_runs(result.problem, *_folder(result)).get(impl)
    if run is None:
        return math.nan, "no run of NVIDIA's harness committed", None
    workloads = run.workloads
    passed = workloads[workloads["status"] == PASSED]
    geo = geomean(passed["latency_ms"]) * 1e3 if len(passed) else math.nan
    text = f"{len(passed)}/{len(workloads)} pass, geomean {geo:.1f} µs ({run.path.name})"
    return geo, text, bool(len(passed) == len(workloads) and geo <= target["at_most"])


def _layer_times(result: ResultFile, impl: str, peer: str | None = None) -> pd.DataFrame:
    """The newest training-step run (forward + backward) of ``result``'s problem: median ms per token count (rows)
    for ``impl`` and ``peer`` (columns; NaN where not timed)."""
    from .training_step import load_layer_runs

    layer = load_layer_runs(*_folder(result), problem=result.problem)
    layer = layer[layer["mode"] == "forward_backward"]
    impls = [impl] + ([peer] if peer else [])
    table = layer[layer["impl"].isin(impls)].pivot_table(index="num_tokens", columns="impl", values="median_ms")
    return table.reindex(columns=impls)


def _layer_faster_than(target: dict, result: ResultFile, impl: str) -> tuple:
    """The layer's training step faster than ``peer``'s at every case of ``cases``; the value is the worst ratio of
    ours over the peer's."""
    times = _layer_times(result, impl, target["peer"])
    cases = [t for t in target["cases"] if t in times.index and times.loc[t].notna().all()]
    if not cases:
        return math.nan, f"{impl} and {target['peer']} not both timed", None
    ratios = {t: times.loc[t, impl] / times.loc[t, target["peer"]] for t in cases}
    text = "; ".join(
        f"T={t}: {format_ms(times.loc[t, impl])} against {format_ms(times.loc[t, target['peer']])}" for t in cases
    )
    slower = any(r >= 1 for r in ratios.values())
    return max(ratios.values()), text, False if slower else (True if len(cases) == len(target["cases"]) else None)


def _layer_tflops(target: dict, result: ResultFile, impl: str) -> tuple:
    """The layer's training step at ``num_tokens`` at least ``at_least`` TFLOP/s, counting the problem's
    ``layer_flops`` (a layer's usual count: its forward's GEMMs and the backward's, no recomputation)."""
    times = _layer_times(result, impl)
    t = target["num_tokens"]
    if t not in times.index or math.isnan(times.loc[t, impl]):
        return NOT_MEASURED
    definition = result.definition
    sizes = definition.sizes(t, **result.axes)
    flops = definition.layer_flops["forward_backward"] * math.prod(sizes[axis] for axis in definition.flops_axes)
    rate = flops / (times.loc[t, impl] * 1e-3) / 1e12
    return rate, f"{rate:.0f} TFLOP/s ({format_ms(times.loc[t, impl])})", bool(rate >= target["at_least"])


def _models_speedup(target: dict, result: ResultFile, impl: str) -> tuple:
    """At every model shape of the model suite: the geomean of our speed-up over ``peer`` at least ``at_least``, and
    no case below ``min_at_least`` where one is given; the value is the worst geomean."""
    from .models import geomean_table, load_model_runs, problems_in, speedup_table

    runs = load_model_runs(*_folder(result))
    if result.problem not in problems_in(runs):
        return math.nan, "no model-suite run committed", None
    per_model = geomean_table(speedup_table(runs, result.problem))
    geo, low = per_model[f"geomean vs {target['peer']}"], per_model[f"min vs {target['peer']}"]
    met = bool((geo >= target["at_least"]).all() and (low >= target.get("min_at_least", -math.inf)).all())
    text = f"geomean {geo.min():.2f}–{geo.max():.2f}× per shape, lowest case {low.min():.2f}× ({len(per_model)} shapes)"
    return float(geo.min()), text, met


KINDS = {  # kind -> (target, result file, impl) -> (value, text, met)
    "geomean_us": _geomean_us,
    "speedup_over": _speedup_over,
    "no_case_slower_than": _no_case_slower_than,
    "floor_ratio": _floor_ratio,
    "case_ms": _case_ms,
    "cases_up_to_us": _cases_up_to_us,
    "case_tflops": _case_tflops,
    "official_geomean_us": _official_geomean_us,
    "layer_faster_than": _layer_faster_than,
    "layer_tflops": _layer_tflops,
    "models_speedup": _models_speedup,
}


def _row(problem: str, target: str, value, text: str, met, note: str = "") -> dict:
    return dict(problem=problem, target=target, ours=text, value=value, met=met, note=note)


def _structure_note(name: str, target: dict, result: ResultFile | None) -> str:
    """For a target on one case of P2: the floor of today's decomposition into kernels at the run's ceilings
    (:func:`.ledger.decomposition_floor_ms`, notebook 04), and whether the target lies below it."""
    from .ledger import case_target_ms, decomposition_floor_ms

    if result is None or result.measured_spec is None or target["kind"] not in ("case_ms", "case_tflops"):
        return ""
    floor = decomposition_floor_ms(name, target["num_tokens"], result.measured_spec)
    if floor is None:
        return ""
    note = f"today's decomposition: ≥ {floor:.2f} ms at the run's ceilings"
    if floor > case_target_ms(name, target["num_tokens"]):
        note += ", above the target: only a change of structure can meet it"
    return note


def targets_table(results: dict[str, ResultFile], impl: str = OURS) -> pd.DataFrame:
    """Every problem's targets (:func:`problem_targets`) beside ``impl``'s numbers (or those of the
    implementation a target names, e.g. P1's fast path ``triton_fast``), then per result file whether
    ``impl`` is correct on every case (and passes the element rule where the problem has one).

    Columns: problem (its short name), target, ours (in words), value, met (True, False or None where
    the files do not settle it) and note.
    """
    rows = []
    for name in problems.PROBLEM_NAMES:
        result = find(results, name)
        for target in problem_targets(name):
            judged = target.get("impl", impl)
            value, text, met = NOT_MEASURED if result is None else KINDS[target["kind"]](target, result, judged)
            label = target["name"] if judged == impl else f"{target['name']} ({judged})"
            notes = [target.get("note", ""), _structure_note(name, target, result)]
            rows.append(_row(problems.load(name).short, label, value, text, met, "; ".join(filter(None, notes))))
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
        rows.append(
            _row(
                result.definition.short,
                what,
                len(bad) + len(rule_failures),
                text,
                bool(bad.empty and rule_failures.empty),
            )
        )
    table = pd.DataFrame(rows)
    table["met"] = pd.Series([row["met"] for row in rows], dtype=object)  # True, False or None, as Python objects
    return table


def styled_targets(targets: pd.DataFrame):
    """:func:`targets_table` styled: met in green, not met in red, not settled in grey."""
    shown = targets.drop(columns=["value"]).copy()
    shown["met"] = shown["met"].map(lambda v: "met" if v is True else "NOT MET" if v is False else "not settled")
    colours = {
        "met": "color: #1a7f37; font-weight: bold",
        "NOT MET": "color: #cf222e; font-weight: bold",
        "not settled": "color: #57606a",
    }
    return (
        shown.style.map(lambda v: colours.get(v, ""), subset=["met"])
        .hide(axis="index")
        .set_properties(**{"text-align": "left"})
        .set_caption("The project's targets (data/problems/<name>/lab.json) beside our numbers")
    )
