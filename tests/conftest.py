"""Shared test helpers: fresh seeds, CUDA skipping, NaN-poisoned P1 allocations, error measures."""

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter (numpy, one program at a time). It must be
# switched on before triton is first imported; moe_lib imports its kernel modules lazily.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile's caches of this run only: a cache key names a custom op but not its schema, so graphs cached before
# an op changed its outputs would replay there (notes/p2/engine-layer.md, "Gradients over the saved pre-activations")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-lab-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def poisoned(monkeypatch):
    """P1's outputs and workspaces (every ``moe_lib.swiglu_down.runtime.allocate``) start as NaN: what comes back
    was written by the kernels."""
    from moe_lib.swiglu_down import runtime

    def nan_filled(size, *, dtype, device):
        return torch.full(size, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(runtime, "allocate", nan_filled)


@pytest.fixture
def nan_workspaces(monkeypatch):
    """P2's outputs and workspaces (``moe_lib.moe_experts.runtime.allocate`` and the slot-row sum's) start as NaN:
    what comes back was written by the kernels."""
    from moe_lib.moe_experts import runtime, slot_sum

    def nan_filled(size, *, dtype, device):
        return torch.full(size, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(runtime, "allocate", nan_filled)
    monkeypatch.setattr(slot_sum, "allocate", nan_filled)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure), so every run draws new inputs.
    Set MOE_TEST_SEED to replay one."""
    value = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={value}")
    return value


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (0 when both are zero); NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def join_ranks(processes, timeout_s: float) -> None:
    """Starts the rank processes and waits for all of them: fails naming the ranks that hang past
    ``timeout_s`` (killed) or that exited with an error (an abort, or its traceback is above)."""
    import time

    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    assert not hung, f"ranks {hung} did not finish within {timeout_s} s"
    assert [p.exitcode for p in processes] == [0] * len(processes), "a rank died (an abort, or its traceback is above)"
