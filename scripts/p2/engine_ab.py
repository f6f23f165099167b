"""A/B runs of P2's engine layer on one GPU, each variant checked against the first one's bits, timed by graph
replay after an L2 flush (median of 20, 10 at 32768 tokens); one short table, and its JSON under --out.

    PYTHONPATH=. python3 scripts/p2/engine_ab.py gather [--shapes p2_t32768_gate_up,p2_t32768_down,...]
    PYTHONPATH=. python3 scripts/p2/engine_ab.py tiles [--tokens 2048,4096,8192 | --cases Qwen3-30B-A3B:32768,...]
        [--variants dswiglu_pp_m64n128k64_s6]
    git show 3da7482:moe_lib/moe_experts/engine_layer.py > /tmp/before.py
    PYTHONPATH=. python3 scripts/p2/engine_ab.py structure --before /tmp/before.py [--tokens 2048,8192,32768]
    PYTHONPATH=. python3 scripts/p2/engine_ab.py loads [--cases P2:2048,Qwen3-30B-A3B:32768,...] [--rounds 4]
    PYTHONPATH=. python3 scripts/p2/engine_ab.py kloop [--cases Qwen3-30B-A3B:32768,...]

gather: the weight-gradient kernel (``moe_lib/engine/grouped_wgrad.py``) on rows written out, on rows gathered
through the routing with the consumers' proxy fence (``FENCE_GATHERED``) and without it, at the shapes of
``scripts/p2/wgrad_probe.py``. tiles: the op (the backward, forward recomputed) and the layer (forward saving g and
u, then backward) at P2's shape (or the ``--cases``) with the varlen-M products' tiles (``engine_layer.gemm_config``)
and dswiglu's (``grouped_gemm.DSWIGLU_CONFIG``) of each variant. structure: the layer and the op with an earlier
``engine_layer.py`` (loaded as a module of ``moe_lib.moe_experts``, the current tiles given to it) against the
current one, with the memory a layer step adds (its peak over what was allocated before). loads: the layer and the op
with x's and dy's rows read through the routing by the first product's and dswiglu's loads
(``engine_layer.GATHER_IN_LOADS``), those loads in four one-warp partitions (``grouped_gemm.GATHER_IN_PARTS``), then by
the gate and up gradients' loads too (``GATHER_X_IN_WEIGHT_GRADS``: no x_s at all), and with dX made a column slice at a
time as well (``DX_IN_COLUMN_SLICES``), against x_s and dy_s written out first, at P2's shape (``P2``) and the expert
shapes of moe_lib/bench/models.py, with the memory a layer step adds; and the parts form with dswiglu's saved tiles
brought through the ring (``grouped_gemm.SAVED_THROUGH_RING``), there also with [dg | du] written over the saved g and
u (``engine_layer.GRADS_OVER_SAVED``), with and without x_s, and with x gathered as the gate and up gradients' A
operand (``X_AS_A_IN_WEIGHT_GRADS``, ``X_AS_A_ONE_PRODUCT``) (:data:`LOAD_FORMS`); ``--forms`` picks some,
``--rounds`` repeats them (the order reversed each round) and gives each form's median. kloop: dswiglu's product dAp =
dy_s·Wd alone (the plain epilogue) at several tile shapes, beside dswiglu, dy's rows gathered in the loads
(:data:`KLOOP_VARIANTS`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from inspect import signature
from pathlib import Path

import torch

LAYER_INPUTS = ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")


def timed(call, flush, num_tokens: int) -> float:
    from moe_lib.bench.timing import time_graph

    return time_graph(call, flush, reps=10 if num_tokens >= 32768 else 20)["median_ms"]


def same_bits(outputs, first) -> bool:
    return all(torch.equal(x, y) for x, y in zip(outputs, first, strict=True))


def layer_calls(module, inputs):
    """(the layer step, the op) of an engine-layer module on ``inputs``."""
    args = [inputs[name] for name in LAYER_INPUTS]
    grad_output = inputs["grad_output"]

    # the layer's own step spends its saved g and u (an earlier engine_layer.py may not know the option)
    spend = {"spend_preactivations": True} if "spend_preactivations" in signature(module.backward).parameters else {}

    def layer():
        y, preactivations = module.forward(*args, save_preactivations=True)
        return (y, *module.backward(grad_output, *args, preactivations=preactivations, **spend))

    def op():
        return module.backward(grad_output, *args)

    return layer, op


def gather_ab(args, flush) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wgrad_probe

    from moe_lib.engine import grouped_wgrad

    rows, device = [], torch.device("cuda")
    for name in args.shapes.split(","):
        shape = wgrad_probe.SHAPES[name]
        generator = torch.Generator(device=device).manual_seed(args.seed)
        gathered, written, offsets = wgrad_probe.gathered_operands(shape, generator, device)
        outs = [torch.empty((shape.experts, m, n), dtype=torch.bfloat16, device=device) for m, n in shape.outputs]
        first, row = None, dict(shape=name)
        variants = (("written", written, True), ("gathered", gathered, True), ("gathered_no_fence", gathered, False))
        for label, operands, fence in variants:
            grouped_wgrad.FENCE_GATHERED = fence

            def call(operands=operands):
                return grouped_wgrad.grouped_weight_grad(operands, offsets, outs=outs)

            result = [out.clone() for out in call()]
            first = first or result
            row[f"{label}_ms"] = timed(call, flush, shape.tokens)
            row[f"{label}_same"] = same_bits(result, first)
        grouped_wgrad.FENCE_GATHERED = True
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def tiles_ab(args, flush) -> list[dict]:
    from moe_lib.engine import grouped_gemm, grouped_wgrad
    from moe_lib.engine.gluon_gemm import GemmConfig
    from moe_lib.moe_experts import engine_layer

    current = (engine_layer.gemm_config, grouped_gemm.DSWIGLU_CONFIG, grouped_wgrad.DEFAULT_CONFIG)
    pp64x128, pp64x256 = GemmConfig(64, 128, 64, 6, "pingpong"), GemmConfig(64, 256, 64, 4, "pingpong")
    variants = {  # (the varlen-M products' tiles, dswiglu's tiles, the bf16 weight gradients'); None: the current
        "current": (None, None, None),
        "pp_m128n128k64_s5": (GemmConfig(128, 128, 64, 5, "pingpong"), None, None),
        "pp_m64n128k64_s6": (pp64x128, pp64x128, None),
        "pp_m64n256k64_s4": (pp64x256, None, None),
        # dswiglu alone ping-pong: one consumer's epilogue (g, u loaded, four outputs) beside the other's K loop
        "dswiglu_pp_m64n128k64_s6": (None, pp64x128, None),
        "dswiglu_pp_m64n128k64_s5": (None, GemmConfig(64, 128, 64, 5, "pingpong"), None),  # 3 output tiles, not 2
        # the weight gradients with a two-step ring and two output tiles in turn (grouped_wgrad.output_buffers):
        # where an expert's rows are a K step or two, a tile's store overlaps the next tile
        "wgrad_coop_m128n256k64_s2": (None, None, GemmConfig(128, 256, 64, 2)),
        "wgrad_pp_m128n128k64_s3": (None, None, GemmConfig(128, 128, 64, 3, "pingpong")),
    }
    if args.variants:
        asked = args.variants.split(",")
        unknown = [name for name in asked if name not in variants]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; the tiles variants are {list(variants)}")
        variants = {name: variants[name] for name in dict.fromkeys(["current", *asked])}
    rows = []
    cases = args.cases.split(",") if args.cases else [f"P2:{t}" for t in args.tokens.split(",")]
    for case in cases:
        label, inputs = case_inputs(case)
        num_tokens = inputs["hidden_states"].shape[0]
        layer, op = layer_calls(engine_layer, inputs)
        first = None
        for name, (tiles, dswiglu, wgrad) in variants.items():
            engine_layer.gemm_config = current[0] if tiles is None else (lambda slots, experts, c=tiles: c)
            grouped_gemm.DSWIGLU_CONFIG = dswiglu or current[1]
            grouped_wgrad.DEFAULT_CONFIG = wgrad or current[2]
            result = [out.clone() for out in op()]
            first = first or result
            row = dict(case=case, tokens=num_tokens, variant=name, same=same_bits(result, first))
            row.update(op_ms=timed(op, flush, num_tokens), layer_ms=timed(layer, flush, num_tokens))
            rows.append(row)
            print(f"{label:26s} {name:26s} op {row['op_ms']:8.3f} ms  layer {row['layer_ms']:8.3f} ms  "
                  f"same bits {row['same']}", flush=True)  # fmt: skip
        engine_layer.gemm_config, grouped_gemm.DSWIGLU_CONFIG, grouped_wgrad.DEFAULT_CONFIG = current
        del inputs, layer, op, first
        torch.cuda.empty_cache()
    return rows


# dswiglu's product dAp = dy_s·Wd alone (the "none" epilogue, bf16 out) at each tile shape, beside dswiglu itself
KLOOP_VARIANTS = {
    "none_coop_m128n128k64_s4": ("none", (128, 128, 64, 4)),
    "none_coop_m128n128k64_s6": ("none", (128, 128, 64, 6)),
    "none_coop_m128n256k64_s3": ("none", (128, 256, 64, 3)),
    "none_coop_m128n256k32_s6": ("none", (128, 256, 32, 6)),
    "none_coop_m256n128k64_s3": ("none", (256, 128, 64, 3)),
    "dswiglu_coop_m128n128k64_s4": ("dswiglu", (128, 128, 64, 4)),
    # the saved g and u through the ring a BLOCK_K-column chunk a step (grouped_gemm.SAVED_THROUGH_RING)
    "dswiglu_ring_coop_m128n256k64_s4": ("dswiglu_ring", (128, 256, 64, 4)),
    "dswiglu_ring_coop_m128n256k64_s3": ("dswiglu_ring", (128, 256, 64, 3)),
    "dswiglu_ring_coop_m128n256k32_s8": ("dswiglu_ring", (128, 256, 32, 8)),
    "dswiglu_ring_coop_m128n128k64_s6": ("dswiglu_ring", (128, 128, 64, 6)),
    "dswiglu_ring_coop_m128n128k32_s8": ("dswiglu_ring", (128, 128, 32, 8)),
    "none_pp_m64n256k64_s4": ("none", (64, 256, 64, 4, "pingpong")),  # the floor of a ping-pong ring form
}


def kloop_ab(args, flush) -> list[dict]:
    """dswiglu's product at each tile shape of :data:`KLOOP_VARIANTS` with dy's rows gathered in the loads (as the
    layer reads them), its K loop with the plainest epilogue beside dswiglu's own: how much of dswiglu's time the
    tile shape's K loop sets."""
    from moe_lib.engine import grouped_gemm

    variants = args.variants.split(",") if args.variants else list(KLOOP_VARIANTS)  # names checked in main()
    through_ring = grouped_gemm.SAVED_THROUGH_RING
    try:
        return [row for case in args.cases.split(",") for row in kloop_case(case, variants, args.seed, flush)]
    finally:
        grouped_gemm.SAVED_THROUGH_RING = through_ring


def kloop_case(case: str, variants: list[str], seed: int, flush) -> list[dict]:
    """:func:`kloop_ab`'s rows of one case, a row per variant named."""
    from moe_lib.engine import grouped_gemm
    from moe_lib.engine.gathered import Gathered
    from moe_lib.engine.gluon_gemm import GemmConfig
    from moe_lib.moe_experts.routing import route_by_expert

    label, inputs = case_inputs(case)
    indices, dy, wd = inputs["topk_indices"], inputs["grad_output"], inputs["down_weights"]
    (T, K), (E, H, I) = indices.shape, wd.shape
    routing = route_by_expert(indices, E)
    a = Gathered(dy, routing.sorted_slot // K)  # each sorted slot's token
    M = T * K
    generator = torch.Generator(device="cuda").manual_seed(seed)
    gate, up = (torch.randn((M, I), generator=generator, device="cuda").to(torch.bfloat16) for _ in range(2))
    scale = torch.rand(M, generator=generator, device="cuda")
    out = torch.empty((M, I), dtype=torch.bfloat16, device="cuda")
    rows = []
    for name in variants:
        epilogue, tiles = KLOOP_VARIANTS[name]
        config = GemmConfig(*tiles)
        grouped_gemm.SAVED_THROUGH_RING = epilogue == "dswiglu_ring"
        if epilogue == "none":

            def call(config=config):
                return (grouped_gemm.grouped_gemm(a, wd, routing.expert_offsets, out=out, config=config),)
        else:

            def call(config=config):
                return grouped_gemm.grouped_gemm(a, wd, routing.expert_offsets, epilogue="dswiglu", config=config,
                                                 gate=gate, up=up, scale=scale, scaled_act_out=out)  # fmt: skip

        call()
        ms = timed(call, flush, T)
        row = dict(case=case, variant=name, ms=ms, tflops=2 * M * H * I / ms / 1e9)
        rows.append(row)
        print(f"{label:26s} {name:30s} {ms:8.3f} ms  {row['tflops']:6.1f} TFLOP/s", flush=True)
    del inputs
    torch.cuda.empty_cache()
    return rows


def structure_ab(args, flush) -> list[dict]:
    from moe_lib import problems
    from moe_lib.moe_experts import engine_layer

    spec = importlib.util.spec_from_file_location("moe_lib.moe_experts.engine_layer_before", args.before)
    before = importlib.util.module_from_spec(spec)
    before.__package__ = "moe_lib.moe_experts"
    spec.loader.exec_module(before)
    before.gemm_config = engine_layer.gemm_config  # the same tiles: the structure alone differs
    problem, rows = problems.load("moe_experts_backward_bf16"), []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        inputs = problem.make_inputs(num_tokens, device="cuda")
        first = None
        for name, module in (("before", before), ("now", engine_layer)):
            layer, op = layer_calls(module, inputs)
            result, peak = step_peak(layer)
            first = first or result
            row = dict(tokens=num_tokens, structure=name, layer_peak_gb=peak, same=same_bits(result, first))
            row.update(layer_ms=timed(layer, flush, num_tokens), op_ms=timed(op, flush, num_tokens))
            rows.append(row)
            print(f"T={num_tokens:6d} {name:7s} layer {row['layer_ms']:8.3f} ms  peak {peak:6.2f} GB  op "
                  f"{row['op_ms']:8.3f} ms  same bits {row['same']}", flush=True)  # fmt: skip
            del result, layer, op
        del inputs, first
        torch.cuda.empty_cache()
    return rows


def case_inputs(case: str):
    """(label, the benchmark's inputs) of ``MODEL:TOKENS``: P2's shape for ``P2``, else the model's expert shape."""
    from moe_lib import problems
    from moe_lib.bench import models

    name, tokens = case.rsplit(":", 1)
    axes = {}
    if name != "P2":
        axes = next(m for m in models.MODEL_SHAPES if m.name == name).axes("moe_experts_backward")
    return f"{name} T={tokens}", problems.load("moe_experts_backward_bf16").make_inputs(
        int(tokens), device="cuda", **axes
    )


def step_peak(call) -> tuple[list, float]:
    """(the outputs of one call, cloned; the memory it added at its peak, GB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - allocated) / 1e9
    return [out.clone() for out in result], peak


# engine_layer's switches and grouped_gemm's (GEMM_SWITCHES)
SWITCHES = ("GATHER_IN_LOADS", "GATHER_IN_PARTS", "GATHER_X_IN_WEIGHT_GRADS", "DX_IN_COLUMN_SLICES", "GRADS_OVER_SAVED",
            "SAVED_THROUGH_RING", "X_S_IN_COLUMN_SLICES", "X_AS_A_IN_WEIGHT_GRADS", "X_AS_A_ONE_PRODUCT")  # fmt: skip
GEMM_SWITCHES = ("GATHER_IN_PARTS", "SAVED_THROUGH_RING")
PARTS = {"GATHER_IN_LOADS", "GATHER_IN_PARTS"}  # x's and dy's rows gathered by the loads, in four one-warp parts
NO_X_S = PARTS | {"GATHER_X_IN_WEIGHT_GRADS"}
OVER_SAVED = PARTS | {"GRADS_OVER_SAVED", "SAVED_THROUGH_RING"}  # dswiglu's ring, [dg | du] over the saved g and u
X_AS_A = OVER_SAVED | {"X_S_IN_COLUMN_SLICES", "X_AS_A_IN_WEIGHT_GRADS"}
# each form: its label and the switches of SWITCHES it turns on (the others off)
LOAD_FORMS = (
    ("written", set()),
    ("gathered", {"GATHER_IN_LOADS"}),
    ("in parts", PARTS),
    ("parts, ring", PARTS | {"SAVED_THROUGH_RING"}),
    ("ring, over saved", OVER_SAVED),
    ("over saved, no x_s", OVER_SAVED | {"GATHER_X_IN_WEIGHT_GRADS"}),
    ("over saved, no x_s, dx slices", OVER_SAVED | {"GATHER_X_IN_WEIGHT_GRADS", "DX_IN_COLUMN_SLICES"}),
    ("parts, no x_s", NO_X_S),
    ("+ dx slices", NO_X_S | {"DX_IN_COLUMN_SLICES"}),
    ("over saved, x_s slices", OVER_SAVED | {"X_S_IN_COLUMN_SLICES"}),
    ("over saved, x_s and dx slices", OVER_SAVED | {"X_S_IN_COLUMN_SLICES", "DX_IN_COLUMN_SLICES"}),
    ("over saved, no x_s, x as A", OVER_SAVED | {"GATHER_X_IN_WEIGHT_GRADS", "X_AS_A_IN_WEIGHT_GRADS"}),
    ("over saved, x as A or x_s slices", X_AS_A),
    ("over saved, x as A, one product", X_AS_A | {"X_AS_A_ONE_PRODUCT"}),
)


def switch_module(name: str, engine_layer, grouped_gemm):
    return grouped_gemm if name in GEMM_SWITCHES else engine_layer


LOADS_MODEL_CASES = ("Qwen3-30B-A3B:8192", "Qwen3-30B-A3B:32768", "DeepSeek-V2-Lite:8192", "DeepSeek-V2-Lite:32768")


def set_switches(engine_layer, grouped_gemm, on) -> None:
    """The switches of :data:`SWITCHES` named in ``on`` turned on, the others off."""
    for name in SWITCHES:
        setattr(switch_module(name, engine_layer, grouped_gemm), name, name in on)


def loads_ab(args, flush) -> list[dict]:
    from moe_lib.engine import grouped_gemm
    from moe_lib.moe_experts import engine_layer

    defaults = {name for name in SWITCHES if getattr(switch_module(name, engine_layer, grouped_gemm), name)}
    rows: list[dict] = []
    for case in args.cases.split(","):
        try:
            rows += loads_case(case, engine_layer, grouped_gemm, flush, args.forms, args.rounds)
        except torch.cuda.OutOfMemoryError as exc:  # a case too large for this GPU: said, and the others still run
            print(f"{case}: skipped, out of memory ({str(exc).splitlines()[0][:120]})", flush=True)
            rows.append(dict(case=case, skipped="out of memory"))
        finally:
            set_switches(engine_layer, grouped_gemm, defaults)
            torch.cuda.empty_cache()
    return rows


def loads_case(case: str, engine_layer, grouped_gemm, flush, forms=None, rounds: int = 1) -> list[dict]:
    """:func:`loads_ab`'s rows of one case, a row per form of :data:`LOAD_FORMS` (those named in ``forms``) a round;
    the forms' order reversed every other round (A B, B A, ...), so that a drift over the run favours none; with
    several rounds, each form's median after them."""
    label, inputs = case_inputs(case)
    chosen = [(form, switches) for form, switches in LOAD_FORMS if not forms or form in forms]
    first, rows = None, []
    for round_ in range(rounds):
        for form, switches in chosen if round_ % 2 == 0 else chosen[::-1]:
            set_switches(engine_layer, grouped_gemm, switches)
            layer, op = layer_calls(engine_layer, inputs)
            result, peak = step_peak(layer)
            first = first or result
            row = dict(case=case, form=form, round=round_, layer_peak_gb=peak, same=same_bits(result, first))
            num_tokens = inputs["hidden_states"].shape[0]
            row.update(layer_ms=timed(layer, flush, num_tokens), op_ms=timed(op, flush, num_tokens))
            rows.append(row)
            print(f"{label:26s} {form:15s} layer {row['layer_ms']:8.3f} ms  peak "
                  f"{peak:6.2f} GB  op {row['op_ms']:8.3f} ms  same bits {row['same']}", flush=True)  # fmt: skip
            del result, layer, op
    if rounds > 1:
        for form, _ in chosen:
            mine = [row for row in rows if row["form"] == form]
            layer_ms = statistics.median(row["layer_ms"] for row in mine)
            op_ms = statistics.median(row["op_ms"] for row in mine)
            print(f"{label:26s} {form:15s} median of {rounds}: layer {layer_ms:8.3f} ms  op {op_ms:8.3f} ms",
                  flush=True)  # fmt: skip
    return rows


def form_list(text: str) -> list[str]:
    forms = [form.strip() for form in text.split(";")]
    unknown = [form for form in forms if form not in {row[0] for row in LOAD_FORMS}]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown forms {unknown}; known: {[row[0] for row in LOAD_FORMS]}")
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=("gather", "tiles", "structure", "loads", "kloop"))
    parser.add_argument("--shapes", default="p2_t32768_gate_up,p2_t32768_down,p2_t32768_all,qwen3_t8192_all")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (tiles, structure)")
    parser.add_argument("--variants", default=None, help="tiles: comma-separated variants beside current (all); "
                        "kloop: those of KLOOP_VARIANTS to time (all)")  # fmt: skip
    parser.add_argument("--before", default=None, help="structure: an earlier engine_layer.py")
    parser.add_argument(
        "--cases",
        default=None,
        help="loads, tiles: comma-separated MODEL:TOKENS (P2 for P2's own shape); loads' default: P2's 2048, 8192 and "
        "32768 tokens and the two fine-grained models' 8192 and 32768; tiles': P2 at --tokens",
    )
    parser.add_argument("--forms", type=form_list, help="loads: labels of LOAD_FORMS, separated by ';' (all)")
    parser.add_argument("--rounds", type=int, default=1, help="loads: rounds of the forms, the order reversed each")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory of the JSON ($OUT)")
    args = parser.parse_args()
    if args.run == "structure" and not args.before:
        parser.error("--before: structure needs an earlier engine_layer.py")
    args.tokens = args.tokens or ("2048,8192,32768" if args.run == "structure" else "2048,4096,8192")
    if args.run == "kloop" and not args.cases:
        args.cases = "Qwen3-30B-A3B:32768,DeepSeek-V2-Lite:32768,P2:8192"
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.run == "kloop" and args.variants:
        unknown = [name for name in args.variants.split(",") if name not in KLOOP_VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown {unknown}; the kloop variants are {list(KLOOP_VARIANTS)}")
    if args.run == "loads" and not args.cases:
        args.cases = ",".join([*(f"P2:{t}" for t in (2048, 8192)), *LOADS_MODEL_CASES, "P2:32768"])
    if args.cases:
        from moe_lib.bench import models

        known = {m.name for m in models.MODEL_SHAPES if m.axes("moe_experts_backward").get("num_experts")} | {"P2"}
        for case in args.cases.split(","):
            name, _, tokens = case.rpartition(":")
            if name not in known or not tokens.isdigit() or int(tokens) < 1:
                parser.error(f"--cases: expected MODEL:TOKENS, MODEL P2 or a model with experts, got {case!r}")
    from moe_lib.bench.timing import L2Flusher

    flush = L2Flusher(torch.device("cuda"))
    runs = {"gather": gather_ab, "tiles": tiles_ab, "structure": structure_ab, "loads": loads_ab, "kloop": kloop_ab}
    rows = runs[args.run](args, flush)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"engine_ab_{args.run}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
