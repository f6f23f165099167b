"""Try configured designs of the P1 Triton backward on every benchmark case; print the best per case.

Run on a CUDA machine from the repository root:
    PYTHONPATH=. python3 scripts/p1/p1_tune.py --configs NAME,NAME [--tokens T,T] [--precision fast] [--out DIR]
        [--peers torch_compile]
The candidates are named in ``moe_lib.bench.tuning.P1_CANDIDATES`` (configured designs of the registry,
``moe_lib.swiglu_down.designs``); the chooser's own pick ("default") is always timed beside them, and alone without
--configs (``--configs all`` times every candidate: dozens, minutes of GPU time per token count). ``--peers`` times
P1's peers of the benchmark (``moe_lib.bench.peers``: torch_compile, compiled afresh for each token count, and
torch_eager) beside them. Each is checked against the float64 reference before it is timed (CUDA-graph replay, L2
flushed before every replay, median of 30); the peers stay out of the best per case.
With --parts: each launch of the portable two-launch candidates (``triton_*``) alone, beside cuBLAS GEMMs of the same
shapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import pandas as pd
import torch
from tqdm import tqdm

from moe_lib import problems
from moe_lib.bench import peers, timing
from moe_lib.bench.checks import compare_output, reference_outputs
from moe_lib.bench.results import geomean
from moe_lib.bench.tuning import DEFAULT, P1_CANDIDATES, p1_candidate_names
from moe_lib.swiglu_down.backward import allocate_outputs, swiglu_down_backward_triton
from moe_lib.swiglu_down.checks import PRECISIONS
from moe_lib.swiglu_down.designs import Inputs, TileConfig
from moe_lib.swiglu_down.designs.triton_launches import (
    launch_d_intermediate_and_grad_down,
    launch_grad_x_and_grad_gate_up,
    launch_plan,
    split_workspaces,
)
from moe_lib.swiglu_down.runtime import carries_low_halves

PROBLEM = "swiglu_down_backward"
PARTS_TOKENS = "1,16,128,1087,4093,8192"


def rel_errors(outputs, references) -> list[float]:
    """‖out − ref‖/‖ref‖ of each output (inf where it has NaN/Inf)."""
    return [compare_output(out, ref, None)["rel_error"] for out, ref in zip(outputs, references, strict=True)]


def candidate_names(configs: str | None) -> list[str]:
    """The candidates --configs names ("all": every one of P1_CANDIDATES; none: none, only the default), each once;
    "default" is timed anyway. ValueError naming unknown ones."""
    return [name for name in p1_candidate_names(configs) if name != DEFAULT]


def peer_names(text: str | None) -> list[str]:
    """The peers --peers names (P1's peers of the benchmark but its reference), each once; ValueError naming unknown
    ones."""
    known = [name for name in peers.peers_for(PROBLEM) if name not in ("reference", "triton", "triton_fast")]
    names = list(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; P1's peers: {known}")
    return names


def time_parts(args, flush):
    """Each launch alone for a few configs and token counts, beside cuBLAS GEMMs of the same shapes."""
    problem = problems.load(PROBLEM)
    names = [
        name
        for name in candidate_names(args.configs) or list(P1_CANDIDATES)
        if isinstance(P1_CANDIDATES[name], TileConfig)
    ]  # launches of their own
    rows = []
    for T in [int(t) for t in (args.tokens or PARTS_TOKENS).split(",")]:
        inp = problem.make_inputs(T, seed=T, device="cuda")
        I = inp["gate"].shape[1]
        with_lo = carries_low_halves(inp["x"].dtype, "faithful")
        d_gate = torch.empty((2 if with_lo else 1, T, I), dtype=inp["x"].dtype, device="cuda")
        d_up = torch.empty_like(d_gate)
        inputs = Inputs(*inp.values())
        outs = allocate_outputs(inp["x"], I)
        w_cat = torch.cat([inp["gate_weight"], inp["up_weight"]])
        d_cat = torch.randn(T, 2 * I, device="cuda", dtype=torch.bfloat16)
        dy, x = inp["grad_output"], inp["x"]
        cublas = {
            "dA=dy@Wd": lambda: dy @ inp["down_weight"],
            "dWd=dyT@inter": lambda: dy.T @ inp["intermediate"],
            "dx=dG@[Wg;Wu]": lambda: d_cat @ w_cat,
            "dWgu=dGT@x": lambda: d_cat.T @ x,
        }
        for name, fn in cublas.items():
            rows.append(dict(T=T, what="cublas " + name, us=timing.graph_median_ms(fn, flush) * 1e3))
        for name in names:
            c = P1_CANDIDATES[name]
            plan = launch_plan(T, x.shape[1], I, c)
            workspaces = split_workspaces(plan, x.device)
            try:
                l1 = timing.graph_median_ms(
                    lambda c=c, plan=plan, w=workspaces: launch_d_intermediate_and_grad_down(
                        inputs, d_gate, d_up, outs.grad_down_weight, c, plan, with_lo, w
                    ),
                    flush,
                )
                l2 = timing.graph_median_ms(
                    lambda c=c, plan=plan, w=workspaces: launch_grad_x_and_grad_gate_up(
                        inputs, d_gate, d_up, outs, c, plan, with_lo, w
                    ),
                    flush,
                )
            except Exception as exc:
                print(T, name, "ERROR", repr(exc)[:300], file=sys.stderr)
                continue
            rows.append(dict(T=T, what=f"{name} launch1", us=l1 * 1e3))
            rows.append(dict(T=T, what=f"{name} launch2", us=l2 * 1e3))
        print(rows[-1], file=sys.stderr)
    table = pd.DataFrame(rows).pivot(index="what", columns="T", values="us").round(1)
    print(table.to_string())
    if args.out:
        table.to_csv(f"{args.out}/p1_parts.csv")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for p1_tune.json (or p1_parts.csv), made if missing")
    parser.add_argument("--tokens", default=None, help="comma list (default: the benchmark suite)")
    parser.add_argument(
        "--configs",
        default=None,
        help="comma list of candidate names (moe_lib.bench.tuning.P1_CANDIDATES), or 'all'; the "
        "chooser's own pick ('default') is always timed",
    )
    parser.add_argument(
        "--peers",
        default=None,
        help="comma list of P1's peers (moe_lib.bench.peers: torch_compile, torch_eager) timed beside the candidates",
    )
    parser.add_argument("--parts", action="store_true", help="time each launch alone, beside cuBLAS")
    parser.add_argument(
        "--precision", default="faithful", choices=PRECISIONS, help="the path to tune (--parts takes its own: faithful)"
    )
    args = parser.parse_args()
    if args.tokens and not all(t.strip().isdigit() and int(t) > 0 for t in args.tokens.split(",")):
        sys.exit(f"--tokens: a comma list of positive token counts, got {args.tokens!r}")
    try:
        candidate_names(args.configs)
    except ValueError as exc:
        sys.exit(f"--configs: {exc}")
    try:
        peers_timed = peer_names(args.peers)
    except ValueError as exc:
        sys.exit(f"--peers: {exc}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: it times every candidate there")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    flush = timing.L2Flusher("cuda")
    if args.parts:
        return time_parts(args, flush)
    problem = problems.load(PROBLEM)
    suite = [int(t) for t in args.tokens.split(",")] if args.tokens else problem.suite
    names = candidate_names(args.configs)
    print(torch.cuda.get_device_name(), torch.__version__, file=sys.stderr)
    progress = tqdm(
        total=len(suite) * (len(names) + 1 + len(peers_timed)), desc="checked and timed", unit="call", file=sys.stderr
    )

    rows = []
    scratch = torch.zeros(1, device="cuda")
    floor = timing.graph_median_ms(lambda: scratch.add_(1), flush) * 1e3
    print(f"timing floor (graph of one tiny kernel): {floor:.2f} us")
    all_peers = peers.peers_for(PROBLEM)
    careful = all_peers["torch_eager"]  # the careful bf16 PyTorch: the error yardstick
    for T in sorted(suite):
        inputs = problem.make_inputs(T, seed=T, device="cuda")
        want, _ = reference_outputs(problem, inputs, small=False)
        yardstick = rel_errors(careful.prepare(inputs)(), want)
        for name in names + ["default"] + peers_timed:
            t0 = time.time()
            try:
                if name in peers_timed:
                    call = all_peers[name].prepare(inputs)  # torch_compile: compiled afresh for this token count
                else:
                    config = None if name == "default" else P1_CANDIDATES[name]  # None: the chooser's, as the call's
                    call = functools.partial(
                        swiglu_down_backward_triton, *inputs.values(), config=config, precision=args.precision
                    )
                torch.cuda.empty_cache()
                timing.poison_allocator("cuda", 256 * 2**20)
                errors = rel_errors(call(), want)
                ok = all(e <= 2 * y + 1e-4 for e, y in zip(errors, yardstick, strict=True))
                ms = timing.time_graph(call, flush)
            except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                rows.append(dict(T=T, config=name, error=repr(exc)[:200]))
                progress.write(f"{T} {name} ERROR {repr(exc)[:300]}", file=sys.stderr)
                progress.update()
                continue
            rows.append(
                dict(
                    T=T,
                    config=name,
                    median_us=ms["median_ms"] * 1e3,
                    p20_us=ms["p20_ms"] * 1e3,
                    p80_us=ms["p80_ms"] * 1e3,
                    ok=ok,
                    max_err=max(errors),
                    yardstick=max(yardstick),
                    secs=time.time() - t0,
                )
            )
            progress.write(str(rows[-1]), file=sys.stderr)
            progress.update()
    progress.close()
    if args.out:
        with open(f"{args.out}/p1_tune.json", "w") as f:
            json.dump(rows, f, indent=1)
    df = pd.DataFrame([r for r in rows if "error" not in r])
    table = df.pivot(index="T", columns="config", values="median_us").round(1)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    print(table.to_string())
    good = df[df.ok & ~df.config.isin(peers_timed)]
    best = good.loc[good.groupby("T").median_us.idxmin()][["T", "config", "median_us", "max_err", "yardstick"]]
    print(best.to_string(index=False))
    geo, geo_default = geomean(best.median_us), geomean(df[df.config == "default"].median_us)
    print(f"geomean best-per-case {geo:.1f} us; default configs {geo_default:.1f} us; all ok: {bool(df.ok.all())}")
    if peers_timed:  # each column over the token counts every column has
        print(
            "geomean over the token counts all ran: "
            + ", ".join(f"{k} {geomean(v):.1f} us" for k, v in table.dropna().items())
        )


if __name__ == "__main__":
    main()
