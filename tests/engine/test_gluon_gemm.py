"""The Gluon GEMM (``moe_lib/engine/gluon_gemm.py``): its host side and its sm_90 build on the CPU, its results on
a Hopper GPU (``gpu``: against float64, outputs poisoned with NaN, every operand form, odd sizes, deterministic,
captured in a CUDA graph). The mbarrier protocol itself: test_ring_protocol.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import compile_env

from moe_lib.engine.gluon_gemm import GemmConfig, check_operands, gemm, launch_arguments, operand_form
from moe_lib.tiling import grouped_tile

ROOT = Path(__file__).resolve().parents[2]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(consumers="both"), "consumers must be one of"),
        (dict(block_m=64), "block_m must be one of (128, 256) with cooperative"),
        (dict(consumers="pingpong", block_m=256), "block_m must be one of (64, 128) with pingpong"),
        (dict(block_n=96), "block_n must be 64, 128 or 256"),
        (dict(block_k=16), "block_k must be 32, 64 or 128"),
        (dict(stages=1), "stages must be at least 2"),
        (dict(programs=-1), "programs must be ≥ 0"),
        (dict(stages=5), "its ring alone takes 245760 bytes"),  # 5 × 48 KB
    ],
)
def test_config_refuses_what_the_kernel_does_not_do(fields, message):
    with pytest.raises(ValueError, match="config: ") as error:
        GemmConfig(**fields)
    assert message in str(error.value)


def test_gemm_refuses_a_config_whose_ring_and_output_tile_do_not_fit_before_any_work():
    config = GemmConfig(stages=4)  # 4 × 48 KB of ring fit; with a 64 KB output tile they do not
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(128, 256).bfloat16()
    with pytest.raises(ValueError, match="config: 262144 bytes of shared memory .* more than the 232448"):
        gemm(a, b, config)


def test_config_counts_tiles_programs_and_shared_memory():
    config = GemmConfig()  # 128 × 256 × 64, 3 stages, cooperative
    assert config.tiles(8192, 2048) == 64 * 8
    assert config.grid(8192, 2048, 132) == 132
    assert config.grid(256, 2048, 132) == 16  # never more programs than tiles
    assert GemmConfig(programs=1 << 30).grid(8192, 2048, 132) == 512  # one program a tile
    assert config.shared_bytes == 3 * (128 + 256) * 64 * 2 + 128 * 256 * 2
    pingpong = GemmConfig(128, 128, 64, 5, "pingpong")
    assert (pingpong.warps, pingpong.output_tiles, pingpong.shared_bytes) == (4, 2, 5 * 32768 + 2 * 32768)


def test_tile_order_visits_every_tile_once_in_groups():
    """The kernel's tile_origin is moe_lib.tiling.grouped_tile's arithmetic: every tile once, GROUP_M rows a group."""
    tiles_m, tiles_n, group = 11, 5, 8
    seen = [grouped_tile(t, tiles_m, tiles_n, group) for t in range(tiles_m * tiles_n)]
    assert sorted(seen) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    assert {m for m, _ in seen[: group * tiles_n]} == set(range(group))


def test_operand_forms_are_read_off_the_strides():
    assert operand_form(meta(64, 32), "a") is False
    assert operand_form(meta(32, 64).t(), "a") is True
    with pytest.raises(ValueError, match="b: expected a row-major or a column-major"):
        operand_form(meta(64, 64)[:, ::2], "b")


@pytest.mark.parametrize(("a_t", "b_t"), [(False, False), (False, True), (True, False), (True, True)])
def test_launch_arguments_give_each_form_its_tiles(a_t, b_t):
    M, N, K = 200, 328, 264
    config = GemmConfig(128, 128, 64, 5, "pingpong")
    a = meta(K, M).t() if a_t else meta(M, K)
    b = meta(N, K).t() if b_t else meta(K, N)
    descriptors, constexprs = launch_arguments(config, a, b, meta(M, N))
    assert list(descriptors) == ["a_desc", "b_desc", "c_desc"]
    assert descriptors["a_desc"].block_shape == ([64, 128] if a_t else [128, 64])
    assert descriptors["b_desc"].block_shape == ([128, 64] if b_t else [64, 128])
    assert list(descriptors["a_desc"].shape) == ([K, M] if a_t else [M, K])
    assert descriptors["c_desc"].block_shape == [128, 128]
    assert (constexprs["A_TRANSPOSED"], constexprs["B_TRANSPOSED"], constexprs["PINGPONG"]) == (a_t, b_t, True)
    assert constexprs["num_warps"] == 4


@pytest.mark.parametrize(
    ("a", "b", "out", "message"),
    [
        (meta(64, 32, dtype=torch.float32), meta(32, 64), None, "a: expected bfloat16 or float16"),
        (meta(64, 32), meta(32, 64, dtype=torch.float16), None, "b: expected torch.bfloat16 like a"),
        (meta(64, 32), meta(40, 64), None, "b: expected 32 rows"),
        (meta(64, 32), meta(32, 64), meta(64, 72), "out: expected shape (64, 64)"),
        (meta(64, 32), meta(32, 64), meta(64, 128)[:, :64], "out: expected a contiguous"),
        (meta(64, 12), meta(12, 64), None, "a: TMA needs rows of a multiple of 16 bytes"),
        (meta(64, 32), meta(32, 60), None, "b: TMA needs rows"),
        (meta(64, 32), meta(32, 64, 1), None, "b: expected a 2-D tensor"),
    ],
)
def test_operands_are_checked_naming_the_argument(a, b, out, message):
    with pytest.raises(ValueError) as error:
        check_operands(a, b, out)
    assert message in str(error.value)


def test_gemm_refuses_cpu_tensors_and_non_tensors():
    with pytest.raises(ValueError, match="a: the Gluon GEMM runs on a CUDA"):
        gemm(torch.ones(16, 16, dtype=torch.bfloat16), torch.ones(16, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="b: expected a torch.Tensor"):
        gemm(torch.ones(16, 16, dtype=torch.bfloat16), [[1.0]])


def test_probe_configs_compile_for_sm90_unserialised_within_the_limits(tmp_path):
    """Every config the GPU probe times, in each operand form it times, compiled for sm_90 (each distinct kernel
    once, by the probe itself: ``--compile-only``): no stack, within 227 KB, wgmma not serialised by ptxas, at most
    255 registers a thread in any partition."""
    env = compile_env(ROOT)
    done = subprocess.run(
        [sys.executable, "scripts/p2/gemm_probe.py", "--compile-only", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "gemm_probe_compile.json").read_text())["compile"]
    assert {row["form"] for row in rows} == {"nn", "nt", "tn"}
    for row in rows:
        assert row["error"] is None and row["problems"] == [], row
        assert row["stack"] == 0 and row["shared"] <= 232448 and row["serialized"] == "no", row
        assert max(row["partition_registers"]) <= 256 and row["wgmma"] > 0, row


# --- on a Hopper GPU --------------------------------------------------------------------------------------------

CONFIGS = {
    "coop": GemmConfig(),
    "coop_2_programs": GemmConfig(programs=2),  # many tiles a program: the ring's steps run on across tiles
    "coop_256": GemmConfig(256, 128, 64, 3),
    "coop_k32": GemmConfig(128, 128, 32, 6),
    "pingpong": GemmConfig(128, 128, 64, 5, "pingpong"),
    "pingpong_3_programs": GemmConfig(64, 256, 64, 4, "pingpong", programs=3),  # an odd tile count a program
}
# (M, N, K): partial tiles on every side, K past a multiple of block_k, one K step, a long reduction
SIZES = [(200, 328, 264), (64, 64, 8), (520, 1040, 2056)]


def reference_and_torch_error(a, b):
    reference = a.double() @ b.double()
    torch_bf16 = torch.mm(a, b)
    return reference, relative_error(torch_bf16, reference)


def relative_error(out, reference) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - reference).norm() / reference.norm()).item()


def operands(M, N, K, a_t, b_t, generator):
    def randn(*size):
        return torch.randn(size, generator=generator, device="cuda").to(torch.bfloat16)

    return (randn(K, M).t() if a_t else randn(M, K)), (randn(N, K).t() if b_t else randn(K, N))


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("form", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_gemm_matches_float64_in_every_form(name, form, size, seed):
    M, N, K = size
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a, b = operands(M, N, K, form[0] == "t", form[1] == "t", generator)
    reference, torch_error = reference_and_torch_error(a, b)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, CONFIGS[name], out=out)
    error = relative_error(out, reference)
    assert error <= 2 * torch_error + 1e-4, (error, torch_error)
    again = torch.full_like(out, float("nan"))
    gemm(a, b, CONFIGS[name], out=again)
    assert torch.equal(out, again)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["coop", "pingpong"])
def test_gpu_gemm_replays_in_a_cuda_graph(name, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a, b = operands(1000, 512, 776, True, False, generator)
    reference, torch_error = reference_and_torch_error(a, b)
    out = torch.empty((1000, 512), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, CONFIGS[name], out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, b, CONFIGS[name], out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, reference) <= 2 * torch_error + 1e-4
