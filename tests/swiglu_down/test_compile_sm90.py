"""P1's kernels compile for the H200 at every shape the chooser sends them, within its limits (CPU only).

For a grid of calls (H and I from 256 to 16384 crossed sparsely, T from 1 to 65536, both precisions), the design
``choose_design`` picks on an H200-like device, and every Triton and Gluon kernel it would launch compiled for
sm_90 (``moe_lib.bench.p1_compile``: each launch specialised as Triton's JIT specialises it on the GPU, each distinct
kernel once): within the shared memory a block may use, no stack (a spill), at most 255 registers a thread. In a
child process without the interpreter (tests/conftest.py switches it on here, and under it the kernels are not
Triton's JIT functions). The slow grid adds operands off a 16-byte boundary and fp32 inputs (the portable designs):
there the limits a kernel needs to launch at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import compile_env

from moe_lib.bench.sm90 import SHARED_MEMORY_LIMIT

ROOT = Path(__file__).resolve().parents[2]

# (H, I): every size as H and as I, the benchmark's shape among them, not every pair
PAIRS = [
    (256, 256),
    (256, 16384),
    (1000, 1000),
    (1000, 7168),
    (2048, 768),
    (2048, 2880),
    (2880, 2880),
    (4096, 14336),
    (7168, 2048),
    (14336, 4096),
    (16384, 256),
    (16384, 1000),
]
TOKENS = [1, 64, 256, 4096, 65536]
PRECISIONS = ("faithful", "fast")

# Prints one JSON line per distinct kernel: its name, the first call that launches it, its resources (or the error).
CHILD = r"""
import json, multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor

import torch

from moe_lib.bench.p1_compile import compile_launch, launches
from moe_lib.bench.sm90 import resource_usage
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.runtime import Device

H200 = Device("cuda", 132, 232448, (9, 0), "H200-like")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
first_call = {}
for T, H, I, dtype, precision, aligned in json.loads(sys.argv[1]):
    design = choose_design(T, H, I, dtype=DTYPES[dtype], precision=precision, device=H200, aligned=aligned)
    with_lo = precision == "faithful" and dtype != "fp32"
    for launch in launches(design, T, H, I, with_lo=with_lo, dtype=DTYPES[dtype], aligned=aligned):
        first_call.setdefault(launch, dict(T=T, H=H, I=I, dtype=dtype, precision=precision, aligned=aligned,
                                           design=design.name))
LAUNCHES = list(first_call)


def compiled(index):
    try:
        return index, resource_usage(compile_launch(LAUNCHES[index])), None
    except Exception as exc:  # reported, and the test fails on it
        return index, {}, f"{type(exc).__name__}: {str(exc)[-1000:]}"


workers = min(4, os.cpu_count() or 1)
with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
    for index, usage, error in pool.map(compiled, range(len(LAUNCHES))):
        launch = LAUNCHES[index]
        print(json.dumps(dict(kernel=launch.name, call=first_call[launch], error=error, **usage)), flush=True)
"""


def compile_grid(points: list) -> list[dict]:
    env = compile_env(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(points)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def check_kernels(kernels: list[dict], *, spills: bool = False) -> None:
    """Each kernel compiled, within the shared memory and registers a block may have (else it would not launch),
    and with no stack unless ``spills`` (a spill is slow, not wrong)."""
    failures = []
    for kernel in kernels:
        if kernel["error"]:
            failures.append(f"{kernel['kernel']} at {kernel['call']}: {kernel['error']}")
            continue
        if kernel["shared"] > SHARED_MEMORY_LIMIT or kernel["registers"] > 255:
            failures.append(f"{kernel['kernel']} at {kernel['call']}: {kernel}")
        if kernel["stack"] and not spills:
            failures.append(f"{kernel['kernel']} at {kernel['call']} spills: {kernel}")
    assert not failures, "\n".join(failures)


def test_chosen_kernels_compile_within_the_h200s_limits():
    points = [(T, H, I, "bf16", precision, True) for H, I in PAIRS for T in TOKENS for precision in PRECISIONS]
    kernels = compile_grid(points)
    check_kernels(kernels)
    # the grid reaches every design the chooser takes for such calls on an H200
    assert {kernel["call"]["design"] for kernel in kernels} == {"few_tokens", "gluon_launches", "library_gemms"}
    assert len(kernels) >= 20


@pytest.mark.slow
def test_chosen_kernels_for_unaligned_operands_and_fp32_launch_on_the_h200():
    """Operands off a 16-byte boundary (no TMA: the portable designs, whose loads can assume nothing of the rows)
    and fp32 inputs (the two Triton launches on exact fp32 products): every kernel within the limits it needs to
    launch; some spill a few bytes (these designs are tuned for neither)."""
    pairs = [(256, 256), (1000, 1000), (2048, 768), (2048, 1408), (16384, 1000)]
    points = [(T, H, I, "bf16", precision, False) for H, I in pairs for T in TOKENS for precision in PRECISIONS]
    points += [(T, H, I, "fp32", "faithful", True) for H, I in pairs for T in TOKENS]
    kernels = compile_grid(points)
    check_kernels(kernels, spills=True)
    assert {kernel["call"]["design"] for kernel in kernels} >= {"chained", "triton_launches", "few_tokens"}
