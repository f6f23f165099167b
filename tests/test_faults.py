"""Faults a call can meet, and what the library does about them.

- Files: the public functions and layers read no file when called (no tuning table, no cache of their own), on the
  reference path or the Triton one, first calls included: a corrupted file cannot break a call. Found with an
  audit hook on every ``open`` in a fresh process (Python's own module files aside). On a GPU, Triton's kernel
  cache (``TRITON_CACHE_DIR``) is read at each kernel's first launch: Triton's, written whole by renames.
- Memory: an out-of-memory error in the middle of a backward on the GPU is ``torch.cuda.OutOfMemoryError``, and
  the library stays usable: the next call, of the same size with the memory back, is right (GPU only).
- Interrupted benchmark runs: ``tests/bench/test_interrupts.py``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_error

import moe_lib
from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled

ROOT = Path(__file__).resolve().parent.parent
CALLS = """
import json, sys
import torch
import moe_lib
from moe_lib import problems

p1 = problems.make_inputs("swiglu_down_backward", 5, seed=0, hidden_size=32, intermediate_size=16)
p2 = problems.make_inputs("moe_experts_backward", 6, seed=0, hidden_size=32, intermediate_size=16, num_experts=4,
                          top_k=2)
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
for impl in IMPLS:
    moe_lib.swiglu_down_backward(*p1.values(), impl=impl)
    moe_lib.swiglu_down_backward(*p1.values(), impl=impl, precision="fast")
    moe_lib.moe_experts_backward(*p2.values(), impl=impl)
    x = p1["x"].float().requires_grad_()
    weights = [p1[name].float() for name in ("gate_weight", "up_weight", "down_weight")]
    moe_lib.swiglu_expert(x, *weights, impl=impl).sum().backward()
    h = p2["hidden_states"].clone().requires_grad_()
    routed = [p2[name] for name in ("topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")]
    moe_lib.moe_experts(h, *routed, impl=impl).sum().backward()
    moe_lib.moe_experts(h, *routed, impl=impl, save_activations=True).sum().backward()
print(json.dumps(opened))
"""
MODULE_FILES = (".py", ".pyc", ".so", ".pth", ".zip", "entry_points.txt", "METADATA", "RECORD", "top_level.txt")


def test_the_public_calls_read_no_file():
    impls = ["reference"] + (["triton"] if torch.cuda.is_available() or interpreter_enabled() else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(
        [sys.executable, "-c", f"IMPLS = {impls!r}\n" + CALLS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    opened = json.loads(done.stdout.strip().splitlines()[-1])
    read = sorted(
        {
            path
            for path in opened
            if not path.endswith(MODULE_FILES)
            and "/dist-info" not in path
            and not Path(path).is_dir()
            and not path.startswith("/proc/")
        }
    )
    if torch.cuda.is_available():  # Triton's kernel cache and the CUDA libraries, on the GPU
        read = [path for path in read if "triton" not in path and "/dev/" not in path and "cuda" not in path.lower()]
    assert read == [], f"a call read these files (each needs a test that a corrupted one is ignored): {read}"


# ------------------------------------------------------------------------------------------------
# out of memory in the middle of a backward (GPU)


def _limit_memory_to(extra_bytes: int) -> list[torch.Tensor]:
    """Leaves the caching allocator room for ``extra_bytes`` and no more: it may reserve that beyond what it holds
    now, and the free space inside the segments it holds is taken by the fillers returned (else a small call
    finds room there and never asks for more). Dropping the fillers gives that space back."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
    fillers, size = [], 2**30
    while size >= 512:
        try:
            fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            size //= 2
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + extra_bytes) / total))
    return fillers


@pytest.fixture
def memory_limit():
    yield _limit_memory_to
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


P1_AXES = dict(hidden_size=2048, intermediate_size=768)
P2_AXES = dict(hidden_size=4096, intermediate_size=2048, num_experts=32, top_k=8)  # outputs 1.5 GiB in bf16


def _right(problem, inputs, got) -> None:
    want = problem.spec.reference(*[t.double() if t.is_floating_point() else t for t in inputs.values()])
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all() and rel_error(g, w) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, num_tokens, axes, extra_mib",
    [
        ("swiglu_down_backward", 4, P1_AXES, 1),  # one launch, its counters kept between calls
        ("swiglu_down_backward", 2048, P1_AXES, 1),
        ("moe_experts_backward_bf16", 2048, P2_AXES, 1),
        ("moe_experts_backward_bf16", 2048, P2_AXES, 1536 + 64),  # the outputs fit, the workspaces do not
    ],
)
def test_out_of_memory_in_a_backward_raises_and_the_next_call_is_right(
    name, num_tokens, axes, extra_mib, seed, memory_limit
):
    """After a first call (what a call keeps between calls is there), with room for ``extra_mib`` MiB more the
    call raises torch.cuda.OutOfMemoryError and holds nothing after it; with the memory back, the same call and a
    fresh one are right."""
    problem = problems.load(name)
    inputs = problem.make_inputs(num_tokens, seed=seed, device="cuda", **axes)
    function = problem.spec.function
    _right(problem, inputs, function(*inputs.values(), impl="triton"))
    gc.collect()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    fillers = memory_limit(extra_mib * 2**20)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        function(*inputs.values(), impl="triton")
    del fillers
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated  # nothing of the failed call is held
    torch.cuda.set_per_process_memory_fraction(1.0)
    _right(problem, inputs, function(*inputs.values(), impl="triton"))
    fresh = problem.make_inputs(num_tokens, seed=seed + 1, device="cuda", **axes)
    _right(problem, fresh, function(*fresh.values(), impl="triton"))


@pytest.mark.gpu
def test_out_of_memory_in_a_layers_backward_leaves_the_layer_usable(seed, memory_limit):
    p1 = problems.make_inputs("swiglu_down_backward", 1024, seed=seed, device="cuda")
    weights = [p1[name] for name in ("gate_weight", "up_weight", "down_weight")]

    def x_grad(impl):
        x = p1["x"].clone().requires_grad_()
        moe_lib.swiglu_expert(x, *weights, impl=impl).backward(p1["grad_output"])
        return x.grad

    want = x_grad("reference")
    x = p1["x"].clone().requires_grad_()
    y = moe_lib.swiglu_expert(x, *weights, impl="triton")
    fillers = memory_limit(2**20)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        y.backward(p1["grad_output"])
    del fillers
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert rel_error(x_grad("triton"), want) < 2e-2
