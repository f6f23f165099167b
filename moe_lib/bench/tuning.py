"""What the tuning, profiling and checking scripts under ``scripts/`` share (``scripts/README.md`` lists them).

- :data:`P1_CANDIDATES`: named configured designs of P1 (from its design registry) that ``scripts/p1/p1_tune.py``
  times, ``p1_compile_check.py`` compiles and ``p1_profile.py --config`` profiles; a ``--configs`` list of them
  (:func:`p1_candidate_names`) and the call each names, "default" the chooser's own (:func:`p1_call`).
- ``FIELD=VALUE`` overrides of a launch config (:func:`parse_field`, :func:`replace_fields`).
- Cases written ``dtype:num_tokens`` (``fp32:2048``, ``bf16:8192``): the problem of an op whose inputs
  have that dtype (:func:`parse_case`).
- A script's JSON result, written to its ``--out`` or into ``$OUT`` where that is set (:func:`write_out`).
- The kernel benchmarks' frame: one candidate checked and timed (:func:`check_and_time`), the configs of
  ``--list`` (:func:`print_configs`), and the run over the cases that keeps what was measured
  (:func:`run_cases`).
"""

from __future__ import annotations

import dataclasses

from .. import problems
from ..swiglu_down.designs.chained import GRAD_DOWN_LAST_MIN_TOKENS, ChainedConfig
from ..swiglu_down.designs.engine import WIDE, EngineDesign
from ..swiglu_down.designs.gluon import FORMS, grad_down_in_second_launch, with_second
from ..swiglu_down.designs.library_gemms import LibraryGemmsConfig
from ..swiglu_down.designs.triton_launches import FAITHFUL_TILES, tiles_for
from .cli import DTYPE_ALIASES, problems_by_dtype


def p1_candidates() -> dict:
    """Named configured designs of P1 (:data:`moe_lib.swiglu_down.designs.DESIGNS`) for the tuning scripts: every
    Gluon form (``gluon_<form>``), with dWd's tiles in launch 2 (``_dwd2``) and dx split over 2 or 4 programs
    (``_dx2``, ``_dx4``); cuBLAS's design as each path takes it; the chained launch's tiles by band; the portable
    launches' tiles by band; the grouped engine's three launches (fast path only): dx and the weight gradients side
    by side (``engine``), one after the other with tiles by the call's shape (``engine_in_turn``) and with the
    engine's 128 × 256 tiles (``engine_wide``). The chooser's own pick is not here: the scripts call it "default"."""
    candidates = {}
    for name, form in FORMS.items():
        candidates[f"gluon_{name}"] = form
        candidates[f"gluon_{name}_dwd2"] = grad_down_in_second_launch(form)
        for splits in (2, 4):
            candidates[f"gluon_{name}_dx{splits}"] = with_second(form, grad_x_splits=splits)
    candidates["library_gemms_fast"] = LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True)
    candidates["library_gemms_fast_dx2"] = LibraryGemmsConfig(d_a_fp32=True, streams=True, dx_in_two=True)
    candidates["library_gemms_fast_many"] = LibraryGemmsConfig(
        d_a_fp32=False, streams=True, stack_aside=True, stack_by_memcpy=True
    )
    candidates["library_gemms_faithful"] = LibraryGemmsConfig(d_a_fp32=True)
    for tokens, label in ((0, "chained"), (512, "chained_wide"), (GRAD_DOWN_LAST_MIN_TOKENS, "chained_wide_dwd_last")):
        candidates[label] = ChainedConfig.for_tokens(tokens)
    for tokens, label in ((16, "triton_tiny"), (256, "triton_mid"), (1024, "triton_wide")):
        candidates[label] = tiles_for(tokens, with_lo=False)
    candidates["triton_faithful"] = FAITHFUL_TILES
    candidates["engine"] = EngineDesign()
    candidates["engine_in_turn"] = EngineDesign(beside=False)
    candidates["engine_wide"] = EngineDesign(beside=False, grad_x_tiles=WIDE, weight_grad_tiles=WIDE)
    return candidates


P1_CANDIDATES = p1_candidates()
DEFAULT = "default"  # the scripts' name for the design the chooser picks (the public call)


def p1_candidate_names(text: str | None, *, default: bool = True) -> list[str]:
    """A P1 script's ``--configs``: comma-separated names of :data:`P1_CANDIDATES` ("all": every one), each once, in
    order; "default" among them where the script times the chooser's own pick (``default``). ValueError naming the
    unknown ones."""
    if text == "all":
        return list(P1_CANDIDATES)
    names = list(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
    unknown = [name for name in names if name not in P1_CANDIDATES and not (default and name == DEFAULT)]
    if unknown:
        raise ValueError(f"unknown candidate(s) {unknown}; see moe_lib.bench.tuning.P1_CANDIDATES")
    return names


def p1_call(name: str, inputs: dict, precision: str):
    """P1's call on ``inputs`` (the problem's arguments, in order) by the design ``name`` names, ready to run:
    "default" is the public call (the chooser's pick), any other name its configured design of
    :data:`P1_CANDIDATES` on the Triton path."""
    from ..swiglu_down import swiglu_down_backward
    from ..swiglu_down.backward import swiglu_down_backward_triton

    if name == DEFAULT:
        return lambda: swiglu_down_backward(*inputs.values(), precision=precision)
    config = P1_CANDIDATES[name]
    return lambda: swiglu_down_backward_triton(*inputs.values(), config=config, precision=precision)


def parse_field(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` with VALUE an int, or ints joined by x for a tile (``grad_down_tile=128x256x64``)."""
    name, sign, value = text.partition("=")
    try:
        if not sign or not name:
            raise ValueError
        return name, tuple(int(v) for v in value.split("x")) if "x" in value else int(value)
    except ValueError:
        raise ValueError(f"field: expected FIELD=VALUE with an integer or ints joined by x, got {text!r}") from None


def parse_fields(text: str) -> dict:
    """Comma-separated ``FIELD=VALUE`` items as a dict (empty text: no fields)."""
    return dict(parse_field(item) for item in text.split(",") if item)


def parse_candidates(text: str, candidates: dict[str, dict]) -> dict[str, dict]:
    """A kernel benchmark's ``--configs``: names of ``candidates`` (comma-separated) or ``NAME:FIELD=VALUE,…``
    items, separated by ``;`` -> name -> the fields it replaces in the case's default config."""
    configs = {}
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        if ":" in item:
            name, _, fields = item.partition(":")
            configs[name] = parse_fields(fields)
            continue
        for name in (n.strip() for n in item.split(",") if n.strip()):
            if name not in candidates:
                raise ValueError(f"config {name!r}: not one of {sorted(candidates)} (or write NAME:FIELD=VALUE,…)")
            configs[name] = candidates[name]
    return configs


def replace_fields(config, fields: dict):
    """``config`` (a dataclass) with ``fields`` replaced; an unknown field is an error naming it."""
    known = {field.name for field in dataclasses.fields(config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{unknown}: not fields of {type(config).__name__} (fields: {sorted(known)})")
    return dataclasses.replace(config, **fields)


def parse_case(text: str, op: str = "moe_experts_backward") -> tuple[problems.Problem, int]:
    """``dtype:num_tokens`` (``fp32:2048``) -> (the problem of ``op`` whose inputs have that dtype, num_tokens)."""
    dtype, sign, count = text.partition(":")
    by_dtype = problems_by_dtype(op)
    name = DTYPE_ALIASES.get(dtype.strip())
    if not sign or name not in by_dtype or not count.strip().isdigit():
        raise ValueError(
            f"case: expected dtype:num_tokens with dtype in {sorted(by_dtype)} (or an alias such as "
            f"fp32, bf16) and num_tokens an integer, got {text!r}"
        )
    return by_dtype[name], int(count)


def write_out(name: str, document, *, path=None, indent: int | None = 1):
    """A script's result as JSON: to ``path`` where given, else to ``$OUT/<name>`` where OUT is set (the folder
    ``scripts/gpu_bench.sh`` and the GPU runs collect), else nowhere. Returns the path written, or None."""
    import json
    import os
    from pathlib import Path

    if path is None and os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / name
    if path is None:
        return None
    Path(path).write_text(json.dumps(document, indent=indent))
    return Path(path)


# --------------------------------------------------------------------------------------------------
# what the GPU kernel benchmarks share


def first_line(exc: BaseException) -> str:
    """``<ExceptionType>: <first line>``, at most 200 characters (a failed candidate's row)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def cuda_usable() -> bool:
    """False after a sticky CUDA error (an illegal address, a trap): nothing more can run in this process."""
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def p2_kernel_a_workspaces(inputs: dict) -> dict:
    """P2's routing and kernel A's workspaces dg, du, aw (rows in sorted order), made the way
    ``moe_experts_backward_triton`` makes them, for benchmarks of the kernels that follow A: dict of the
    launch config and plan, the routing, sizes (T, K, E, I, H), the interface dtype, kernel W's operands x
    and dy (bf16 hi halves for fp32 inputs), the weights, and dgate, dup, scaled_act."""
    import torch

    from ..moe_experts import launch
    from ..moe_experts.choose import launch_config
    from ..moe_experts.routing import route_by_expert
    from ..moe_experts.runtime import WORKSPACE_DTYPES, operand_halves

    x, dy = inputs["hidden_states"], inputs["grad_output"]
    T, K = inputs["topk_indices"].shape
    E, I, H = inputs["gate_weights"].shape
    dtype, device = x.dtype, x.device
    config = launch_config(T * K, E, input_bytes=x.element_size())
    plan = launch.launch_plan(T, H, I, E, K, config)
    routing = route_by_expert(inputs["topk_indices"], E)
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    split = dtype == torch.float32
    dgate, dup, scaled_act = (torch.empty((T * K, I), dtype=workspace_dtype, device=device) for _ in range(3))
    topk_partial = torch.empty((plan["A"].grid["I-tiles"], T * K), dtype=torch.float32, device=device)
    x_halves = operand_halves(x, split, workspace_dtype)
    dy_halves = operand_halves(dy, split, workspace_dtype)
    launch.launch_swiglu_grad(
        config,
        plan,
        routing,
        x_halves,
        dy_halves,
        inputs["topk_weights"],
        inputs["gate_weights"],
        inputs["up_weights"],
        inputs["down_weights"],
        dgate,
        dup,
        scaled_act,
        topk_partial,
        forward_only=False,
    )
    torch.cuda.synchronize()
    return dict(
        config=config,
        plan=plan,
        routing=routing,
        T=T,
        K=K,
        E=E,
        I=I,
        H=H,
        dtype=dtype,
        x=x_halves[0],
        dy=dy_halves[0],
        gate=inputs["gate_weights"],
        up=inputs["up_weights"],
        down=inputs["down_weights"],
        dgate=dgate,
        dup=dup,
        scaled_act=scaled_act,
    )


def candidate_verdict(row: dict) -> str:
    """The check column of a candidate's row: "ok", "WRONG (...)", or "" where it was not checked."""
    if "ok" not in row:
        return ""
    return "ok" if row["ok"] else f"WRONG (finite={row['finite']}, structure={row['structure_problems']})"


def check_and_time(row: dict, prepare, *, flush, reps: int, base_ms: float, label: str) -> dict:
    """One candidate of a kernel benchmark, recorded in ``row``: ``prepare()`` returns (run, check) — the
    launch to time and a function returning the check's fields —; ``run`` goes once, its check is merged
    into ``row``, then its CUDA-graph replays are timed (``ms``, ``speedup`` over ``base_ms``). A failure is
    kept as ``row["error"]`` (its first line) and printed, and the benchmark goes on with the next candidate,
    unless the failure left the CUDA context unusable (then RuntimeError). Prints the row as JSON."""
    import json

    import torch

    from . import timing

    try:
        run, check = prepare()
        run()
        torch.cuda.synchronize()
        row.update(check())
        ms = timing.time_graph(run, flush, reps=reps)["median_ms"]
        row.update(ms=ms, speedup=base_ms / ms)
    except Exception as exc:  # report and go on with the other candidates
        row["error"] = first_line(exc)
        print(f"{label}: {row['error']}", flush=True)
    print(json.dumps(row), flush=True)
    if "error" in row and not cuda_usable():
        raise RuntimeError(f"{label} left the CUDA context unusable: {row['error']}")
    torch.cuda.empty_cache()
    return row


def print_configs(cases, configs: dict[str, dict], choose_config, name_width: int = 16) -> None:
    """A P2 kernel benchmark's ``--list``: per case (``(text, (problem, num_tokens))``) each named candidate's
    fields over the case's default, ``choose_config(T·K, E, input bytes, interpreter=False)``, resolved, or
    why they are invalid."""
    for case, (problem, num_tokens) in cases:
        sizes = problem.sizes(num_tokens)
        default = choose_config(
            num_tokens * sizes["top_k"], sizes["num_experts"], problem.dtype.itemsize, interpreter=False
        )
        for name, fields in configs.items():
            try:
                print(f"{case:11s} {name:{name_width}s} {replace_fields(default, fields)}")
            except ValueError as exc:
                print(f"{case:11s} {name:{name_width}s} invalid: {exc}")


def run_cases(run_case, cases, *, out: str | None, out_name: str, print_table) -> int:
    """A kernel benchmark's run: ``run_case(case)`` rows for every case, stopping early where a CUDA error
    left the context unusable (RuntimeError) but keeping what was measured: the rows go as JSON to ``out``
    (default ``$OUT/<out_name>`` where OUT is set) and to ``print_table``. Returns the exit code: 0 when
    every row is correct and ran."""
    rows = []
    try:
        for case, _ in cases:
            rows += run_case(case)
    except RuntimeError as exc:  # a sticky CUDA error: keep what was measured
        print(f"stopped: {exc}", flush=True)
    finally:
        write_out(out_name, rows, path=out or None)
        print_table(rows)
    return 0 if all(r.get("ok", True) and "error" not in r for r in rows) else 1
