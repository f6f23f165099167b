"""The grouped GEMM with A gathered (``moe_lib/engine/grouped_gemm.py``, ``grouped_tl.py``: A's row r is
source[index[r]], read by the loads): its checks name the argument, the tl twin under the interpreter gives the bits of
the same A written out and float64's values within bf16, the Gluon kernel builds for sm_90 without spilling, and on a
Hopper GPU (``gpu``) the Gluon kernel gives, bit for bit, what it gives for the A written out, in each epilogue the
MoE layer gathers for."""

import pytest
import torch
from child_env import compile_env

from moe_lib.engine.gathered import Gathered
from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.engine.grouped_gemm import (
    DSWIGLU_CONFIG,
    RING_DSWIGLU_CONFIG,
    check_arguments,
    default_config,
    grouped_gemm,
    partial_rows,
)
from moe_lib.engine.grouped_tl import grouped_gemm_tl

from .test_grouped_gemm import gpu_per_expert, offsets_of, per_expert, within_bf16

SMALL = GemmConfig(64, 64, 32, 2, "pingpong", group_m=2)
RAGGED = {"empty_one_ragged": [0, 1, 70, 130], "all_in_one": [0, 0, 197, 0]}


def bf16_randn(*size, generator, scale=1.0, device="cpu"):
    return (torch.randn(size, generator=generator, device=device) * scale).to(torch.bfloat16)


def routed(num_tokens, columns, rows, generator, device="cpu"):
    """Gathered(source, index): a source of ``num_tokens`` rows that is a column view of a wider tensor (its rows
    further apart than its width), an index drawing each of ``rows`` rows from any token (repeats included)."""
    wide = bf16_randn(num_tokens, columns + 8, generator=generator, device=device)
    index = torch.randint(0, num_tokens, (rows,), generator=generator, device=device, dtype=torch.int32)
    return Gathered(wide[:, :columns], index)


def nan(rows, cols, device="cpu", dtype=torch.bfloat16):
    return torch.full((rows, cols), float("nan"), dtype=dtype, device=device)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


# --- the checks -------------------------------------------------------------------------------------------------


CHECKS = [
    (Gathered(meta(10, 64), meta(32, dtype=torch.int64)), TypeError, "a.index: expected torch.int32", "int64_index"),
    (Gathered(meta(10, 64), meta(32, 1, dtype=torch.int32)), ValueError, "a.index: expected a contiguous 1-D", "2d"),
    (Gathered(meta(10, 2, 32), meta(32, dtype=torch.int32)), ValueError, "a.source: expected a 2-D tensor", "3d"),
    (Gathered(meta(10, 128)[:, ::2], meta(32, dtype=torch.int32)), ValueError, "a.source: expected rows", "strided"),
    (Gathered(meta(10, 68)[:, :64], meta(32, dtype=torch.int32)), ValueError, "a.source: expected rows", "row_gap"),
    (
        Gathered(meta(10, 64, dtype=torch.float32), meta(32, dtype=torch.int32)),
        TypeError,
        "a: expected torch.bf",
        "f32",
    ),
    (Gathered(meta(10, 40), meta(32, dtype=torch.int32)), ValueError, "b: expected [E, N, K] or [E, K, N]", "k"),
]


@pytest.mark.parametrize(("a", "error", "message"), [c[:3] for c in CHECKS], ids=[c[3] for c in CHECKS])
def test_a_gathered_is_checked_naming_the_argument(a, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_arguments(a, meta(4, 48, 64), meta(5, dtype=torch.int32))


def test_a_gathered_passes_the_checks_with_rows_apart_by_16_byte_multiples():
    source = meta(10, 72)[:, :64]  # a column view, rows 144 bytes apart
    assert check_arguments(Gathered(source, meta(32, dtype=torch.int32)), meta(4, 48, 64), meta(5, dtype=torch.int32))


# --- the tl twin under the interpreter ----------------------------------------------------------------------------


@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
@pytest.mark.parametrize("epilogue", ["row_scale", "swiglu"])
def test_tl_gathered_a_gives_the_bits_of_the_a_written_out(counts, epilogue, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    E, M, N, K = len(counts), int(offsets[-1]), 40, 88
    a = routed(37, K, M, generator)
    b = bf16_randn(E, 2 * N if epilogue == "swiglu" else N, K, generator=generator, scale=K**-0.5)
    scale = torch.rand(M, generator=generator) + 0.5 if epilogue == "row_scale" else None
    outs = [nan(M, N), nan(M, N)]
    for x, out in zip((a, a.materialise()), outs, strict=True):
        grouped_gemm_tl(x, b, offsets, out=out, scale=scale, epilogue=epilogue, config=SMALL, programs=3)
    assert torch.equal(outs[0], outs[1])
    product = per_expert(a.materialise(), b, offsets, True)
    if epilogue == "swiglu":
        expected = torch.nn.functional.silu(product[:, :N]) * product[:, N:]
    else:
        expected = product * scale.double()[:, None]
    assert within_bf16(outs[0], expected)


@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
def test_tl_dswiglu_with_dy_gathered_gives_the_bits_of_dy_written_out(counts, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    E, M, H, I = len(counts), int(offsets[-1]), 64, 80
    dy = routed(29, H, M, generator)
    wd = bf16_randn(E, H, I, generator=generator, scale=H**-0.5)
    saved = bf16_randn(M, 2 * I, generator=generator, scale=2.0)
    w = torch.rand(M, generator=generator) + 0.5
    results = []
    for x in (dy, dy.materialise()):
        partial = nan(partial_rows(I, SMALL), M, dtype=torch.float32)
        tensors = dict(gate=saved[:, :I], up=saved[:, I:], scale=w, dgate_out=nan(M, I), dup_out=nan(M, I),
                       scaled_act_out=nan(M, I), topk_partial=partial)  # fmt: skip
        results.append(grouped_gemm_tl(x, wd, offsets, epilogue="dswiglu", config=SMALL, programs=3, **tensors))
    for one, other in zip(*results, strict=True):
        assert torch.equal(one, other)
    dap = per_expert(dy.materialise(), wd, offsets, False)
    g, u = saved[:, :I].double(), saved[:, I:].double()
    assert within_bf16(results[0][1], dap * w.double()[:, None] * torch.nn.functional.silu(g))  # du
    assert not torch.isnan(results[0][0]).any() and within_bf16(
        results[0][2], torch.nn.functional.silu(g) * u * w.double()[:, None]
    )


# --- the Gluon kernel built for sm_90 on the CPU ------------------------------------------------------------------


# run in a process of its own without the interpreter (TRITON_INTERPRET=1 makes every @triton.jit helper an
# interpreted function, which the Gluon compiler cannot call): argv epilogue, config fields, parts, ring
BUILD_SCRIPT = """
import json, re, sys
import torch
from moe_lib.bench.sm90 import compile_gluon_for_sm90, resource_usage
from moe_lib.engine import grouped_gemm as module
from moe_lib.engine.gathered import Gathered
from moe_lib.engine.gluon_gemm import GemmConfig

epilogue, fields, parts, ring = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
config = GemmConfig(*fields)
module.GATHER_IN_PARTS, module.SAVED_THROUGH_RING = parts, ring
meta = lambda *shape, dtype=torch.bfloat16: torch.empty(shape, dtype=dtype, device="meta")
E, T, M, H, I = 8, 1024, 8192, 2048, 768
a = Gathered(meta(T, H), meta(M, dtype=torch.int32))
if epilogue == "swiglu":
    b, b_transposed = meta(E, 2 * I, H), True
    tensors = dict(out=meta(M, I), gate_out=meta(M, I), up_out=meta(M, I))
else:
    b, b_transposed = meta(E, H, I), False
    tensors = dict(gate=meta(M, I), up=meta(M, I), scale=meta(M, dtype=torch.float32), dgate_out=meta(M, I),
                   dup_out=meta(M, I), scaled_act_out=meta(M, I),
                   topk_partial=meta(module.partial_rows(I, config), M, dtype=torch.float32))
arguments, constexprs = module.launch_arguments(config, a, b, meta(E + 1, dtype=torch.int32), epilogue, b_transposed,
                                                **tensors)
pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
arguments = {name: pointer[v.dtype] if isinstance(v, torch.Tensor) else v for name, v in arguments.items()}
arguments.update(num_experts="i32", a_stride="i32")
compiled = compile_gluon_for_sm90(module.grouped_gemm_kernel, arguments, constexprs, warps=config.warps,
                                  maxnreg=config.maxnreg)
ptx = compiled.asm["ptx"]
registers = [int(n) for n in re.findall(r"setmaxnreg[.](?:inc|dec)[.]sync[.]aligned[.]u32\\s+(\\d+)", ptx)]
print(json.dumps(dict(usage=resource_usage(compiled), cp_async=ptx.count("cp.async.cg.shared.global"),
                      arrivals=ptx.count("cp.async.mbarrier.arrive.noinc"), wgmma=ptx.count("wgmma.mma_async"),
                      registers=registers)))
"""


def built_for_sm90(epilogue: str, config: GemmConfig, parts: bool, ring: bool = False) -> dict:
    """The gathered launch built for sm_90 in a fresh process (:data:`BUILD_SCRIPT`): its resources and PTX counts."""
    import dataclasses
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = compile_env(root)
    fields = json.dumps(list(dataclasses.astuple(config)))
    done = subprocess.run(
        [sys.executable, "-c", BUILD_SCRIPT, epilogue, fields, str(int(parts)), str(int(ring))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("epilogue", "config", "ring"),
    [
        ("swiglu", GemmConfig(128, 256, 64, 3, "cooperative"), False),
        ("swiglu", GemmConfig(64, 256, 64, 4, "pingpong"), False),
        ("dswiglu", DSWIGLU_CONFIG, False),
        ("dswiglu", RING_DSWIGLU_CONFIG, True),
    ],
    ids=["swiglu_coop", "swiglu_pingpong", "dswiglu", "dswiglu_through_the_ring"],
)
@pytest.mark.parametrize("parts", [False, True], ids=["one_loading_partition", "four_one_warp_parts"])
def test_gathered_kernels_build_for_sm90_without_spills(epilogue, config, ring, parts):
    """The layer's gathered launches: cp.async copies in the loading partition (or, with GATHER_IN_PARTS, in four
    one-warp partitions, with no barrier among the loading warps), no spill, within the registers; dswiglu's K loop
    once in the PTX; through the ring (SAVED_THROUGH_RING, 128 × 256 tiles) each loading partition's arrival on a
    chunk step too, and at most a few words of stack beside the accumulator's 128 registers a thread."""
    built = built_for_sm90(epilogue, config, parts, ring)
    assert built["usage"]["stack"] <= (32 if ring else 0), built
    arrivals = 4 if parts else 1  # one a loading partition on a K step
    # through the ring, each partition's arrival on a chunk step too (its loop over a tile's chunks maybe unrolled)
    chunk_arrivals = built["arrivals"] - arrivals
    assert chunk_arrivals in ((arrivals, arrivals * config.block_n // config.block_k) if ring else (0,)), built
    # a step's copies per thread: the partition's share of the tile's rows × 8 pieces of 16 bytes over its threads
    assert built["cp_async"] == arrivals * (8 if config.block_m == 128 else 4), built
    assert built["registers"] and max(built["registers"]) <= 256, built
    if epilogue == "dswiglu":
        assert built["wgmma"] == 4, built


# --- on a Hopper GPU --------------------------------------------------------------------------------------------

GPU_COUNTS = {
    "ragged": [0, 1, 200, 129, 0, 383, 64, 7],
    "all_in_one": [0, 0, 1000, 0],
    "many": [0, 3, 17, 130, 255, 256, 257, 1, 0, 90] * 6,
}
LAYER_CONFIGS = {
    "coop": GemmConfig(128, 256, 64, 3, "cooperative"),
    "pingpong": GemmConfig(64, 256, 64, 4, "pingpong"),
    "coop_2_programs": GemmConfig(128, 256, 64, 3, "cooperative", programs=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("epilogue", ["swiglu", "row_scale", "none"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
@pytest.mark.parametrize("parts", [False, True], ids=["one_loading_partition", "four_one_warp_parts"])
def test_gpu_gathered_a_gives_the_bits_of_the_a_written_out(name, epilogue, counts, parts, seed, monkeypatch):
    from moe_lib.engine import grouped_gemm as module

    monkeypatch.setattr(module, "GATHER_IN_PARTS", parts)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of(GPU_COUNTS[counts], device="cuda")
    E, M, N, K = len(GPU_COUNTS[counts]), int(offsets[-1]), 168, 264  # partial tiles on every side
    a = routed(301, K, M, generator, device="cuda")
    b = bf16_randn(E, 2 * N if epilogue == "swiglu" else N, K, generator=generator, scale=K**-0.5, device="cuda")
    scale = torch.rand(M, generator=generator, device="cuda") + 0.5 if epilogue == "row_scale" else None
    outs = []
    for x in (a, a.materialise(), a):  # the gathered call twice: deterministic
        out = nan(M, N, device="cuda")
        grouped_gemm(x, b, offsets, out=out, scale=scale, epilogue=epilogue, config=LAYER_CONFIGS[name])
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    product = gpu_per_expert(a.materialise(), b, offsets, True)
    if epilogue == "swiglu":
        product = torch.nn.functional.silu(product[:, :N]) * product[:, N:]
    elif scale is not None:
        product = product * scale.double()[:, None]
    error = ((outs[0].double() - product).norm() / product.norm()).item()
    assert error <= 4e-3, error


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("parts", [False, True], ids=["one_loading_partition", "four_one_warp_parts"])
@pytest.mark.parametrize("ring", [False, True], ids=["whole_saved_tiles", "saved_through_the_ring"])
def test_gpu_dswiglu_with_dy_gathered_gives_the_bits_of_dy_written_out(counts, parts, ring, seed, monkeypatch):
    from moe_lib.engine import grouped_gemm as module

    monkeypatch.setattr(module, "GATHER_IN_PARTS", parts)
    monkeypatch.setattr(module, "SAVED_THROUGH_RING", ring)  # the loaders' chunk steps after the K steps
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of(GPU_COUNTS[counts], device="cuda")
    E, M, H, I = len(GPU_COUNTS[counts]), int(offsets[-1]), 256, 328
    dy = routed(157, H, M, generator, device="cuda")
    wd = bf16_randn(E, H, I, generator=generator, scale=H**-0.5, device="cuda")
    saved = bf16_randn(M, 2 * I, generator=generator, scale=2.0, device="cuda")
    w = torch.rand(M, generator=generator, device="cuda") + 0.5
    results, partials = [], partial_rows(I, default_config("dswiglu"))
    for x in (dy, dy.materialise()):
        tensors = dict(gate=saved[:, :I], up=saved[:, I:], scale=w, dgate_out=nan(M, I, "cuda"),
                       dup_out=nan(M, I, "cuda"), scaled_act_out=nan(M, I, "cuda"),
                       topk_partial=nan(partials, M, "cuda", torch.float32))  # fmt: skip
        results.append(grouped_gemm(x, wd, offsets, epilogue="dswiglu", **tensors))
    for one, other in zip(*results, strict=True):
        assert torch.equal(one, other)
    dap = gpu_per_expert(dy.materialise(), wd, offsets, False)
    du = dap * w.double()[:, None] * torch.nn.functional.silu(saved[:, :I].double())
    assert ((results[0][1].double() - du).norm() / du.norm()).item() <= 4e-3


@pytest.mark.gpu
def test_gpu_gathered_a_replays_in_a_cuda_graph_with_a_new_index(seed):
    """Captured once, replayed after the index and the offsets changed on the device."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = [300, 0, 129, 600, 1]
    offsets = offsets_of(counts, device="cuda")
    a = routed(500, 256, sum(counts), generator, device="cuda")
    b = bf16_randn(len(counts), 512, 256, generator=generator, scale=256**-0.5, device="cuda")
    out = torch.empty((sum(counts), 512), dtype=torch.bfloat16, device="cuda")
    grouped_gemm(a, b, offsets, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm(a, b, offsets, out=out)
    for new_counts in ([0, 1030, 0, 0, 0], [206, 206, 206, 206, 206]):
        offsets.copy_(offsets_of(new_counts, device="cuda"))
        a.index.copy_(torch.randint(0, 500, a.index.shape, generator=generator, device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = gpu_per_expert(a.materialise(), b, offsets, True)
        assert ((out.double() - expected).norm() / expected.norm()).item() <= 4e-3, new_counts
