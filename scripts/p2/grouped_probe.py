"""Issue 48's grouped engine probe: the Gluon grouped GEMM (``moe_lib/engine/grouped_gemm.py``) against
torch._grouped_mm at P2's, Qwen3-30B-A3B's and Mixtral's expert shapes.

    PYTHONPATH=. python scripts/p2/grouped_probe.py [--configs A,B] [--shapes X,Y] [--timeout 200] [--stall 60]
        [--budget 480] [--reps 20] [--seed S] [--out DIR]
    PYTHONPATH=. python scripts/p2/grouped_probe.py --compile-only [--configs ...] [--out DIR]

Shapes (:data:`SHAPES`): T tokens routed uniformly at random to K of E experts (each token K distinct experts, the
rows sorted by expert: M_total = T·K rows, an expert's count binomial around T·K/E), in the products a MoE layer
needs: ``gate_up`` x·[Wg;Wu]ᵀ (B [E, 2I, H] held transposed, N = 2I), ``down`` a·Wdᵀ (B [E, H, I] held transposed,
N = H), ``dap`` dy·Wd (B [E, H, I] as it lies, N = I) and ``dx`` [dg|du]·[Wg;Wu] (B [E, 2I, H] as it lies, N = H);
``down_scaled`` is ``down`` with the routing weight per row (the ``row_scale`` epilogue) and ``swiglu`` is
``gate_up`` with silu(gate)·up in its epilogue (C [T·K, I]). With the layer's weights as separate tensors (B a
pair, form ``nt2``/``nn2``): ``swiglu_agu`` x·(Wg, Wu) writing a = silu(g)·u, g and u (the forward keeping its
pre-activations), ``swiglu_gu`` writing g and u (the backward recomputing them), ``dx_pair`` [dg|du]·(Wg, Wu) along
K and ``dx_pair_f32`` with an fp32 output; and ``dswiglu``, dy·Wd with the backward's epilogue (the saved g and u
in, dg, du, w·a and the routing weight's row sums out), ``dswiglu_saved`` the same reading the saved σ and silu too
(P1's definition). g and u, dg and du are column halves of one tensor each, as
the layer keeps them. The baseline is torch._grouped_mm, one call a weight, then the epilogue in torch (its outputs
its own allocations, no copy timed; A's halves for ``dx_pair`` copied beforehand). ``--shapes new``: those five.
Models: P2 (E 256, K 8, H 4096, I 2048) at 8192 and 32768 tokens, Qwen3-30B-A3B (E 128, K 8, H 2048, I 768) at
8192, Mixtral (E 8, K 2, H 4096, I 14336) at 4096; the fused and paired products at P2's 8192 tokens and Mixtral's.

Configs (:data:`CONFIGS`): where an epilogue does not fit one (dswiglu: shared memory for its saved tiles and
outputs, registers for its elementwise work), :data:`FITTED` names the config run in its place; dswiglu reading the
saved σ and silu takes that config with as many stages as fit beside its four saved tiles (:func:`config_for`).
The ``quack_*`` configs (:data:`QUACK`) are the other engine, QuACK's Hopper GEMM, on the plain products only: its
package from SonicMoE's site on PYTHONPATH (``scripts/gpu_bench.sh`` says where); it compiles on its first call
(minutes where it autotunes: raise ``--stall``).

On a GPU: first every config compiled for sm_90 on the host (as ``--compile-only``; a config that fails is left
out), then torch._grouped_mm and each config in a child process of its own, killed when it has finished no shape
for ``--stall`` seconds, when it has run ``--timeout`` seconds, or when the run's ``--budget`` is spent. Per shape,
small ones first: fresh random operands and routing (the seed's), the outputs poisoned with NaN, one call checked
output by output against an fp32 per-expert torch.mm (relative Frobenius error ≤ 1e-2, no NaN; topk_partial summed
over its column tiles), then timed by CUDA-graph replay with the L2 flushed before each replay, the replays' outputs
checked bitwise against the first call's. Logs and ``grouped_probe.json`` go to --out ($OUT by default); one table
(shape × config: TFLOP/s of the product and the fraction of torch._grouped_mm's) is printed last, with the geometric
mean over the shapes.

--compile-only (no GPU: triton's ptxas and cuobjdump): each config in each variant of the shapes (B's form, the
epilogue, the outputs written), compiled for sm_90: registers at launch and after setmaxnreg per partition, stack
(a spill), shared memory, output buffers a consumer, wgmma per K step and whether ptxas serialised them; exits 1
where one fails, spills, is over 227 KB or is serialised.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the dense probe's child watch and helpers

import gemm_probe  # noqa: E402

from moe_lib.engine.gluon_gemm import GemmConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "grouped_mm"
TOLERANCE = 1e-2  # relative Frobenius error against fp32 per-expert torch.mm (bf16 output rounding alone ~2e-3)

# the dense probe's best configs at large and at small M, as grouped kernels
CONFIGS = {
    "coop_m128n256k64_s3": GemmConfig(128, 256, 64, 3, "cooperative"),
    "coop_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "cooperative"),
    "pp_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "pingpong"),
}


@dataclass(frozen=True)
class QuackConfig:
    """QuACK's Hopper GEMM (``quack.gemm_interface``, the CuTe DSL engine SonicMoE builds on) as a column of the
    probe, on the plain products only (varlen M by the expert offsets, no epilogue): ``tuned``, its autotuner over
    its own configurations at each shape (all compiled first, in QUACK_COMPILE_WORKERS processes); else the one
    tile, cluster of CTAs and consumer form given."""

    tuned: bool = False
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True


# the other engine of deliverable 1; its package comes with SonicMoE's site (scripts/gpu_bench.sh unpacks it)
QUACK = {
    "quack_tuned": QuackConfig(tuned=True),
    "quack_default": QuackConfig(),  # QuACK's own sm_90 default: ping-pong 128 × 192, clusters of 2 along M
    "quack_coop_m128n256": QuackConfig(tile_m=128, tile_n=256, pingpong=False),
}
# where an epilogue does not fit a config, the config in its place: dswiglu keeps its saved g and u and writes three
# outputs through at least two output tiles a consumer, and its epilogue's registers hold a 64-column half of a
# 128 × 128 accumulator a warpgroup at most (grouped_gemm.output_buffers; notes/p2/engine-grouped.md)
FITTED = {
    ("coop_m128n256k64_s3", "dswiglu"): GemmConfig(128, 128, 64, 4, "cooperative"),  # three 128 × 128 output tiles
    ("pp_m128n128k64_s5", "dswiglu"): GemmConfig(64, 128, 64, 6, "pingpong"),  # 64-row tiles, two a consumer
}


@dataclass(frozen=True)
class Shape:
    """One grouped product: T tokens, K of E experts each, P [T·K, n] = A [T·K, k] · B_e, then the epilogue."""

    tokens: int
    experts: int
    top_k: int
    n: int
    k: int
    b_t: bool  # B [E, n, k] (held transposed) rather than [E, k, n]
    epilogue: str
    what: str
    pair: bool = False  # B as two weights: swiglu's (gate, up) [E, n/2, k] each, or (B₀, B₁) [E, k/2, n] along K
    outputs: tuple[str, ...] = ("out",)  # what the kernel writes (grouped_gemm's keyword names)
    out_f32: bool = False  # C in fp32 (the none epilogue)
    saved_activations: bool = False  # dswiglu: the saved σ and silu read too, in place of σ(g) and silu(g)

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def width(self) -> int:
        """The outputs' columns: n, or half of it with swiglu (B's rows are gate and up)."""
        return self.n // 2 if self.epilogue == "swiglu" else self.n

    @property
    def form(self) -> str:
        """ "nt" (B held transposed) or "nn", with "2" for a pair of weights."""
        return ("nt" if self.b_t else "nn") + ("2" if self.pair else "")

    @property
    def variant(self) -> tuple:
        """What its kernel is compiled for: B's form, the epilogue, the outputs written, C's dtype (and, where read,
        the saved σ and silu)."""
        return (self.form, self.epilogue, self.outputs, self.out_f32) + (("saved σ, silu",) * self.saved_activations)

    @property
    def flop(self) -> int:
        return 2 * self.rows * self.n * self.k


SWIGLU_OUTPUTS = ("out", "gate_out", "up_out")
# the outputs as the compile table prints them
SHORT = dict(
    out="out", gate_out="g", up_out="u", dgate_out="dg", dup_out="du", scaled_act_out="aw", topk_partial="part"
)
DSWIGLU_OUTPUTS = ("dgate_out", "dup_out", "scaled_act_out", "topk_partial")


def model_shapes(name: str, T: int, E: int, K: int, H: int, I: int, fused: bool = False) -> dict[str, Shape]:
    """A model's four grouped products at T tokens (and, where ``fused``, those with an epilogue and with the
    layer's weights as separate tensors: the forward's and the backward's products as the layer needs them)."""
    shapes = {
        f"{name}_gate_up": Shape(T, E, K, 2 * I, H, True, "none", "x·[Wg;Wu]ᵀ"),
        f"{name}_down": Shape(T, E, K, H, I, True, "none", "a·Wdᵀ"),
        f"{name}_dap": Shape(T, E, K, I, H, False, "none", "dy·Wd"),
        f"{name}_dx": Shape(T, E, K, H, 2 * I, False, "none", "[dg|du]·[Wg;Wu]"),
    }
    if fused:
        shapes[f"{name}_down_scaled"] = Shape(T, E, K, H, I, True, "row_scale", "(a·Wdᵀ)·w")
        shapes[f"{name}_swiglu"] = Shape(T, E, K, 2 * I, H, True, "swiglu", "silu(x·Wgᵀ)·(x·Wuᵀ)")
        shapes[f"{name}_swiglu_agu"] = Shape(
            T, E, K, 2 * I, H, True, "swiglu", "a, g, u from x, (Wg, Wu)", True, SWIGLU_OUTPUTS
        )
        shapes[f"{name}_swiglu_gu"] = Shape(
            T, E, K, 2 * I, H, True, "swiglu", "g, u from x, (Wg, Wu)", True, ("gate_out", "up_out")
        )
        shapes[f"{name}_dswiglu"] = Shape(
            T, E, K, I, H, False, "dswiglu", "dy·Wd → dg, du, w·a, Σ dA'·a", outputs=DSWIGLU_OUTPUTS
        )
        shapes[f"{name}_dswiglu_saved"] = Shape(
            T,
            E,
            K,
            I,
            H,
            False,
            "dswiglu",
            "dy·Wd, saved σ, silu → dg, du, w·a, Σ dA'·a",
            outputs=DSWIGLU_OUTPUTS,
            saved_activations=True,
        )
        shapes[f"{name}_dx_pair"] = Shape(T, E, K, H, 2 * I, False, "none", "dg·Wg + du·Wu", True)
        shapes[f"{name}_dx_pair_f32"] = Shape(
            T, E, K, H, 2 * I, False, "none", "dg·Wg + du·Wu in fp32", True, out_f32=True
        )
    return shapes


SHAPES = {
    **model_shapes("p2_t8192", 8192, 256, 8, 4096, 2048, fused=True),
    **model_shapes("p2_t32768", 32768, 256, 8, 4096, 2048),
    **model_shapes("qwen3_t8192", 8192, 128, 8, 2048, 768),
    **model_shapes("mixtral_t4096", 4096, 8, 2, 4096, 14336, fused=True),
}

NEW = [name for name, shape in SHAPES.items() if shape.pair or shape.epilogue == "dswiglu"]  # --shapes new


def config_for(name: str, epilogue: str, saved_activations: bool = False) -> GemmConfig:
    """The config ``name`` runs ``epilogue`` with: itself, or where the epilogue does not fit it (:data:`FITTED`)
    the one in its place; dswiglu reading the saved σ and silu, that with as many stages as fit beside its four
    saved tiles a consumer."""
    from moe_lib.engine.grouped_gemm import least_buffers, stages_that_fit

    config = FITTED.get((name, epilogue), CONFIGS[name])
    if saved_activations:
        config = stages_that_fit(config, epilogue, least_buffers(epilogue, 3, saved=True))
    return config


def kernel_tensors(shape: Shape, config: GemmConfig, make) -> tuple:
    """(a, b, grouped_gemm's keyword tensors) for ``shape``, each made by ``make(role, size, dtype)`` (role "a",
    "weight", "scale", "saved" or "output"): b a pair where the shape's weights are two; the saved g and u, and
    swiglu's gate_out and up_out and dswiglu's dgate_out and dup_out, column halves of one [rows, 2·width] tensor
    each (as the layer keeps h = [g|u] and dh = [dg|du], the dx product's A); the saved σ and silu, where read, the
    third and fourth quarters of g and u's [rows, 4·width]."""
    import torch

    from moe_lib.engine.grouped_gemm import partial_rows

    bf16, fp32 = torch.bfloat16, torch.float32
    rows, width, E = shape.rows, shape.width, shape.experts
    a = make("a", (rows, shape.k), bf16)
    if shape.pair:
        size = (E, width, shape.k) if shape.epilogue == "swiglu" else (E, shape.k // 2, shape.n)
        b = (make("weight", size, bf16), make("weight", size, bf16))
    else:
        b = make("weight", (E, shape.n, shape.k) if shape.b_t else (E, shape.k, shape.n), bf16)
    tensors = {}
    if shape.epilogue in ("row_scale", "dswiglu"):
        tensors["scale"] = make("scale", (rows,), fp32)
    if shape.epilogue == "dswiglu":
        kept = 4 if shape.saved_activations else 2  # g, u (and σ, silu)
        saved = make("saved", (rows, kept * width), bf16)
        tensors.update(gate=saved[:, :width], up=saved[:, width : 2 * width])
        if shape.saved_activations:
            tensors.update(gate_sigmoid=saved[:, 2 * width : 3 * width], gate_silu=saved[:, 3 * width :])
    halves = make("output", (rows, 2 * width), bf16) if {"gate_out", "dgate_out"} & set(shape.outputs) else None
    for name in shape.outputs:
        if name in ("gate_out", "dgate_out", "up_out", "dup_out"):
            tensors[name] = halves[:, :width] if name in ("gate_out", "dgate_out") else halves[:, width:]
        elif name == "topk_partial":
            tensors[name] = make("output", (partial_rows(width, config), rows), fp32)
        else:
            tensors[name] = make("output", (rows, width), fp32 if shape.out_f32 else bf16)
    return a, b, tensors


# --- compiling for sm_90 on the host ----------------------------------------------------------------------------


def compile_report(config: GemmConfig, shape: Shape) -> dict:
    """``config``'s kernel for ``shape``'s variant (B's form, epilogue, outputs) compiled for sm_90."""
    import torch

    from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, resource_usage, wgmma_serialized
    from moe_lib.engine.grouped_gemm import grouped_gemm_kernel, launch_arguments

    def meta(role, size, dtype):
        return torch.empty(size, dtype=dtype, device="meta")

    a, b, tensors = kernel_tensors(shape, config, meta)
    offsets = torch.empty(shape.experts + 1, dtype=torch.int32, device="meta")
    arguments, constexprs = launch_arguments(config, a, b, offsets, shape.epilogue, shape.b_t, **tensors)
    # the pointers and the scalar as the launcher specialises them
    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
    arguments = {
        name: pointer[value.dtype] if isinstance(value, torch.Tensor) else value for name, value in arguments.items()
    }
    arguments["num_experts"] = "i32"
    start = time.perf_counter()
    try:
        compiled = compile_gluon_for_sm90(
            grouped_gemm_kernel, arguments, constexprs, warps=config.warps, maxnreg=config.maxnreg
        )
    except Exception as exc:  # reported; the config is left out of the GPU run
        return dict(error=first_error_line(exc))
    ptx = compiled.asm["ptx"]
    partitions = sorted({int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return dict(
        resource_usage(compiled),
        partition_registers=partitions,
        wgmma=ptx.count("wgmma.mma_async"),
        serialized=wgmma_serialized(compiled),
        output_buffers=constexprs["OUT_BUFS"],
        seconds=round(time.perf_counter() - start, 2),
        error=None,
    )


def tile_name(config: GemmConfig) -> str:
    """A config's tiles and ring as the config names spell them: m128n128k64_s4."""
    mode = "pp" if config.pingpong else "coop"
    return f"{mode}_m{config.block_m}n{config.block_n}k{config.block_k}_s{config.stages}"


def compile_all(config_names: list[str], shape_names: list[str]) -> list[dict]:
    """Each config in each variant of the shapes (B's form, epilogue, outputs), compiled once (printing a line
    each; where an epilogue takes another config, its tiles after an arrow)."""
    variants = {}
    for name in shape_names:
        variants.setdefault(SHAPES[name].variant, SHAPES[name])
    rows = []
    print(
        f"{'config':42s} form epilogue  outputs        launch  setmaxnreg      stack  smem  bufs  wgmma  serialised  s",
        flush=True,
    )
    for config_name in config_names:
        if config_name in QUACK:
            print(f"{config_name:42s} QuACK's: compiled on the GPU, by its own JIT", flush=True)
            continue
        for shape in variants.values():
            config = config_for(config_name, shape.epilogue, shape.saved_activations)
            label = config_name if config == CONFIGS[config_name] else f"{config_name} → {tile_name(config)}"
            outputs = ",".join(SHORT[name] for name in shape.outputs) + (" fp32" if shape.out_f32 else "")
            outputs += " ←σ,silu" if shape.saved_activations else ""
            report = compile_report(config, shape)
            row = dict(
                config=config_name,
                runs=tile_name(config),
                form=shape.form,
                epilogue=shape.epilogue,
                outputs=outputs,
                **report,
            )
            row["problems"] = gemm_probe.compile_problems(row)
            rows.append(row)
            head = f"{label:42s} {shape.form:4s} {shape.epilogue:9s} {outputs:14s}"
            if report["error"]:
                print(f"{head} FAIL {report['error']}", flush=True)
                continue
            parts = "/".join(map(str, row["partition_registers"]))
            print(
                f"{head} {row['registers']:6d}  {parts:14s}  {row['stack']:5d}  {row['shared'] // 1024:3d}K  "
                f"{row['output_buffers']:4d}  {row['wgmma']:5d}  {row['serialized']:10s}  {row['seconds']:.1f}"
                + (f"  PROBLEM: {'; '.join(row['problems'])}" if row["problems"] else ""),
                flush=True,
            )
    return rows


# --- one config's shapes on the GPU (a child process) -------------------------------------------------------------


def routed_offsets(shape: Shape, generator, device):
    """Each token's K distinct experts drawn uniformly: (offsets int32 [E + 1] of the rows sorted by expert, and
    the per-row routing weights [T·K] fp32)."""
    import torch

    choice = torch.rand((shape.tokens, shape.experts), generator=generator, device=device).topk(shape.top_k).indices
    counts = torch.bincount(choice.flatten(), minlength=shape.experts)
    offsets = torch.zeros(shape.experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0)
    weights = torch.rand(shape.rows, generator=generator, device=device)
    return offsets, weights


def random_maker(shape: Shape, generator, device, weights):
    """``make`` for :func:`kernel_tensors` on the GPU: inputs N(0, 1) in bf16 (a weight [E, ·, k_in] scaled by
    1/√k_in, the saved g and u by 2: across silu's bend), the routing ``weights`` as the scale, outputs NaN."""
    import torch

    def make(role, size, dtype):
        if role == "output":
            return torch.full(size, float("nan"), dtype=dtype, device=device)
        if role == "scale":
            return weights
        x = torch.randn(size, generator=generator, device=device)
        if role == "weight":  # [E, n, k] held transposed, else [E, k, n]
            x = x * (size[2] if shape.b_t else size[1]) ** -0.5
        if role == "saved":
            x = x * 2.0
        return x.to(dtype)

    return make


def per_expert(a, w, offsets, b_t: bool):
    """A[r] · B_e in fp32 by a torch.mm per expert (one host sync for the offsets: outside the timed part)."""
    import torch

    out = torch.zeros((a.shape[0], w.shape[1] if b_t else w.shape[2]), dtype=torch.float32, device=a.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        begin, end = bounds[e], bounds[e + 1]
        if end > begin:
            m = w[e].float()
            out[begin:end] = a[begin:end].float() @ (m.t() if b_t else m)
    return out


def reference(shape: Shape, a, b, offsets, tensors) -> dict:
    """Each output of ``shape`` in fp32 (topk_partial as its sum over the column tiles, a row's ⟨dAp, a⟩)."""
    import torch

    if shape.pair and shape.epilogue == "swiglu":
        g, u = per_expert(a, b[0], offsets, True), per_expert(a, b[1], offsets, True)
        return {"out": torch.nn.functional.silu(g) * u, "gate_out": g, "up_out": u}
    if shape.pair:
        half = shape.k // 2
        return {"out": per_expert(a[:, :half], b[0], offsets, False) + per_expert(a[:, half:], b[1], offsets, False)}
    product = per_expert(a, b, offsets, shape.b_t)
    if shape.epilogue == "swiglu":
        return {"out": torch.nn.functional.silu(product[:, : shape.width]) * product[:, shape.width :]}
    if shape.epilogue == "row_scale":
        return {"out": product * tensors["scale"][:, None]}
    if shape.epilogue == "dswiglu":
        return dswiglu_torch(product, tensors, torch.float32)
    return {"out": product}


def dswiglu_torch(dap, tensors: dict, dtype) -> dict:
    """dswiglu's outputs from dAp and its keyword ``tensors`` (the saved g, u, the routing weights, and where given
    the saved σ and silu, read in place of σ(g) and silu(g)), in fp32, each then in ``dtype`` (topk_partial as
    [1, rows]: its sum over the column tiles)."""
    import torch

    g, u, w = tensors["gate"].float(), tensors["up"].float(), tensors["scale"][:, None]
    given = tensors.get("gate_sigmoid") is not None
    sigmoid = tensors["gate_sigmoid"].float() if given else torch.sigmoid(g)
    silu = tensors["gate_silu"].float() if given else g * sigmoid
    act = silu * u
    dA = dap.float() * w
    return {
        "dgate_out": (dA * u * sigmoid * (1 + g * (1 - sigmoid))).to(dtype),
        "dup_out": (dA * silu).to(dtype),
        "scaled_act_out": (act * w).to(dtype),
        "topk_partial": (dap.float() * act).sum(1)[None],
    }


def grouped_mm_operand(a, w, ends, b_t: bool):
    """A weight as torch._grouped_mm takes it ([E, k, n], a transposed view where it is held [E, n, k]), and a note
    where it refused that layout and took a column-major copy made here, outside the timed call (as weights kept
    so)."""
    import torch

    b_mm = w.transpose(1, 2) if b_t else w
    try:
        torch._grouped_mm(a, b_mm, offs=ends)
    except RuntimeError as exc:
        copy = b_mm.transpose(1, 2).contiguous().transpose(1, 2)
        return copy, f"B copied column-major beforehand ({str(exc).splitlines()[0][:120]})"
    return b_mm, None


def baseline_call(shape: Shape, a, b, offsets, tensors):
    """(torch's call for ``shape``: torch._grouped_mm, a product a weight, then the epilogue in torch, returning its
    outputs by name; a note on what was prepared beforehand, or None)."""
    import torch

    ends = offsets[1:]  # torch._grouped_mm's offs: each group's end row
    if shape.pair and shape.epilogue == "swiglu":
        (wg, gate_note), (wu, _) = (grouped_mm_operand(a, w, ends, True) for w in b)

        def call():
            g, u = torch._grouped_mm(a, wg, offs=ends), torch._grouped_mm(a, wu, offs=ends)
            outputs = {"gate_out": g, "up_out": u}
            if "out" in shape.outputs:
                outputs["out"] = torch.nn.functional.silu(g) * u
            return outputs

        return call, gate_note
    if shape.pair:  # A's halves (copied beforehand: _grouped_mm takes them contiguous) times each weight, summed
        half = shape.k // 2
        left, right = a[:, :half].contiguous(), a[:, half:].contiguous()
        (w0, note), (w1, _) = (grouped_mm_operand(left, w, ends, False) for w in b)

        def call():
            first, second = torch._grouped_mm(left, w0, offs=ends), torch._grouped_mm(right, w1, offs=ends)
            return {"out": first.float() + second.float() if shape.out_f32 else first + second}

        return call, note
    b_mm, note = grouped_mm_operand(a, b, ends, shape.b_t)

    def call():
        result = torch._grouped_mm(a, b_mm, offs=ends)
        if shape.epilogue == "swiglu":
            return {"out": torch.nn.functional.silu(result[:, : shape.width]) * result[:, shape.width :]}
        if shape.epilogue == "row_scale":
            return {"out": result * tensors["scale"][:, None]}
        if shape.epilogue == "dswiglu":
            return dswiglu_torch(result, tensors, torch.bfloat16)
        return {"out": result}

    return call, note


def quack_call(name: str, shape: Shape, a, b, offsets, out):
    """QuACK's grouped product for a plain ``shape`` into ``out`` (None where the shape is not plain): varlen M by
    the expert offsets, B as [E, k, n] (a transposed view where it is held [E, n, k])."""
    if shape.epilogue != "none" or shape.pair or shape.out_f32:
        return None
    from quack.gemm_config import GemmConfig as QuackGemmConfig
    from quack.gemm_interface import gemm, gemm_tuned

    chosen = QUACK[name]
    b_kn = b.transpose(1, 2) if shape.b_t else b
    if chosen.tuned:
        return lambda: {"out": gemm(a, b_kn, out=out, cu_seqlens_m=offsets, tuned=True)}
    tiles = {key: value for key, value in asdict(chosen).items() if key != "tuned"}  # QuACK's own field names
    config = QuackGemmConfig(**tiles, is_dynamic_persistent=False)

    def call():
        gemm_tuned.fn(a, b_kn, out, cu_seqlens_m=offsets, config=config)
        return {"out": out}

    return call


def run_child(name: str, shape_names: list[str], reps: int, seed: int) -> None:
    """Checks and times ``name`` (a config or the baseline) at each shape, small ones first, printing a RESULT line
    as each shape starts and one as it ends."""
    import torch

    from moe_lib.bench.timing import L2Flusher, time_graph
    from moe_lib.engine.grouped_gemm import grouped_gemm

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    flush = L2Flusher(device)

    for shape_name in sorted(shape_names, key=lambda s: SHAPES[s].flop):
        shape = SHAPES[shape_name]
        gemm_probe.emit(event="start", shape=shape_name)
        generator = torch.Generator(device=device).manual_seed(seed)  # every child the same operands a shape
        try:
            offsets, weights = routed_offsets(shape, generator, device)
            ours = name not in (BASELINE, *QUACK)
            config = config_for(name, shape.epilogue, shape.saved_activations) if ours else CONFIGS[next(iter(CONFIGS))]
            a, b, tensors = kernel_tensors(shape, config, random_maker(shape, generator, device, weights))
            expected = reference(shape, a, b, offsets, tensors)
            note = None
            if name == BASELINE:
                call, note = baseline_call(shape, a, b, offsets, tensors)
            elif name in QUACK:
                call = quack_call(name, shape, a, b, offsets, tensors.get("out"))
                if call is None:
                    gemm_probe.emit(event="result", shape=shape_name, check="not run: QuACK's plain products only")
                    continue
            else:
                written = {key: tensors[key] for key in shape.outputs}

                def call():
                    """The outputs (allocated before: the kernel writes them in place)."""
                    grouped_gemm(
                        a, b, offsets, epilogue=shape.epilogue, b_transposed=shape.b_t, config=config, **tensors
                    )
                    return written

            row = check_and_time(shape, call, expected, flush, reps, time_graph)
            if note:
                row["note"] = note
            if ours and config != CONFIGS[name]:
                row["note"] = f"{shape.epilogue} runs as {tile_name(config)}"
        except Exception as exc:  # reported; a CUDA error leaves the context unusable and the next shapes fail too
            row = dict(check=f"ERROR: {type(exc).__name__}: {str(exc)[-300:]}")
        gemm_probe.emit(event="result", shape=shape_name, **row)


def output_error(name: str, result, expected) -> float:
    """Relative error of one output (topk_partial: its sum over the column tiles, each row's ⟨dAp, a⟩)."""
    if name == "topk_partial":
        result = result.sum(0)
        expected = expected.sum(0)
    return gemm_probe.relative_error(result, expected)


def check_and_time(shape: Shape, call, expected: dict, flush, reps: int, time_graph) -> dict:
    """One shape: a first call (into NaN-poisoned outputs) checked against ``expected`` output by output, then
    CUDA-graph replays timed (the L2 flushed before each), the replays' outputs checked against the first call's
    bit for bit."""
    import torch

    start = time.perf_counter()
    outputs = call()
    torch.cuda.synchronize()
    row = dict(first_call_s=round(time.perf_counter() - start, 3))
    errors = {key: output_error(key, outputs[key], expected[key]) for key in shape.outputs}
    row["rel_error"] = error = max(errors.values())
    if len(errors) > 1:
        row["rel_errors"] = errors
    if not error <= TOLERANCE:
        nan = any(bool(outputs[key].isnan().any()) for key in shape.outputs)
        return dict(row, check=f"WRONG: relative error {error:.3g} (NaN: {nan})")
    first = {key: outputs[key].clone() for key in shape.outputs}
    for key in shape.outputs:
        outputs[key].fill_(float("nan"))

    def replays_wrong(replayed):
        same = all(torch.equal(replayed[key], first[key]) for key in shape.outputs)
        return None if same else "replays differ from the first call"

    stats = time_graph(call, flush, reps=reps, check_replay=replays_wrong)
    check = "ok" if stats["replay_wrong"] is None else f"WRONG: {stats['replay_wrong']}"
    return dict(
        row,
        check=check,
        tflops=shape.flop / (stats["median_ms"] * 1e-3) / 1e12,
        **{key: stats[key] for key in ("median_ms", "p20_ms", "p80_ms", "reps")},
    )


# --- the parent: the table (gemm_probe.drive runs and watches the children) -------------------------------------------


def table(runs: dict, shape_names: list[str]) -> str:
    """shape × (torch._grouped_mm, each config as c1, c2, ...): TFLOP/s and the fraction of the baseline's; the
    geometric mean fraction over the shapes last."""
    columns = list(runs)
    labels = {name: "gmm" if name == BASELINE else f"c{i}" for i, name in enumerate(columns)}
    lines = [f"{labels[name]} = {name}" for name in columns if name != BASELINE]
    lines.append(f"{'shape':26s} {'rows×N×K':20s} " + " ".join(f"{labels[c]:>9s}" for c in columns))
    baselines = runs.get(BASELINE, {}).get("results", {})
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        base = baselines.get(shape_name)
        cells = [gemm_probe.cell(runs[c]["results"].get(shape_name), None if c == BASELINE else base) for c in columns]
        size = f"{shape.rows}×{shape.n}×{shape.k}"
        lines.append(f"{shape_name:26s} {size:20s} " + " ".join(f"{c:>9s}" for c in cells))
    means = [gemm_probe.geomean_fraction(runs, column, shape_names, baselines) for column in columns]
    lines.append(f"{'geomean':47s} " + " ".join(f"{m:>9s}" for m in means))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="configs: " + ", ".join([*CONFIGS, *QUACK]) + "\nshapes: " + ", ".join(SHAPES),
    )
    parser.add_argument("--configs", default="all", help="comma list of configs (grouped_mm always runs), or all")
    parser.add_argument("--shapes", default="all", help="comma list of shapes, all, or new (pairs and dswiglu)")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90, no GPU")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds one config's child may run")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds a child may go without finishing a shape")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds the whole run may take")
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays a shape")
    parser.add_argument("--seed", type=int, default=None, help="the operands' and routing's seed (fresh by default)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory of the logs and JSON ($OUT)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shapes == "new":
        args.shapes = ",".join(NEW)
    gemm_probe.drive(
        args,
        parser,
        program="grouped_probe",
        baseline=BASELINE,
        peer="torch._grouped_mm",
        shapes=SHAPES,
        configs={**CONFIGS, **QUACK},
        compile_all=compile_all,
        run_child=run_child,
        script=Path(__file__).resolve(),
        table=table,
        name_width=22,
    )


if __name__ == "__main__":
    main()
