"""Try tile configurations of the P1 Triton backward on every benchmark case; print the best per case.

Run on a CUDA machine from the repository root:  PYTHONPATH=. python3 scripts/p1_tune.py [--out DIR]
Each configuration is checked against the float64 reference before it is timed (CUDA-graph
replay, L2 flushed before every replay, median of 30).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from moe_lib import problems, reference
from moe_lib.kernels.swiglu_down_backward import (
    OneLaunchConfig,
    TileConfig,
    choose_config,
    launch_d_intermediate_and_grad_down,
    launch_grad_x_and_grad_gate_up,
    swiglu_down_backward_triton,
)

# name -> tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) of dA, dWd, dx, dWg/dWu; warps; stages
CANDIDATES = {
    "tiny_s8": TileConfig((16, 64, 128, 8), (64, 128, 16, 1), (16, 64, 128, 8), (64, 128, 16, 1), (4, 4), (3, 3)),
    "tiny_s16": TileConfig((16, 32, 128, 16), (64, 128, 16, 1), (16, 128, 128, 16), (64, 128, 16, 1), (4, 4), (3, 3)),
    "tiny_s4": TileConfig((16, 64, 256, 4), (64, 64, 16, 1), (16, 128, 256, 4), (64, 64, 16, 1), (4, 4), (3, 3)),
    "tiny_s16b": TileConfig((16, 64, 64, 16), (32, 128, 16, 1), (16, 64, 64, 16), (32, 128, 16, 1), (4, 4), (2, 2)),
    "mid_s4": TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1), (4, 4), (3, 3)),
    "mid_s2": TileConfig((64, 128, 64, 2), (128, 128, 64, 1), (64, 128, 64, 2), (128, 128, 64, 1), (4, 4), (3, 3)),
    "mid_s2w": TileConfig((64, 64, 64, 2), (64, 128, 64, 2), (64, 128, 64, 2), (64, 128, 64, 2), (4, 4), (3, 3)),
    "mid_s8": TileConfig((32, 64, 64, 8), (64, 128, 32, 1), (32, 128, 64, 8), (64, 128, 32, 1), (4, 4), (3, 3)),
    "mid_w4s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (64, 128, 64, 1), (64, 128, 64, 1), (4, 4), (4, 4)),
    "l_dwsplit": TileConfig((64, 128, 64, 1), (64, 128, 64, 2), (128, 256, 64, 1), (128, 256, 64, 2), (4, 8), (4, 4)),
    "wide2_w8s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4)),
    "widedw_w8s3": TileConfig((128, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1),
                              (8, 8), (3, 3)),
    "l_mix": TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 4)),
    "l_128": TileConfig((128, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 4)),
    # the one-launch path: (block_t, block_i, block_h_down, block_h, block_k, block_n, warps, stages)
    "one_t16": OneLaunchConfig(16, 16, 32, 16, 128, 128, 4, 3),
    "one_t32": OneLaunchConfig(32, 16, 32, 16, 128, 128, 4, 3),
    "one_t64": OneLaunchConfig(64, 16, 32, 16, 128, 128, 4, 3),
    "one_t128": OneLaunchConfig(128, 16, 32, 16, 64, 128, 4, 3),
    "one_t64_h32": OneLaunchConfig(64, 16, 32, 32, 128, 128, 4, 3),
    "one_t16_k256": OneLaunchConfig(16, 16, 32, 16, 256, 256, 4, 2),
    "one_t16_w8": OneLaunchConfig(16, 16, 32, 16, 128, 128, 8, 3),
    "one_t64_n64": OneLaunchConfig(64, 16, 32, 16, 64, 64, 4, 4),
    "one_k512": OneLaunchConfig(16, 16, 32, 16, 512, 128, 4, 3),
    "one_k256_s4": OneLaunchConfig(16, 16, 32, 16, 256, 128, 4, 4),
    "one_i32_k256": OneLaunchConfig(16, 32, 32, 16, 256, 128, 4, 3),
    "one_h32_k256": OneLaunchConfig(16, 16, 32, 32, 256, 128, 4, 3),
    "one_k512_w8": OneLaunchConfig(16, 16, 32, 16, 512, 128, 8, 3),
    "one_t64_k256": OneLaunchConfig(64, 16, 32, 16, 256, 128, 4, 3),
}


def flush_l2(buffer):
    buffer.add_(1)  # reads and writes 512 MB: everything else is evicted from the 60 MB L2


def time_graph(fn, reps=30, warmup=5):
    """Median and p20/p80 milliseconds of CUDA-graph replays of fn, L2 flushed before each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(128 * 1024 * 1024, dtype=torch.float32, device="cuda")
    times = []
    for i in range(warmup + reps):
        flush_l2(flush)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return q(0.5), q(0.2), q(0.8)


def rel_error(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def careful_pytorch(inputs):
    """The careful bf16 PyTorch formulation (measuring.md's torch_eager) for the error yardstick."""
    dy, x = inputs["grad_output"], inputs["x"]
    w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
    grad_down = dy.T @ inputs["intermediate"]
    d_a = (dy @ inputs["down_weight"]).float()
    s, gate = inputs["gate_sigmoid"].float(), inputs["gate"].float()
    d_gate = d_a * inputs["up"].float() * s * (1 + gate * (1 - s))
    d_up = d_a * inputs["gate_silu"].float()
    d_gu = torch.cat([d_gate, d_up], dim=1).to(dy.dtype)
    grad_x = d_gu @ w_gate_up
    grad_gu = d_gu.T @ x
    I = inputs["gate"].shape[1]
    return grad_x, grad_gu[:I], grad_gu[I:], grad_down


def time_parts(args):
    """Each launch alone for a few configs and token counts, beside cuBLAS GEMMs of the same shapes."""
    problem = problems.load("swiglu_down_backward")
    names = args.configs.split(",") if args.configs else list(CANDIDATES)
    rows = []
    for T in [int(t) for t in (args.tokens or "1,16,128,1087,4093,8192").split(",")]:
        inp = problem.make_inputs(T, seed=T, device="cuda")
        I = inp["gate"].shape[1]
        d_gate, d_up = torch.empty_like(inp["gate"]), torch.empty_like(inp["gate"])
        outs = [torch.empty_like(inp[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
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
            rows.append(dict(T=T, what="cublas " + name, us=time_graph(fn)[0] * 1e3))
        for name in names:
            c = CANDIDATES[name]
            try:
                l1 = time_graph(lambda c=c: launch_d_intermediate_and_grad_down(
                    dy, inp["down_weight"], inp["gate"], inp["gate_sigmoid"], inp["gate_silu"], inp["up"],
                    inp["intermediate"], d_gate, d_up, outs[3], c))[0]
                l2 = time_graph(lambda c=c: launch_grad_x_and_grad_gate_up(
                    x, inp["gate_weight"], inp["up_weight"], d_gate, d_up, outs[0], outs[1], outs[2], c))[0]
            except Exception as exc:
                print(T, name, "ERROR", repr(exc)[:300], file=sys.stderr)
                continue
            rows.append(dict(T=T, what=f"{name} launch1", us=l1 * 1e3))
            rows.append(dict(T=T, what=f"{name} launch2", us=l2 * 1e3))
        print(rows[-1], file=sys.stderr)
    import pandas as pd

    table = pd.DataFrame(rows).pivot(index="what", columns="T", values="us").round(1)
    print(table.to_string())
    if args.out:
        table.to_csv(f"{args.out}/p1_parts.csv")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", default=None, help="comma list (default: the benchmark suite)")
    parser.add_argument("--configs", default=None, help="comma list of candidate names")
    parser.add_argument("--parts", action="store_true", help="time each launch alone, beside cuBLAS")
    args = parser.parse_args()
    if args.parts:
        return time_parts(args)
    problem = problems.load("swiglu_down_backward")
    suite = [int(t) for t in args.tokens.split(",")] if args.tokens else problem.suite
    names = args.configs.split(",") if args.configs else list(CANDIDATES)
    print(torch.cuda.get_device_name(), torch.__version__, file=sys.stderr)

    rows = []
    scratch = torch.zeros(1, device="cuda")
    floor = time_graph(lambda: scratch.add_(1))[0] * 1e3
    print(f"timing floor (graph of one tiny kernel): {floor:.2f} us")
    for T in sorted(suite):
        inputs = problem.make_inputs(T, seed=T, device="cuda")
        want = reference.swiglu_down_backward_reference(*[v.double() for v in inputs.values()])
        yardstick = [rel_error(o, w) for o, w in zip(careful_pytorch(inputs), want, strict=True)]
        default = choose_config(T, 2048, 768)
        for name in names + ["default"]:
            config = default if name == "default" else CANDIDATES[name]
            t0 = time.time()
            try:
                torch.cuda.empty_cache()
                poison = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")
                del poison
                got = swiglu_down_backward_triton(*inputs.values(), config=config)
                errors = [rel_error(o, w) for o, w in zip(got, want, strict=True)]
                ok = all(e <= 2 * y + 1e-4 for e, y in zip(errors, yardstick, strict=True))
                call_args = list(inputs.values())
                ms = time_graph(lambda c=config, a=call_args: swiglu_down_backward_triton(*a, config=c))
            except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                rows.append(dict(T=T, config=name, error=repr(exc)[:200]))
                print(T, name, "ERROR", repr(exc)[:300], file=sys.stderr)
                continue
            rows.append(dict(T=T, config=name, median_us=ms[0] * 1e3, p20_us=ms[1] * 1e3, p80_us=ms[2] * 1e3,
                             ok=ok, max_err=max(errors), yardstick=max(yardstick), secs=time.time() - t0))
            print(rows[-1], file=sys.stderr)
    if args.out:
        with open(f"{args.out}/p1_tune.json", "w") as f:
            json.dump(rows, f, indent=1)
    import pandas as pd

    df = pd.DataFrame([r for r in rows if "error" not in r])
    table = df.pivot(index="T", columns="config", values="median_us").round(1)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    print(table.to_string())
    good = df[df.ok]
    best = good.loc[good.groupby("T").median_us.idxmin()][["T", "config", "median_us", "max_err", "yardstick"]]
    print(best.to_string(index=False))
    geo = math.exp(best.median_us.map(math.log).mean())
    geo_default = math.exp(df[df.config == "default"].median_us.map(math.log).mean())
    print(f"geomean best-per-case {geo:.1f} us; default configs {geo_default:.1f} us; "
          f"all ok: {bool(df.ok.all())}")


if __name__ == "__main__":
    main()
