"""Roofline model of the two problems: GPU ceilings, FLOPs and minimal bytes, T_sol and the score.

Conventions (those of the benchmark, SOL-ExecBench, and its roofline tool SOLAR):

- FLOPs count the GEMMs only, two per multiply-add, as each problem's ``lab.json`` states: P1
  ``swiglu_down_backward`` does six GEMMs of T·H·I multiply-adds (dWd, dA, dWg, dWu and the two halves
  of dx): **12·T·H·I**. P2 ``moe_experts_backward`` does eight per routed (token, slot) pair, the
  recomputed forward (g, u, and o = Wd·a, whose dot with dy gives grad_topk_weights, taken as
  ``Wd_eᵀ·dy``) included: **16·T·K·H·I**. Elementwise work is free.
- Bytes: every input read once plus every output written once, at the dtype of the problem's
  definition (or of the ``dtype`` override, which applies to every floating tensor); intermediates
  are free. For P2 this counts all E experts' weights and weight gradients, also for experts that no
  token chose: an implementation must still write their zero gradients, while reading the weights of
  an unchosen expert is not necessary, but the convention counts them (the difference is nil at the
  suite's sizes, where every expert gets tokens).
- ``T_sol = max(FLOPs / bf16 dense tensor rate, bytes / DRAM bandwidth)`` for every problem and
  dtype: tensor-core math is allowed for fp32 inputs too. ``T_sol`` is reported against the
  datasheet figures of :data:`GPUS` and against ceilings measured on the machine
  (:func:`measure_ceilings`, :meth:`GPUSpec.from_measured`).
- Score: ``S = 1 / (1 + (T_k − T_sol) / (T_b − T_sol))`` with T_b an optimized PyTorch baseline:
  S = 0.5 at the baseline, 1 at the roofline.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time

import torch

from . import problems

TFLOPS = 1e12
TB = 1e12
GB = 1e9
MB = 1e6


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """Peak figures of one GPU. Rates in FLOP/s, bandwidth in B/s, sizes in bytes."""

    name: str
    bf16_dense_flops: float
    dram_bandwidth: float
    fp32_flops: float | None = None  # plain (non-tensor) fp32
    tf32_dense_flops: float | None = None
    l2_bytes: int | None = None
    sms: int | None = None
    memory_bytes: int | None = None
    source: str = ""
    # how torch.cuda.get_device_name spells it: every one of name_all, at least one of name_any (if
    # given), none of name_none (case-insensitive)
    name_all: tuple = ()
    name_any: tuple = ()
    name_none: tuple = ()

    def matches(self, device_name: str) -> bool:
        upper = device_name.upper()
        return (
            bool(self.name_all)
            and all(part in upper for part in self.name_all)
            and (not self.name_any or any(part in upper for part in self.name_any))
            and not any(part in upper for part in self.name_none)
        )

    @classmethod
    def from_measured(cls, copy_bandwidth: float, bf16_rate: float, name: str = "measured") -> GPUSpec:
        """A spec from ceilings measured on the machine (copy bandwidth, bytes read + written, in B/s;
        bf16 GEMM rate in FLOP/s), e.g. the values :func:`measure_ceilings` returns."""
        if not copy_bandwidth or not bf16_rate or copy_bandwidth <= 0 or bf16_rate <= 0:
            raise ValueError(f"from_measured: expected positive ceilings, got {copy_bandwidth=} {bf16_rate=}")
        return cls(
            name=name,
            bf16_dense_flops=float(bf16_rate),
            dram_bandwidth=float(copy_bandwidth),
            source="measured on this machine: device-to-device copy and bf16 GEMM",
        )


GPUS: dict[str, GPUSpec] = {
    "H100-SXM": GPUSpec(
        name="NVIDIA H100 SXM5 80GB",
        bf16_dense_flops=989 * TFLOPS,
        fp32_flops=67 * TFLOPS,
        tf32_dense_flops=494.7 * TFLOPS,
        dram_bandwidth=3.35 * TB,
        l2_bytes=50 * MB,
        sms=132,
        memory_bytes=80 * GB,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM column, dense = half the sparse figure); "
        "SM count and 50 MB L2 from the NVIDIA H100 (Hopper) architecture whitepaper",
        name_all=("H100",),
        name_any=("HBM3", "SXM"),
    ),
    "H100-PCIe": GPUSpec(
        name="NVIDIA H100 PCIe 80GB",
        bf16_dense_flops=756 * TFLOPS,
        fp32_flops=51 * TFLOPS,
        tf32_dense_flops=378 * TFLOPS,
        dram_bandwidth=2.0 * TB,
        l2_bytes=50 * MB,
        sms=114,
        memory_bytes=80 * GB,
        source="NVIDIA H100 Tensor Core GPU datasheet (PCIe column, dense = half the sparse figure); "
        "SM count and L2 from the NVIDIA H100 (Hopper) architecture whitepaper",
        name_all=("H100", "PCIE"),
    ),
    "H200": GPUSpec(
        name="NVIDIA H200 SXM 141GB",
        bf16_dense_flops=989 * TFLOPS,
        fp32_flops=67 * TFLOPS,
        tf32_dense_flops=494.7 * TFLOPS,
        dram_bandwidth=4.8 * TB,
        l2_bytes=60 * MB,
        sms=132,
        memory_bytes=141 * GB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM column; same tensor rates as the H100 SXM); "
        "132 SMs and 60 MB L2 as torch.cuda.get_device_properties reports on an H200 (the H100 SXM "
        "datasheet figure is 50 MB)",
        name_all=("H200",),
        name_none=("GH200",),
    ),
    "B200": GPUSpec(
        name="NVIDIA B200",
        bf16_dense_flops=1.81e15,
        fp32_flops=75 * TFLOPS,
        tf32_dense_flops=1.1e15,
        dram_bandwidth=7.67 * TB,
        l2_bytes=126 * MB,
        sms=148,
        memory_bytes=180 * GB,
        source="bf16 rate and bandwidth: the B200 model of SOL-ExecBench (arXiv 2603.19173), whose "
        "leaderboard runs on B200; fp32/tf32 rates, memory, SMs and L2 approximate, from NVIDIA's "
        "HGX/DGX B200 datasheets (per GPU)",
        name_all=("B200",),
        name_none=("GB200",),
    ),
}

# the GPUs whose datasheet T_sol every result row carries beside the measured one
DATASHEET_GPUS = ("H100-SXM", "H200")


def gpu_key_from_name(name: str) -> str:
    """The key of :data:`GPUS` whose spec matches a device name ("NVIDIA H200" -> "H200"); other GPUs get
    their name with "NVIDIA" and punctuation dropped ("NVIDIA A100-SXM4-80GB" -> "A100-SXM4-80GB")."""
    for key, spec in GPUS.items():
        if spec.matches(name):
            return key
    return re.sub(r"[^A-Za-z0-9]+", "-", name.replace("NVIDIA", "")).strip("-") or "unknown-gpu"


# bytes per element of the definition's dtype names
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in problems.DTYPES.items()}
_FLOATING = {"bfloat16", "float16", "float32", "float64"}


def gpu_spec(gpu) -> GPUSpec:
    if isinstance(gpu, GPUSpec):
        return gpu
    if gpu not in GPUS:
        raise ValueError(f"gpu: expected a GPUSpec or one of {sorted(GPUS)}, got {gpu!r}")
    return GPUS[gpu]


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    name = problems.dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    if name not in _FLOATING:
        raise ValueError(f"dtype: expected a floating dtype ({sorted(_FLOATING)}), got {dtype!r}")
    return name


def flops(problem: str, num_tokens: int, **axes) -> int:
    """GEMM FLOPs of one call, as the problem's ``lab.json`` counts them (P1 12·T·H·I, P2 16·T·K·H·I)."""
    return problems.load(problem).flops(num_tokens, **axes)


def minimal_bytes(problem: str, num_tokens: int, dtype=None, **axes) -> int:
    """Bytes of every input read once and every output written once (intermediates free).

    ``dtype`` (a torch dtype or its name) replaces the dtype of every floating tensor."""
    definition = problems.load(problem)
    sizes = definition.sizes(num_tokens, **axes)
    override = _dtype_name(dtype)
    total = 0
    for tensor in list(definition.inputs.values()) + list(definition.outputs.values()):
        name = tensor["dtype"]
        if override is not None and name in _FLOATING:
            name = override
        total += math.prod(sizes[axis] for axis in tensor["shape"]) * _ITEMSIZE[name]
    return total


def cost(problem: str, num_tokens: int, dtype=None, **axes) -> tuple[int, int]:
    """(FLOPs, bytes) of one call of ``problem`` at ``num_tokens``; see the module's conventions."""
    return flops(problem, num_tokens, **axes), minimal_bytes(problem, num_tokens, dtype, **axes)


def sol_time(problem: str, num_tokens: int, gpu, dtype=None, **axes) -> float:
    """Roofline time in seconds: max(FLOPs / bf16 dense rate, bytes / DRAM bandwidth) on ``gpu``
    (a key of :data:`GPUS` or a :class:`GPUSpec`)."""
    spec = gpu_spec(gpu)
    work, traffic = cost(problem, num_tokens, dtype, **axes)
    return max(work / spec.bf16_dense_flops, traffic / spec.dram_bandwidth)


def sol_score(t_kernel: float, t_baseline: float, t_sol: float) -> float:
    """The benchmark's score 1 / (1 + (T_k − T_sol)/(T_b − T_sol)): 0.5 at the baseline, 1 at T_sol."""
    if not t_baseline > t_sol:
        raise ValueError(f"sol_score: t_baseline ({t_baseline}) must exceed t_sol ({t_sol})")
    return 1.0 / (1.0 + (t_kernel - t_sol) / (t_baseline - t_sol))


def measure_ceilings(device="cuda", *, reps: int = 10) -> dict:
    """Measures the machine's ceilings: copy bandwidth (bytes read + written per second) and bf16 GEMM rate.

    On CUDA: a device-to-device copy of 1 GiB and an 8192³ bf16 matmul on random data, each the median
    of ``reps`` timings with CUDA events after warm-up. On CPU: a rough measurement on small sizes
    (64 MiB copy, 512³ bf16 matmul, wall clock), labelled so, to keep the CPU pipeline running.
    Returns dict(device, copy_bandwidth, bf16_matmul_flops, copy_bytes, matmul_size, rough, method).
    """
    device = torch.device(device)
    if device.type == "cuda":
        copy_bytes, size, timer = 2**30, 8192, _cuda_time_ms
        method = (
            f"CUDA events, median of {reps}: device-to-device copy of 1 GiB (bandwidth counts bytes read + "
            "written); bf16 8192x8192x8192 torch.matmul on randn data"
        )
    else:
        copy_bytes, size, timer = 64 * 2**20, 512, _wall_time_ms
        method = (
            f"ROUGH CPU measurement, wall clock, median of {reps}: 64 MiB tensor copy (bytes read + written); "
            "bf16 512x512x512 torch.matmul; not comparable with GPU ceilings"
        )
    copy_ms = _copy_ms(device, copy_bytes, timer, reps)
    matmul_ms = _matmul_ms(device, size, timer, reps)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(
        device=str(device),
        copy_bandwidth=2 * copy_bytes / (copy_ms * 1e-3),
        bf16_matmul_flops=2 * size**3 / (matmul_ms * 1e-3),
        copy_bytes=copy_bytes,
        matmul_size=size,
        rough=device.type != "cuda",
        method=method,
    )


def _copy_ms(device, nbytes: int, timer, reps: int) -> float:
    """Median time (ms) of copying ``nbytes`` from one buffer to another on ``device``."""
    source = torch.rand(nbytes // 4, device=device)
    destination = torch.empty_like(source)
    return timer(lambda: destination.copy_(source), reps)


def _matmul_ms(device, size: int, timer, reps: int) -> float:
    """Median time (ms) of a size³ bf16 matmul of randn matrices on ``device``."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    return timer(lambda: torch.matmul(a, b), reps)


def _cuda_time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median GPU time of ``fn`` in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_time_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median wall-clock time of ``fn`` in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
