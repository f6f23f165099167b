"""Host (CPU) time per call of the layers: moe_lib.moe_experts and moe_lib.swiglu_expert, forward, backward and both.

On a CUDA GPU, per layer, case and phase:
- CPU µs per call: perf_counter over ``--calls`` calls issued back to back, then one sync (the host's work alone,
  as long as the call never waits on the GPU: ``validate=False``, as the Hugging Face drop-in passes);
- GPU µs per call (events): the same calls queued behind a GPU sleep long enough to cover their issue, so that the
  events time the GPU's work and not the host's gaps;
- GPU busy µs per call: the kernels' own time in a torch.profiler trace;
- the profiler's top-15 CPU ops by self time (``--out``: the tables, a JSON of every number, the traces).

Cases: "tiny", a smoke run on the CPU (``--device cpu --impl reference``); "model", notebook 07's GPU model
(``moe_lib/lab/in_a_model.py``: 8 × 1024 tokens, H 1024, I 512, E 64, K 8, bf16) and one of its experts' share for
swiglu_expert (1024 rows); "bench" and "bench_bf16", P2's benchmark shape (data/problems/moe_experts_backward/
definition.json: H 4096, I 2048, E 256, K 8) at 2048 tokens in fp32 (the definition's) and bf16, and P1's
(data/problems/swiglu_down_backward/definition.json: H 2048, I 768) at 2048. The phases: the layer's forward (inputs
that require grad, as in training), its backward alone (``torch.autograd.grad`` of forwards made before), both,
and for moe_experts the benchmark's function ``moe_experts_backward`` ("backward (function)").
``--compare REF`` times the same for the git ref ``REF`` checked out into a temporary worktree, one table beside.
``--encoded``: the grouped engine's launches (``moe_lib.engine.gluon_gemm.ENCODED_LAUNCHES``) through Triton's JIT
("off"), through the kept encoded launches ("on"), each row for both ("both": the same inputs, one after the
other), or as the module sets them ("default").

``--micro`` (CPU, no GPU): timeit micro-benchmarks of the host functions on the path (checks, impl and design
choice, launch plan, routing metadata, the ops around the reference), for before/after numbers of host changes.

    PYTHONPATH=. python3 scripts/host_time.py --out /tmp/host_time
    PYTHONPATH=. python3 scripts/host_time.py --out /tmp/host_time --compare main
    PYTHONPATH=. python3 scripts/host_time.py --out /tmp/host_time --cases model --layers moe_experts --encoded both
    PYTHONPATH=. python3 scripts/host_time.py --micro
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# (T, H, I, E, K, dtype) per case of moe_experts; (T, H, I, dtype) of swiglu_expert
MOE_CASES = {
    "tiny": (16, 64, 32, 8, 2, torch.float32),  # a smoke run on the CPU (--device cpu --impl reference)
    "model": (8 * 1024, 1024, 512, 64, 8, torch.bfloat16),
    "bench": (2048, 4096, 2048, 256, 8, torch.float32),
    "bench_bf16": (2048, 4096, 2048, 256, 8, torch.bfloat16),
}
SWIGLU_CASES = {
    "tiny": (16, 64, 32, torch.float32),
    "model": (1024, 1024, 512, torch.bfloat16),
    "bench": (2048, 2048, 768, torch.float32),
    "bench_bf16": (2048, 2048, 768, torch.bfloat16),
}
LAYERS = ("moe_experts", "swiglu_expert")
PHASES = ("forward", "backward", "forward+backward")
ENCODED_MODES = ("default", "off", "on", "both")
TOP_OPS = 15


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the full logs (tables, JSON, traces)")
    parser.add_argument("--cases", default="model,bench,bench_bf16", help=f"comma list of {', '.join(MOE_CASES)}")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {', '.join(LAYERS)}")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing (issued back to back)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per row; the median is reported")
    parser.add_argument("--profile-calls", type=int, default=5, help="calls in the profiler's trace")
    parser.add_argument("--impl", default="triton", choices=("triton", "reference", "auto"), help="the layers' impl")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run, no GPU times")
    parser.add_argument("--compare", metavar="REF", help="also time the git ref REF (a temporary worktree)")
    parser.add_argument(
        "--encoded",
        default="default",
        choices=ENCODED_MODES,
        help="the grouped engine's launches: through the JIT (off), encoded (on), each row both ways, or as set",
    )
    parser.add_argument("--micro", action="store_true", help="the host functions' CPU micro-benchmarks (no GPU)")
    parser.add_argument("--number", type=int, default=2000, help="--micro: calls per timeit measurement")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # --compare's child: the rows into this file
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or set(cases) - set(MOE_CASES):
        parser.error(f"--cases: expected a comma list of {', '.join(MOE_CASES)}, got {args.cases!r}")
    layers = [name for name in args.layers.split(",") if name]
    if not layers or set(layers) - set(LAYERS):
        parser.error(f"--layers: expected a comma list of {', '.join(LAYERS)}, got {args.layers!r}")
    if min(args.calls, args.repeats, args.profile_calls, args.number) < 1:
        parser.error("--calls, --repeats, --profile-calls and --number: expected positive integers")
    args.cases, args.layers = cases, layers
    return args


# --- one layer's calls ----------------------------------------------------------------------------------------------


def layer_calls(layer: str, case: str, device, impl: str = "triton") -> dict:
    """Per phase, a function of no arguments making one call (``prepare`` builds what the backward reads)."""
    import moe_lib

    generator = torch.Generator(device=device).manual_seed(0)

    def normal(shape, std, dtype):
        return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std).to(dtype)

    if layer == "moe_experts":
        from moe_lib.moe_experts.inputs import route_tokens

        T, H, I, E, K, dtype = MOE_CASES[case]
        x = normal((T, H), 1.0, dtype).requires_grad_()
        indices = route_tokens(T, E, K, device=device, generator=generator)
        weights = torch.softmax(normal((T, K), 1.0, torch.float32), dim=-1).requires_grad_()
        experts = [normal(shape, 0.02, dtype).requires_grad_() for shape in ((E, I, H), (E, I, H), (E, H, I))]
        leaves = (x, weights, *experts)

        def forward():
            return moe_lib.moe_experts(x, indices, weights, *experts, impl=impl, validate=False)

        def function():  # the benchmark's function: the backward with the forward recomputed
            return moe_lib.moe_experts_backward(dy, x, indices, weights, *experts, impl=impl, validate=False)

    else:
        T, H, I, dtype = SWIGLU_CASES[case]
        x = normal((T, H), 1.0, dtype).requires_grad_()
        gate_up = normal((2 * I, H), 0.02, dtype)
        experts = [gate_up[:I].requires_grad_(), gate_up[I:].requires_grad_(), normal((H, I), 0.02, dtype)]
        experts[2].requires_grad_()
        leaves = (x, *experts)
        function = None

        def forward():
            return moe_lib.swiglu_expert(x, *experts, impl=impl)

    dy = normal((T, H), 1.0, dtype)

    def backward_of(y):
        return torch.autograd.grad(y, leaves, dy)

    def forward_backward():
        return backward_of(forward())

    calls = {"forward": forward, "backward": backward_of, "forward+backward": forward_backward}
    if function is not None:
        calls["backward (function)"] = function
    return calls


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, phase: str, calls: int, device) -> tuple[float, float]:
    """(CPU µs, GPU µs) per call: the host's issue time with one sync after, then the GPU's by events with the
    calls queued behind a sleep (NaN on the CPU)."""

    def issue():
        ys = [call["forward"]() for _ in range(calls)] if phase == "backward" else None
        synchronize(device)
        return ys

    ys = issue()
    start = time.perf_counter()
    for i in range(calls):
        call[phase](ys[i]) if ys is not None else call[phase]()
    host = time.perf_counter() - start
    synchronize(device)
    if device.type != "cuda":
        return host / calls * 1e6, float("nan")
    ys = issue()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9 * 1.5 * host) + 1_000_000)  # ≥ the issue time at ≤ 2 GHz: the GPU waits for no host
    begin.record()
    for i in range(calls):
        call[phase](ys[i]) if ys is not None else call[phase]()
    end.record()
    torch.cuda.synchronize(device)
    return host / calls * 1e6, begin.elapsed_time(end) / calls * 1e3


def profiled(call, phase: str, calls: int, device) -> tuple[float, list, object]:
    """GPU busy µs per call (the kernels' time), the top CPU ops by self time, and the profile."""
    from torch.profiler import ProfilerActivity, profile

    ys = [call["forward"]() for _ in range(calls)] if phase == "backward" else None
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(calls):
            call[phase](ys[i]) if ys is not None else call[phase]()
        synchronize(device)
    events = prof.key_averages()
    device_time = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    top_ops = [
        dict(op=e.key, calls=e.count, self_cpu_us=e.self_cpu_time_total / calls, cpu_us=e.cpu_time_total / calls)
        for e in top
    ]
    return device_time / calls, top_ops, prof


def encoded_settings(mode: str) -> list[bool]:
    """The values of the engine's switch ``gluon_gemm.ENCODED_LAUNCHES`` each row is measured with."""
    from moe_lib.engine import gluon_gemm

    return {"default": [gluon_gemm.ENCODED_LAUNCHES], "off": [False], "on": [True], "both": [False, True]}[mode]


def measure(args) -> list[dict]:
    from moe_lib.engine import gluon_gemm

    device = torch.device(args.device)
    out = Path(args.out) if args.out else None
    settings = encoded_settings(args.encoded)
    rows = []
    for layer in args.layers:
        for case in args.cases:
            call = layer_calls(layer, case, device, args.impl)
            for phase in call:
                for encoded in settings:
                    gluon_gemm.ENCODED_LAUNCHES = encoded
                    for _ in range(2):  # warm-up: compiles every kernel and fills the caches
                        timed(call, phase, 2, device)
                    samples = sorted(timed(call, phase, args.calls, device) for _ in range(args.repeats))
                    host = sorted(s[0] for s in samples)[len(samples) // 2]
                    gpu = sorted(s[1] for s in samples)[len(samples) // 2]
                    busy, top_ops, prof = profiled(call, phase, args.profile_calls, device)
                    launches = "encoded" if encoded else "jit"
                    row = dict(layer=layer, case=case, phase=phase, cpu_us=host, gpu_us=gpu, gpu_busy_us=busy)
                    rows.append(row | dict(launches=launches, top_cpu_ops=top_ops))
                    if out is not None:
                        slug = re.sub(r"\W+", "_", phase.replace("+", " and ")).strip("_")
                        name = f"{layer}-{case}-{slug}" + (f"-{launches}" if len(settings) > 1 else "")
                        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)
                        (out / f"{name}.txt").write_text(table)
                        prof.export_chrome_trace(str(out / f"{name}.trace.json"))
            del call
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], reference: list[dict] | None = None, ref_name: str = "") -> None:
    before = {(r["layer"], r["case"], r["phase"]): r for r in reference or []}
    head = f"{'layer':14s} {'case':11s} {'phase':20s} {'launches':8s} {'CPU µs':>8s} {'GPU µs':>8s} {'busy µs':>8s}"
    print(head + f" {'CPU/GPU':>7s}" + (f" {'CPU µs ' + ref_name:>14s}" if reference else ""))
    for r in rows:
        line = (
            f"{r['layer']:14s} {r['case']:11s} {r['phase']:20s} {r.get('launches', ''):8s} {r['cpu_us']:8.0f} "
            f"{r['gpu_us']:8.0f} {r['gpu_busy_us']:8.0f} {r['cpu_us'] / max(r['gpu_us'], 1e-9):7.2f}"
        )
        old = before.get((r["layer"], r["case"], r["phase"]))
        print(line + (f" {old['cpu_us']:14.0f}" if old else ""))


def run_reference(args, ref: str, out: Path | None) -> list[dict]:
    """The same measurement of git ref ``ref``, checked out into a temporary worktree, in a child process."""
    with tempfile.TemporaryDirectory() as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=ROOT, check=True)
        try:
            result = Path(folder) / "rows.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--json", str(result)]
            command += ["--cases", ",".join(args.cases), "--layers", ",".join(args.layers)]
            command += ["--calls", str(args.calls), "--repeats", str(args.repeats)]
            command += ["--profile-calls", str(args.profile_calls), "--impl", args.impl, "--device", args.device]
            if out is not None:
                (out / ref.replace("/", "_")).mkdir(parents=True, exist_ok=True)
                command += ["--out", str(out / ref.replace("/", "_"))]
            subprocess.run(command, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), check=True)
            return json.loads(result.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


# --- the CPU micro-benchmarks ---------------------------------------------------------------------------------------


def micro_benchmarks() -> dict:
    """Named host functions of the path, each a call of no arguments (those a version lacks are left out)."""
    from moe_lib import moe_experts, swiglu_expert
    from moe_lib.dispatch import resolve_impl
    from moe_lib.moe_experts import engine_layer
    from moe_lib.moe_experts.checks import check_moe_experts_backward
    from moe_lib.moe_experts.choose import choose
    from moe_lib.moe_experts.launch import check_memory, launch_plan
    from moe_lib.moe_experts.reference import moe_experts_backward_reference, moe_experts_forward_reference
    from moe_lib.moe_experts.routing import route_by_expert
    from moe_lib.moe_experts.runtime import Target
    from moe_lib.swiglu_down.checks import check_swiglu_expert

    T, H, I, E, K, dtype = MOE_CASES["model"]
    bench = MOE_CASES["bench"]
    g = torch.Generator().manual_seed(0)
    x = torch.empty(T, H, dtype=dtype)
    indices = torch.randint(0, E, (T, K), generator=g)
    weights = torch.empty(T, K)
    experts = (torch.empty(E, I, H, dtype=dtype), torch.empty(E, I, H, dtype=dtype), torch.empty(E, H, I, dtype=dtype))
    hopper = Target(capability=(9, 0))
    choice = choose(T * K, E, H, I, dtype, hopper, top_k=K)
    bench_choice = choose(bench[0] * bench[4], bench[3], bench[1], bench[2], bench[5], hopper, top_k=bench[4])
    small = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])

    # the layers on the reference path at a tiny shape (fp32): their wrappers' and ops' share beside the math's
    t = dict(T=4, H=8, I=8, E=4, K=2)
    tx = torch.randn(t["T"], t["H"], generator=g, requires_grad=True)
    tidx = torch.stack([torch.randperm(t["E"], generator=g)[: t["K"]] for _ in range(t["T"])])
    tw = torch.rand(t["T"], t["K"], generator=g, requires_grad=True)
    tex = [
        (torch.randn(shape, generator=g) * 0.1).requires_grad_()
        for shape in ((t["E"], t["I"], t["H"]), (t["E"], t["I"], t["H"]), (t["E"], t["H"], t["I"]))
    ]
    tdy = torch.randn(t["T"], t["H"], generator=g)
    sw = [(torch.randn(shape, generator=g) * 0.1).requires_grad_() for shape in ((8, 8), (8, 8), (8, 8))]
    leaves = (tx, tw, *tex)

    def layer_fwd_bwd():
        torch.autograd.grad(moe_experts(tx, tidx, tw, *tex, validate=False), leaves, tdy)

    def reference_fwd_bwd():  # the same math without the layer: forward, then the backward with it recomputed
        with torch.no_grad():
            moe_experts_forward_reference(tx, tidx, tw, *tex)
            moe_experts_backward_reference(tdy, tx, tidx, tw, *tex)

    def swiglu_fwd_bwd():
        torch.autograd.grad(swiglu_expert(tx, *sw), (tx, *sw), tdy)

    return {
        "check_moe_experts_backward (model shape)": lambda: check_moe_experts_backward(
            x, x, indices, weights, *experts, validate=False
        ),
        "check_swiglu_expert": lambda: check_swiglu_expert(x, x[:I], x[:I], x[:H, :I]),
        "resolve_impl('auto')": lambda: resolve_impl("auto", x.device, x.dtype),
        "choose (model, Hopper)": lambda: choose(T * K, E, H, I, dtype, hopper, top_k=K),
        "choose (bench fp32, Hopper)": lambda: choose(
            bench[0] * bench[4], bench[3], bench[1], bench[2], bench[5], hopper, top_k=bench[4]
        ),
        "launch_plan (model)": lambda: launch_plan(T, H, I, E, K, choice, num_programs=132),
        "launch_plan (bench fp32)": lambda: launch_plan(*bench[:5], bench_choice, num_programs=132),
        "engine_layer.structure (model)": lambda: engine_layer.structure(T * K, E, H, I, dtype, hopper),
        "check_memory (model, cpu)": lambda: check_memory(x, indices, weights, experts[0], choice),
        "route_by_expert (16 × 2 of 8, cpu)": lambda: route_by_expert(small, 8),
        "moe_experts fwd+bwd (reference, tiny)": layer_fwd_bwd,
        "  the same math without the layer": reference_fwd_bwd,
        "swiglu_expert fwd+bwd (reference, tiny)": swiglu_fwd_bwd,
        **engine_launch_benchmarks(),
    }


def engine_launch_benchmarks() -> dict:
    """The grouped engine's host work a launch besides the launch itself, at the model's shape (meta tensors):
    the argument checks (skipped with ``check=False``), the descriptors and constexprs, the encoded launch's key."""
    from moe_lib.engine import grouped_gemm, grouped_wgrad
    from moe_lib.engine.gathered import Gathered

    T, H, I, E, K, dtype = MOE_CASES["model"]
    M = T * K

    def meta(*size, dtype=dtype):
        return torch.empty(size, dtype=dtype, device="meta")

    offsets, config = meta(E + 1, dtype=torch.int32), grouped_gemm.DSWIGLU_CONFIG
    saved, d_preact = meta(M, 2 * I), meta(M, 2 * I)
    dswiglu = dict(
        gate=saved[:, :I],
        up=saved[:, I:],
        scale=meta(M, dtype=torch.float32),
        dgate_out=d_preact[:, :I],
        dup_out=d_preact[:, I:],
        scaled_act_out=meta(M, I),
        topk_partial=meta(grouped_gemm.partial_rows(I, config), M, dtype=torch.float32),
    )
    dy_s, wd = meta(M, H), meta(E, H, I)
    x_s = Gathered(meta(T, H), meta(M, dtype=torch.int32))
    problems, outs = [(d_preact[:, :I], x_s), (d_preact[:, I:], x_s)], [meta(E, I, H), meta(E, I, H)]

    def key(module, arguments, constexprs):
        merged = arguments | constexprs
        values = [merged[name] for name in module.LAUNCHES.names]
        return module.LAUNCHES.key(values, 168, torch.device("cuda", 0))

    def gemm_arguments():
        return grouped_gemm.launch_arguments(config, dy_s, wd, offsets, "dswiglu", False, **dswiglu)

    def wgrad_arguments():
        return grouped_wgrad.launch_arguments(grouped_wgrad.DEFAULT_CONFIG, problems, offsets, outs)

    gemm_launch, wgrad_launch = gemm_arguments(), wgrad_arguments()
    return {
        "grouped_gemm check_arguments (dswiglu, model)": lambda: grouped_gemm.check_arguments(
            dy_s, wd, offsets, epilogue="dswiglu", b_transposed=False, config=config, **dswiglu
        ),
        "grouped_gemm launch_arguments (dswiglu, model)": gemm_arguments,
        "  its encoded launch's key": lambda: key(grouped_gemm, *gemm_launch),
        "grouped_wgrad check_arguments (dWg, dWu, model)": lambda: grouped_wgrad.check_arguments(
            problems, offsets, outs=outs
        ),
        "grouped_wgrad launch_arguments (dWg, dWu, model)": wgrad_arguments,
        "  its encoded launch's key ": lambda: key(grouped_wgrad, *wgrad_launch),
    }


def run_micro(number: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name, call in micro_benchmarks().items():
        call()
        count = max(1, number // 50) if "tiny" in name or "math" in name or "route" in name else number
        best = min(timeit.repeat(call, number=count, repeat=5)) / count
        results[name] = best * 1e6
        print(f"{name:44s} {best * 1e6:10.2f} µs")
    return results


def main(argv=None) -> None:
    args = parse_arguments(argv)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.micro:
        results = run_micro(args.number)
        if out is not None:
            (out / "micro.json").write_text(json.dumps(results, indent=1))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("host_time.py: needs a CUDA GPU (--micro and --device cpu run on the CPU)")
    reference = run_reference(args, args.compare, out) if args.compare else None
    rows = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
        return
    print_table(rows, reference, args.compare or "")
    if out is not None:
        (out / "host_time.json").write_text(json.dumps(dict(rows=rows, reference=reference), indent=1))
        with open(out / "top_cpu_ops.txt", "w") as f:
            for r in rows:
                f.write(
                    f"\n{r['layer']} {r['case']} {r['phase']} ({r['launches']} launches): top {TOP_OPS} CPU ops by "
                    f"self time (µs/call)\n"
                )
                for op in r["top_cpu_ops"]:
                    f.write(f"  {op['self_cpu_us']:9.1f} {op['cpu_us']:9.1f} {op['calls']:6d}  {op['op']}\n")


if __name__ == "__main__":
    main()
