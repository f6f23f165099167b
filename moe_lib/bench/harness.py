"""The benchmark's run loop: every case, every implementation, checked then timed (:func:`run`).

For every case (a token count) it draws seeded inputs on the device with :mod:`moe_lib.problems`,
computes the reference outputs once (:func:`~.checks.reference_outputs`), then for every
implementation (:mod:`.peers`) runs :func:`run_case_impl`:

1. check: the caching allocator is poisoned with NaN, the implementation runs once, and each output
   is compared with the reference (:func:`~.checks.check_outputs`). A wrong implementation is not
   timed; one that fails only the element rule is flagged in ``passes_element_rule`` and still timed.
2. time (:func:`time_callable`): captured in a CUDA graph and replayed (``timing="graph"``) when the
   peer declares itself capturable (a failed capture is an error, never a silent fallback; the
   replayed outputs are checked again afterwards), else CUDA events around each call after a
   synchronize (``"events"``); L2 flushed before each run; median and p20/p80 of ``--reps`` runs after
   ``--warmup`` (cases over 10 ms: as many runs as fit in ~2 s, at least 5). Without CUDA: wall clock
   (``"cpu"``), the problem's scaled-down shapes and three-case suite (``small=True``).

A case whose memory estimate (:func:`case_bytes`) exceeds the device's free memory is not drawn: each of its
rows says ``skipped: needs N GB, M GB free``. :func:`run_shape` runs every case of one shape (the problem's,
or overridden axes: the model suite of :mod:`.models` calls it once per model) into a list of rows.

Ceilings (copy bandwidth, bf16 GEMM rate) are measured in the same run (:mod:`moe_lib.roofline`);
the files written are described in :mod:`.results`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import math
import sys
import time
import traceback

import torch
from tqdm import tqdm

from .. import problems, roofline
from . import modes, official_timing, peers, results, timing
from .checks import check_outputs, reference_outputs
from .provenance import gpu_key

# ---------------------------------------------------------------------------------------------
# memory and messages


def free_memory(device: torch.device) -> None:
    """Collects garbage and, on CUDA, waits for the device and returns cached blocks to it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_start(device: torch.device) -> int:
    """Resets the device's peak-memory counter; returns the bytes allocated now (0 on CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_gb(device: torch.device, before: int) -> float:
    """The peak of allocated memory since :func:`peak_memory_start` beyond ``before``, in GB (NaN on CPU)."""
    if device.type != "cuda":
        return math.nan
    return (torch.cuda.max_memory_allocated(device) - before) / 1e9


def free_device_bytes(device: torch.device) -> int | None:
    """The device memory free now, in bytes (``torch.cuda.mem_get_info``); None on CPU, where it is not checked."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


WORKSPACE_BYTES_PER_ROW_VALUE = 16  # bf16 and fp32 activations and their gradients, a few of each


def tensors_bytes(specs: dict, sizes: dict, dtype: torch.dtype) -> int:
    """Bytes of the tensors ``specs`` (a definition's inputs or outputs: name -> shape and dtype) at ``sizes``,
    their floating ones in ``dtype``."""
    total = 0
    for spec in specs.values():
        declared = problems.DTYPES[spec["dtype"]]
        itemsize = (dtype if declared.is_floating_point else declared).itemsize
        total += itemsize * math.prod(sizes[axis] for axis in spec["shape"])
    return total


def case_bytes(problem: problems.Problem, num_tokens: int, dtype: torch.dtype, axes: dict, small: bool) -> int:
    """An estimate of the device memory one case needs at its peak, the larger of its two phases:

    - the reference: the inputs, their copy at the reference's precision (none where it is the inputs'), the
      reference's outputs at that precision and a workspace;
    - an implementation: the inputs, the reference's outputs (kept for the check), the implementation's
      outputs twice over (its outputs, and as much again for temporaries such as weights cast to bf16) and
      a workspace.

    The workspace is what a PyTorch implementation keeps per routed row (a token for P1, a (token, slot)
    pair for P2): :data:`WORKSPACE_BYTES_PER_ROW_VALUE` bytes per value of its hidden and intermediate rows."""
    sizes = problem.sizes(num_tokens, **axes)
    precision = problem.reference_dtype(small)
    inputs = tensors_bytes(problem.inputs, sizes, dtype)
    upcast = 0 if precision == dtype else tensors_bytes(problem.inputs, sizes, precision)
    reference_outputs = tensors_bytes(problem.outputs, sizes, precision)
    outputs = tensors_bytes(problem.outputs, sizes, dtype)
    rows = num_tokens * sizes.get("top_k", 1)
    workspace = rows * (sizes["hidden_size"] + sizes["intermediate_size"]) * WORKSPACE_BYTES_PER_ROW_VALUE
    return inputs + max(upcast + reference_outputs, reference_outputs + 2 * outputs) + workspace


def memory_shortfall(
    problem: problems.Problem, num_tokens: int, dtype: torch.dtype, axes: dict, small: bool, device: torch.device
) -> str | None:
    """ "skipped: needs N GB, M GB free" when the case's estimate (:func:`case_bytes`) exceeds the memory free on
    ``device`` (:func:`free_device_bytes`), else None (always None on CPU)."""
    free = free_device_bytes(device)
    if free is None:
        return None
    needed = case_bytes(problem, num_tokens, dtype, axes, small)
    return f"skipped: needs {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free" if needed > free else None


def short_message(exc: BaseException) -> str:
    """``<ExceptionType>: <first line>``, at most 300 characters (for a row's status)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text[:300]


# ---------------------------------------------------------------------------------------------
# one implementation on one case


def time_callable(
    fn, capturable: bool, device: torch.device, flush: timing.L2Flusher, *, warmup: int, reps: int, check_replay=None
) -> dict:
    """Times ``fn``: graph replays when ``capturable`` on CUDA, events otherwise, wall clock on CPU.

    ``check_replay(outputs)`` returns a reason (str) when the outputs of the replayed graph are wrong.
    Returns :func:`timing.summarize`'s dict plus ``timing`` (the mode) and ``replay_wrong``.
    """
    if device.type != "cuda":
        return dict(timing.measure(fn, "cpu", flush, warmup=warmup, reps=reps), timing="cpu", replay_wrong=None)
    if not capturable:
        return dict(timing.measure(fn, "events", flush, warmup=warmup, reps=reps), timing="events", replay_wrong=None)
    return dict(timing.time_graph(fn, flush, warmup=warmup, reps=reps, check_replay=check_replay), timing="graph")


def time_official(
    peer: peers.Peer, inputs: dict, device: torch.device, estimate_ms: float, *, warmup: int, reps: int, log=print
) -> dict:
    """The row's official-method fields (:mod:`.official_timing`): median and p20/p80 of eager calls on
    fresh input addresses, CUPTI span; ``official_status`` "ok" or why there is no time."""
    fields = dict(official_ms=math.nan, official_p20_ms=math.nan, official_p80_ms=math.nan)
    if peer.run is not None:  # the whole call, its setup included, as the harness times it

        def make_call(fresh):
            return functools.partial(peer.call, *peers.positional(peer.op, fresh))
    else:
        make_call = peer.prepare
    try:
        measured = official_timing.time_official(
            make_call, inputs, device, warmup=min(warmup, 5), reps=timing.repetitions(estimate_ms, reps)
        )
    except Exception as exc:
        log(f"[{peer.label}] error while timing the official way:\n{traceback.format_exc()}")
        return dict(fields, official_status=f"error: {short_message(exc)}")
    stats = timing.summarize(measured["samples_ms"])
    return dict(
        official_ms=stats["median_ms"],
        official_p20_ms=stats["p20_ms"],
        official_p80_ms=stats["p80_ms"],
        official_status="ok",
    )


def run_case_impl(
    peer: peers.Peer | None,
    label: str,
    inputs: dict,
    references: tuple,
    names: list[str],
    rule,
    device: torch.device,
    flush: timing.L2Flusher,
    *,
    warmup: int,
    reps: int,
    poison_bytes: int,
    official: bool = False,
    log=print,
) -> dict:
    """Checks, then times one implementation on one case (with ``official``, also the harness's way);
    returns the row's measured fields."""
    row = dict(
        impl=label,
        status="ok",
        timing=None,
        median_ms=math.nan,
        p20_ms=math.nan,
        p80_ms=math.nan,
        reps=0,
        peak_mem_gb=math.nan,
        correct=False,
        passes_element_rule=None,
        rel_error=math.nan,
        element_pass_fraction=math.nan,
        rel_errors={},
        pass_fractions={},
        official_status="not measured",
    )
    reason = peer.unavailable(device) if peer is not None else "not registered"
    if reason is not None:
        row["status"] = f"unavailable: {reason}"
        return row
    fn = None
    try:
        fn = peer.prepare(inputs)
        synchronize(device)
        timing.poison_allocator(device, poison_bytes)
        before = peak_memory_start(device)
        outputs = fn()
        synchronize(device)
        row["peak_mem_gb"] = peak_memory_gb(device, before)
        check = check_outputs(outputs, references, names, rule)
        del outputs
    except Exception as exc:
        log(f"[{label}] error while running:\n{traceback.format_exc()}")
        row["status"] = f"error: {short_message(exc)}"
        del fn
        free_memory(device)
        return row
    row.update(
        correct=check["correct"],
        passes_element_rule=check["passes_element_rule"],
        rel_error=check["rel_error"],
        element_pass_fraction=check["element_pass_fraction"],
        rel_errors=check["rel_errors"],
        pass_fractions=check["pass_fractions"],
    )
    if not check["correct"]:
        row["status"] = f"wrong: {check['why']}"
        del fn
        free_memory(device)
        return row

    def check_replay(replayed):
        result = check_outputs(replayed, references, names, rule)
        return None if result["correct"] else result["why"]

    try:
        free_memory(device)
        stats = time_callable(fn, peer.capturable, device, flush, warmup=warmup, reps=reps, check_replay=check_replay)
    except Exception as exc:
        log(f"[{label}] error while timing:\n{traceback.format_exc()}")
        row["status"] = f"error: {short_message(exc)}"
    else:
        row["timing"] = stats["timing"]
        if stats["replay_wrong"] is not None:
            row.update(status=f"wrong: CUDA graph replay: {stats['replay_wrong']}", correct=False)
        else:
            row.update(median_ms=stats["median_ms"], p20_ms=stats["p20_ms"], p80_ms=stats["p80_ms"], reps=stats["reps"])
            if official:
                free_memory(device)
                row.update(time_official(peer, inputs, device, stats["median_ms"], warmup=warmup, reps=reps, log=log))
    finally:
        del fn
        free_memory(device)
    return row


# ---------------------------------------------------------------------------------------------
# a run


def cases(problem: problems.Problem, args: argparse.Namespace) -> tuple[list[int], dict]:
    """The token counts to run and the suite's description for the provenance: ``--tokens``, else the
    problem's small suite with ``--small`` (unless ``--suite``), else its workload suite."""
    if args.tokens is not None:
        tokens, suite = args.tokens, dict(source="--tokens", provenance="custom")
    elif args.small and not args.suite:
        tokens, suite = list(problem.small_suite), dict(source="small suite", provenance="custom")
    else:
        tokens, suite = problem.suite, dict(source="workloads", provenance=problem.suite_provenance)
    suite["tokens"] = list(tokens)
    return tokens, suite


def roofline_columns(problem: str, num_tokens: int, dtype: torch.dtype, measured: roofline.GPUSpec, axes: dict) -> dict:
    """A case's FLOPs, bytes and T_sol in ms: on the measured ceilings (``sol_ms``) and on each datasheet."""
    work, traffic = roofline.cost(problem, num_tokens, dtype, **axes)
    columns = dict(flops=work, bytes=traffic)
    for column, gpu in (("sol_ms", measured), *results.DATASHEET_COLUMNS.items()):
        columns[column] = roofline.sol_time(problem, num_tokens, gpu, dtype, **axes) * 1e3
    return columns


def mode_roofline_columns(
    problem: problems.Problem, mode: str, inputs: dict, references: tuple, measured: roofline.GPUSpec, axes: dict
) -> dict:
    """A training step's FLOPs, bytes and T_sol in ms (:func:`.modes.cost`), as :func:`roofline_columns` gives."""
    work, traffic = modes.cost(problem, mode, inputs, references, **axes)
    columns = dict(flops=work, bytes=traffic)
    for column, gpu in (("sol_ms", measured), *results.DATASHEET_COLUMNS.items()):
        spec = roofline.gpu_spec(gpu)
        columns[column] = max(work / spec.bf16_dense_flops, traffic / spec.dram_bandwidth) * 1e3
    return columns


def case_references(problem: problems.Problem, mode: str, inputs: dict, small: bool) -> tuple[tuple, str]:
    """The reference outputs of a case in ``mode`` and their precision's name (float64 where it fits)."""
    if mode == "op":
        return reference_outputs(problem, inputs, small)
    precision = problem.reference_dtype(small)
    return modes.reference_outputs(problem, inputs, mode, precision), problems.dtype_name(precision)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every case of a run shares: its device, the ceilings measured on it (the dict the provenance records,
    and as a GPU spec for T_sol) and the L2 flusher."""

    device: torch.device
    ceilings: dict
    measured: roofline.GPUSpec
    flush: timing.L2Flusher


def setup(device: torch.device, log) -> Setup:
    """Selects ``device`` (CUDA) and measures its ceilings (copy bandwidth, bf16 GEMM rate) once for a run.

    The objects alive by then (modules and what the imported libraries built), garbage collected first, are
    moved out of the collector's reach (``gc.freeze``): :func:`free_memory` collects around every
    implementation of every case, and scanning all of them each time would cost more than most cases."""
    gc.collect()
    gc.freeze()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log(f"measuring ceilings on {device} ...")
    ceilings = roofline.measure_ceilings(device, reps=10 if device.type == "cuda" else 3)
    measured = roofline.GPUSpec.from_measured(
        ceilings["copy_bandwidth"], ceilings["bf16_matmul_flops"], name=f"measured on {device}"
    )
    return Setup(device, ceilings, measured, timing.L2Flusher(device))


def run_shape(
    problem: problems.Problem,
    args: argparse.Namespace,
    bench: Setup,
    *,
    dtype: torch.dtype,
    tokens,
    axes: dict,
    registry: dict,
    rows: list,
    progress,
    log,
    columns: dict | None = None,
    save=None,
) -> str | None:
    """Runs every case (each token count of ``tokens``) of ``problem`` at ``axes`` (overrides of its constant
    axes: hidden_size, ..., as :meth:`~moe_lib.problems.Problem.make_inputs` takes them) with every
    implementation of ``args.impls`` (labels of ``registry``), appending a row per case and implementation to
    ``rows``.

    ``columns`` are added to every row (the model suite's ``model`` and shape axes); ``save(rows)`` runs after
    every row, so that a run cut short keeps what it measured; ``progress`` is a tqdm bar advanced once per
    row; ``log(message)`` reports what failed. A case whose memory estimate (:func:`case_bytes`) exceeds the
    device's free memory is not drawn: its rows say ``skipped: needs N GB, M GB free``. Returns the
    reference's precision (None when no case computed one).
    """
    device, mode = bench.device, getattr(args, "mode", "op")
    dtype_label = problems.dtype_name(dtype)
    names = modes.output_names(problem, mode)
    rule = problem.element_rule_at(dtype) if mode == "op" else None  # the element rule is the function's
    reference_dtype = None

    def add(row):
        rows.append(row)
        if save is not None:
            save(rows)
        progress.update(1)

    for num_tokens in tokens:
        case = dict(
            problem=problem.name,
            mode=mode,
            **(columns or {}),
            num_tokens=num_tokens,
            dtype=dtype_label,
            small=args.small,
            device=str(device),
            gpu=gpu_key(device),
        )
        shortfall = memory_shortfall(problem, num_tokens, dtype, axes, args.small, device)
        if shortfall is not None:
            log(f"[case {num_tokens}] {shortfall}")
            for label in args.impls:
                add(dict(case, impl=label, status=shortfall, correct=False))
            continue
        inputs = references = None
        try:
            inputs = problem.make_inputs(num_tokens, seed=args.seed, device=device, dtype=dtype, **axes)
            references, reference_dtype = case_references(problem, mode, inputs, args.small)
            if mode == "op":
                case.update(roofline_columns(problem.name, num_tokens, dtype, bench.measured, axes))
            else:
                case.update(mode_roofline_columns(problem, mode, inputs, references, bench.measured, axes))
            poison_bytes = 2 * sum(r.numel() for r in references) * 4 + 256 * 2**20
            free_memory(device)
        except Exception as exc:
            log(f"[case {num_tokens}] reference failed:\n{traceback.format_exc()}")
            for label in args.impls:
                add(dict(case, impl=label, status=f"error: reference failed: {short_message(exc)}", correct=False))
            del inputs, references
            free_memory(device)
            continue
        for label in args.impls:
            progress.set_postfix_str(f"T={num_tokens} {label}")
            wall_start = time.perf_counter()
            measured_row = run_case_impl(
                registry.get(label),
                label,
                inputs,
                references,
                names,
                rule,
                device,
                bench.flush,
                warmup=args.warmup,
                reps=args.reps,
                poison_bytes=poison_bytes,
                official=getattr(args, "official", False),
                log=log,
            )
            rel_errors = measured_row.pop("rel_errors")
            pass_fractions = measured_row.pop("pass_fractions")
            row = dict(case, **measured_row, wall_s=time.perf_counter() - wall_start)
            row.update({f"rel_error_{name}": rel_errors.get(name, math.nan) for name in names})
            row.update({f"element_pass_fraction_{name}": pass_fractions.get(name) for name in names})
            row["roofline_fraction"] = row["sol_ms"] / row["median_ms"] if row["status"] == "ok" else math.nan
            add(row)
        del inputs, references
        free_memory(device)
    return reference_dtype


def run(args: argparse.Namespace, log=None) -> dict:
    """Runs the benchmark the parsed ``args`` describe (:func:`moe_lib.bench.cli.parse_args`); writes the CSV
    and JSON; returns dict(csv=path, json=path, frame=DataFrame, summary=dict, baseline=dict, table=str)."""
    log = log or (lambda message: tqdm.write(message, file=sys.stderr))
    started = datetime.datetime.now(datetime.timezone.utc)
    device = args.device
    problem = problems.load(args.problem)
    dtype = problem.dtype if args.dtype is None else problems.DTYPES[args.dtype]
    dtype_label = problems.dtype_name(dtype)
    axes = dict(problem.small_axes) if args.small else {}
    tokens, suite = cases(problem, args)
    mode = getattr(args, "mode", "op")
    names = modes.output_names(problem, mode)
    rule = problem.element_rule_at(dtype) if mode == "op" else None
    registry = modes.mode_peers(args.problem, mode)

    bench = setup(device, log)
    stem = results.result_stem(
        args.problem, dtype_label, small=args.small, tag=args.tag, date=started.strftime("%Y-%m-%d"), mode=mode
    )
    csv_path, json_path = results.result_paths(args.out, device, stem)
    json_path.unlink(missing_ok=True)  # an earlier run's, which this run's rows replace
    rows = []
    progress = tqdm(total=len(tokens) * len(args.impls), desc=args.problem, unit="run", file=sys.stderr)
    reference_dtype = run_shape(
        problem,
        args,
        bench,
        dtype=dtype,
        tokens=tokens,
        axes=axes,
        registry=registry,
        rows=rows,
        progress=progress,
        log=log,
        save=lambda so_far: results.write_csv(csv_path, results.results_frame(so_far, names)),
    )
    progress.close()

    frame = results.results_frame(rows, names)
    baselines = [label for label, peer in registry.items() if peer.baseline]
    summary, baseline = results.summarize_impls(frame, args.impls, baselines)
    sizes = {name: value for name, value in problem.sizes(0, **axes).items() if name != "num_tokens"}
    document = dict(
        problem=args.problem,
        mode=mode,
        dtype=dtype_label,
        axes=sizes,
        impls=args.impls,
        element_rule=rule,
        provenance=results.run_provenance(args, device, bench.ceilings, suite, reference_dtype, started),
        baseline=baseline,
        summary=summary,
    )
    results.write_run(csv_path, frame, json_path, document)
    clock = "wall clock" if device.type != "cuda" else "cold L2; graph replays or events: see timing"
    shapes = " · small shapes" if args.small else ""
    what = "" if mode == "op" else f" · layer {mode}"
    title = f"{args.problem}{what} · {dtype_label} · {gpu_key(device)}{shapes} · median per case ({clock})"
    table = results.format_tables(frame, summary, baseline, title)
    return dict(csv=csv_path, json=json_path, frame=frame, summary=summary, baseline=baseline, table=table)
