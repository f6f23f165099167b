"""One forward + backward of P2's engine layer (pre-activations saved) per token count, for ncu or torch.profiler.

    PYTHONPATH=. ncu --clock-control none --profile-from-start off \
        --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 scripts/p2/engine_profile.py --tokens 32768
    PYTHONPATH=. python3 scripts/p2/engine_profile.py --tokens 2048,32768 --kernel-times
    PYTHONPATH=. python3 scripts/p2/engine_profile.py --model Qwen3-30B-A3B --tokens 32768 --kernel-times --written

Each token count: the benchmark's inputs (``moe_experts_backward_bf16``), one untimed call (the kernels compile),
then one call between cudaProfilerStart and cudaProfilerStop (ncu's ``--profile-from-start off`` profiles those
kernels alone: the layer's launches, its torch gathers and sums). The layer runs as the library sets its switches;
each option below sets one (``--no-...`` clears it). With ``--kernel-times``: instead, torch.profiler
over three calls, and a table of each kernel's GPU time a call (its share of the call's kernels) for the layer and
for the op (the backward with the forward recomputed). ``--model``: that model's expert shape
(moe_lib/bench/models.py) instead of P2's; ``--written``: x_s and dy_s written out before the products that
otherwise read x's and dy's rows through the routing (``engine_layer.GATHER_IN_LOADS`` off); ``--in-parts``: those
rows loaded by four one-warp partitions (``grouped_gemm.GATHER_IN_PARTS``); ``--no-x-s``: the gate and up gradients
read x's rows through the routing too (``engine_layer.GATHER_X_IN_WEIGHT_GRADS``); ``--dx-slices``: dX made a column
slice at a time where H > 2I (``engine_layer.DX_IN_COLUMN_SLICES``); ``--ring``: dswiglu's saved tiles brought
through the ring a chunk a step (``grouped_gemm.SAVED_THROUGH_RING``, its own tiles); ``--dswiglu-tiles
128,256,32,4``: dswiglu's tiles (``grouped_gemm.DSWIGLU_CONFIG``, cooperative).
"""

from __future__ import annotations

import argparse

import torch

from moe_lib import problems
from moe_lib.bench import models
from moe_lib.bench.cli import model_list
from moe_lib.engine import grouped_gemm
from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.moe_experts import engine_layer

LAYER_INPUTS = ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")


def layer_step(inputs):
    """The layer's forward saving g and u, then its backward, which spends them as the layer's does: the gradients."""
    args = [inputs[name] for name in LAYER_INPUTS]
    _, preactivations = engine_layer.forward(*args, save_preactivations=True)
    return engine_layer.backward(inputs["grad_output"], *args, preactivations=preactivations, spend_preactivations=True)


def op_step(inputs):
    """The backward with the forward recomputed (the op)."""
    return engine_layer.backward(inputs["grad_output"], *[inputs[name] for name in LAYER_INPUTS])


def kernel_times(step, inputs, calls: int = 3) -> str:
    """Each kernel's GPU time a call under torch.profiler, largest first, with its share of the call's total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step(inputs)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda row: -row[1])
    total = sum(ms for _, ms in rows)
    lines = [f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  {name[:90]}" for name, ms in rows[:14]]
    return "\n".join(lines + [f"  {total:8.3f} ms in all kernels a call"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768", help="comma-separated token counts")
    parser.add_argument("--kernel-times", action="store_true", help="torch.profiler's kernel times instead of ncu")
    parser.add_argument("--model", type=model_list, help="a model of moe_lib/bench/models.py: its expert shape")
    # each switch left as the library sets it unless named (--x or --no-x)
    switch = dict(action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--written", **switch, help="x_s and dy_s written out, not gathered in the loads")
    parser.add_argument("--in-parts", **switch, help="the gathered rows loaded by four one-warp parts")
    parser.add_argument("--x-s", **switch, help="x_s written for the gate and up gradients (--no-x-s: x gathered)")
    parser.add_argument("--dx-slices", **switch, help="dX made a column slice at a time where H > 2I")
    parser.add_argument("--ring", **switch, help="dswiglu's saved tiles through the ring, chunk by chunk")
    parser.add_argument("--dswiglu-tiles", help="dswiglu's config as BLOCK_M,BLOCK_N,BLOCK_K,STAGES (cooperative)")
    args = parser.parse_args()
    if args.written and (args.in_parts or args.x_s is False):
        parser.error("--written: not with --in-parts or --no-x-s, which read rows through the routing")
    axes = {}
    if args.model:
        if len(args.model) != 1:
            parser.error("--model: one model")
        axes = next(m for m in models.MODEL_SHAPES if m.name == args.model[0]).axes("moe_experts_backward")
        if not axes.get("num_experts"):
            parser.error(f"--model: {args.model[0]} has no experts")
    for module, name, value in ((engine_layer, "GATHER_IN_LOADS", None if args.written is None else not args.written),
                                (grouped_gemm, "GATHER_IN_PARTS", args.in_parts),
                                (engine_layer, "GATHER_X_IN_WEIGHT_GRADS", None if args.x_s is None else not args.x_s),
                                (engine_layer, "DX_IN_COLUMN_SLICES", args.dx_slices),
                                (grouped_gemm, "SAVED_THROUGH_RING", args.ring)):  # fmt: skip
        if value is not None:
            setattr(module, name, value)
    if args.dswiglu_tiles:
        try:
            grouped_gemm.DSWIGLU_CONFIG = GemmConfig(*(int(v) for v in args.dswiglu_tiles.split(",")))
        except (TypeError, ValueError) as exc:
            parser.error(f"--dswiglu-tiles: {exc}")
    problem = problems.load("moe_experts_backward_bf16")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        inputs = problem.make_inputs(num_tokens, device="cuda", **axes)
        layer_step(inputs)  # compiles the kernels
        op_step(inputs)
        torch.cuda.synchronize()
        if args.kernel_times:
            for name, step in (("layer", layer_step), ("op", op_step)):
                print(f"T={num_tokens} {name}:\n{kernel_times(step, inputs)}", flush=True)
        else:
            torch.cuda.nvtx.range_push(f"T={num_tokens}")
            torch.cuda.cudart().cudaProfilerStart()
            layer_step(inputs)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            torch.cuda.nvtx.range_pop()
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
