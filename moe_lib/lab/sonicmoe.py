"""Notebook 05, "Why SonicMoE's layer is faster, and what would close the gap": the committed runs read side by side.

SonicMoE (Guo et al., arXiv 2512.14080) is the public MoE training kernel set P2's bf16 targets are set against. Three
committed measurements say where the difference lies:

- the layer's training step (``bench --mode forward_backward``, :mod:`.training_step`), ours and SonicMoE's in the
  same run: :func:`layer_comparison`, with the rate each reaches counting a layer's usual 18·T·K·H·I FLOPs;
- ncu of our backward's kernels, one call per case (``scripts/p2/p2_profile.py``, the file :data:`NCU_FILE`):
  :func:`ncu_kernels` reads it, :func:`kernel_rates` turns each GEMM kernel's time into the rate it multiplies at;
- what P1's warp-specialised Gluon launch keeps busy (its tensor pipe 92% busy at 8192 tokens,
  ``notes/p1/design-24.md``):
  :func:`kernel_rates` costs each kernel at that activity — the gap a warp-specialised, TMA-fed kernel A, W and D
  would close.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from .. import problems
from .results import RESULTS_DIR, resolve_path, shown_path, styled
from .training_step import load_layer_runs

TUNING_DIR = RESULTS_DIR / "H200" / "tuning"
NCU_FILE = TUNING_DIR / "2026-12-01-p2-ncu.txt"
# the cases of that file, in the order scripts/p2/p2_profile.py ran them
# (--cases bf16:2048,fp32:2048,fp32:8192,bf16:32768; notes/p2/kernel-a-configs.md)
NCU_CASES = (("bfloat16", 2048), ("float32", 2048), ("float32", 8192), ("bfloat16", 32768))
# the kernels of one backward call, in launch order, and what each computes
KERNELS = (
    ("swiglu_grad_kernel", "A: g, u, Wdᵀdy, the dSwiGLU and dw"),
    ("grouped_weight_grad_kernel", "W: dWg, dWu"),
    ("grouped_weight_grad_kernel", "W: dWd"),
    ("tile_offsets_kernel", "tile offsets"),
    ("slot_projection_tma_kernel", "D: dX per slot"),
    ("token_sum_kernel", "C: dx per token"),
)
# the products each kernel runs, in units of 2·T·K·H·I FLOPs (kernel A recomputes g and u)
GEMMS = {"A: g, u, Wdᵀdy, the dSwiGLU and dw": 3, "W: dWg, dWu": 2, "W: dWd": 1, "D: dX per slot": 2}
METRICS = {
    "gpu__time_duration.sum": "time (ms)",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe busy (%)",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM (% of peak)",
    "launch__registers_per_thread": "registers",
}
STALL = re.compile(r"smsp__warp_issue_stalled_(\w+)_per_warp_active\.pct")
WARP_SPECIALISED_BUSY = 0.92  # P1's Gluon launch 2 at 8192 tokens, and cuBLAS's dx (notes/p1/design-24.md)


def read_ncu(path=NCU_FILE) -> list[dict]:
    """The kernels of an ncu text report in profiling order: {"kernel": name, metric: value, ..., "stalls": {reason:
    % of active warps' cycles}} (values as numbers; times in ms)."""
    kernels, current = [], None
    for line in resolve_path(path).read_text().splitlines():
        header = re.match(r"^  (\w+) \((\d+), (\d+), (\d+)\)x", line)
        if header:
            current = {"kernel": header.group(1), "stalls": {}}
            kernels.append(current)
            continue
        fields = line.split()
        if current is None or len(fields) < 2:
            continue
        name, value = fields[0], fields[-1].replace(",", "")
        try:
            number = float(value)
        except ValueError:
            continue
        stall = STALL.fullmatch(name)
        if stall:
            current["stalls"][stall.group(1).replace("_", " ")] = number
        elif name in METRICS:
            unit = fields[1] if len(fields) == 3 else ""
            current[name] = (
                number * {"us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3}.get(unit, 1.0)
                if name == "gpu__time_duration.sum"
                else number
            )
    return kernels


def ncu_kernels(path=NCU_FILE, cases=NCU_CASES) -> pd.DataFrame:
    """Per case and kernel of :data:`KERNELS` (rows): its time, how busy its tensor pipe and DRAM were, its registers
    and its two largest stalls, from the ncu report (one backward call per case, in ``cases``' order)."""
    kernels = read_ncu(path)
    if len(kernels) != len(cases) * len(KERNELS):
        raise ValueError(
            f"{shown_path(path)}: {len(kernels)} kernels, expected {len(KERNELS)} for each of {len(cases)} cases"
        )
    rows = []
    for index, record in enumerate(kernels):
        (dtype, tokens), (name, role) = cases[index // len(KERNELS)], KERNELS[index % len(KERNELS)]
        if record["kernel"] != name:
            raise ValueError(f"{shown_path(path)}: kernel {index} is {record['kernel']}, expected {name}")
        top = sorted(record["stalls"].items(), key=lambda item: -item[1])[:2]
        rows.append(
            {
                "dtype": dtype,
                "tokens": tokens,
                "kernel": role,
                **{label: record.get(metric, math.nan) for metric, label in METRICS.items()},
                "top stalls": ", ".join(f"{reason} {value:.0f}%" for reason, value in top),
            }
        )
    return pd.DataFrame(rows).set_index(["dtype", "tokens", "kernel"])


def kernel_rates(
    kernels: pd.DataFrame, dtype: str, tokens: int, peak_flops: float, busy: float = WARP_SPECIALISED_BUSY
) -> pd.DataFrame:
    """The GEMM kernels of one case of :func:`ncu_kernels`: the bf16 tensor work each runs (TFLOP: its products of
    :data:`GEMMS`; bf16×3 in fp32 counts three products each for A), the rate it reaches, that rate against
    ``peak_flops`` and the time it would take with its tensor pipe ``busy`` (a fraction) of the time."""
    sizes = problems.load("moe_experts_backward").sizes(tokens)
    tkhi = tokens * sizes["top_k"] * sizes["hidden_size"] * sizes["intermediate_size"]
    mine = (kernels.index.get_level_values("dtype") == dtype) & (kernels.index.get_level_values("tokens") == tokens)
    case = kernels[mine].droplevel(["dtype", "tokens"])
    rows = {}
    for kernel, products in GEMMS.items():
        if dtype == "float32" and kernel.startswith("A"):
            products *= 3  # bf16×3: three bf16 products for each fp32 one (docs/methodology.md, Precision)
        flops = 2 * products * tkhi
        ms = case.loc[kernel, "time (ms)"]
        rows[kernel] = {
            "TFLOP": flops / 1e12,
            "time (ms)": ms,
            "TFLOP/s": flops / (ms * 1e-3) / 1e12,
            "of the peak": flops / (ms * 1e-3) / peak_flops,
            "tensor pipe busy (%)": case.loc[kernel, "tensor pipe busy (%)"],
            f"at {busy:.0%} busy (ms)": flops / (busy * peak_flops) * 1e3,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def layer_comparison(
    results_dir=RESULTS_DIR,
    gpu_key: str = "H200",
    problem: str = "moe_experts_backward_bf16",
    ours=("triton", "triton_saved"),
    peer: str = "sonicmoe",
) -> pd.DataFrame:
    """Per token count of the newest training-step run (forward + backward) holding ``peer``: each of ``ours`` and the
    peer in ms and TFLOP/s (a layer's usual count, the problem's ``layer_flops``: no credit for recomputation), and
    each of ours over the peer (above 1: slower)."""
    layer = load_layer_runs(results_dir, gpu_key, problem=problem)
    layer = layer[layer["mode"] == "forward_backward"]
    times = layer.pivot_table(index="num_tokens", columns="impl", values="median_ms")
    if peer not in times:
        return pd.DataFrame()
    times = times[[*[impl for impl in ours if impl in times], peer]].dropna()
    definition = problems.load(problem)
    table = pd.DataFrame(index=times.index)
    for impl in times.columns:
        flops = [
            definition.layer_flops["forward_backward"]
            * math.prod(definition.sizes(t)[a] for a in definition.flops_axes)
            for t in times.index
        ]
        table[f"{impl} (ms)"] = times[impl]
        table[f"{impl} (TFLOP/s)"] = [f / (ms * 1e-3) / 1e12 for f, ms in zip(flops, times[impl], strict=True)]
    for impl in times.columns.drop(peer):
        table[f"{impl} / {peer}"] = times[impl] / times[peer]
    table.attrs.update(problem=problem, peer=peer, files=sorted(set(layer["file"])))
    return table


def styled_layer_comparison(table: pd.DataFrame):
    """:func:`layer_comparison` for display: ms and TFLOP/s, the ratios red above 1 (ours slower)."""
    formats = {c: "{:.1f}" for c in table.columns if c.endswith("(ms)")}
    formats.update({c: "{:.0f}" for c in table.columns if c.endswith("(TFLOP/s)")})
    ratios = [c for c in table.columns if " / " in c]
    formats.update({c: "{:.2f}×" for c in ratios})
    caption = (
        f"{table.attrs['problem']}: the layer's training step, ours against {table.attrs['peer']} "
        f"({', '.join(table.attrs['files'])})"
    )
    return styled(table, formats, caption).map(lambda v: "color: #b00020" if v > 1 else "", subset=ratios)
