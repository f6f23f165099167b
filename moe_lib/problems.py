"""The two problems, defined once as data in ``data/problems/<name>/``.

Each problem folder holds a SOL-ExecBench-style ``definition.json`` (name, description, axes,
inputs, outputs, reference source) and ``workloads.jsonl`` (one case per line). This module reads
them and draws seeded inputs with the benchmark's distributions, on any device:

- ``swiglu_down_backward`` (P1): weights ``randn/√fan_in``; x and grad_output ``randn/√H``; the
  saved tensors from the forward, each rounded to the dtype.
- ``moe_experts_backward`` (P2, fp32) and ``moe_experts_backward_bf16``: grad_output and
  hidden_states ``randn``; each token picks K distinct experts uniformly; topk_weights
  ``softmax(randn)`` over K; expert weights ``randn·0.02``.

>>> problem = load("swiglu_down_backward")
>>> inputs = problem.make_inputs(num_tokens=4, seed=0, hidden_size=64, intermediate_size=32)
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import reference

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PROBLEMS_DIR = DATA_DIR / "problems"
PROBLEM_NAMES = ("swiglu_down_backward", "moe_experts_backward", "moe_experts_backward_bf16")
ROUTINGS = ("uniform", "skewed", "hot")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Problem:
    """One problem as its definition and workloads describe it."""

    name: str
    op: str  # the moe_lib function that computes it
    description: str
    axes: dict
    inputs: dict
    outputs: dict
    reference_source: str
    workloads: list = field(repr=False)
    suite_provenance: str = "benchmark"  # "benchmark" or "assumed"

    @property
    def suite(self) -> list[int]:
        """The workload suite's token counts, in the file's order."""
        return [w["axes"]["num_tokens"] for w in self.workloads]

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the problem's main inputs."""
        return DTYPES[next(iter(self.inputs.values()))["dtype"]]

    def sizes(self, num_tokens: int, **overrides) -> dict:
        """Every axis's value: the constants, ``num_tokens``, and any overrides (for small shapes)."""
        unknown = set(overrides) - set(self.axes)
        if unknown:
            raise ValueError(f"{sorted(unknown)}: not axes of {self.name} (axes: {sorted(self.axes)})")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected an integer >= 0, got {num_tokens!r}")
        sizes = {name: axis["value"] for name, axis in self.axes.items() if axis["type"] == "const"}
        sizes["num_tokens"] = num_tokens
        for name, value in overrides.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        sizes.update(overrides)
        return sizes

    def make_inputs(self, num_tokens: int, *, seed: int = 0, device="cpu", dtype=None,
                    routing: str = "uniform", **axes) -> dict:  # fmt: skip
        """Seeded inputs with the benchmark's distributions, as an ordered dict name -> tensor.

        ``dtype`` overrides the floating dtype (e.g. float64 for exact checks); ``axes`` overrides
        the constant axes (e.g. ``hidden_size=64``) to draw small cases. For P2, ``routing`` is
        "uniform" (the benchmark's), "skewed" (Zipf-like expert popularity) or "hot" (every token on
        the same K experts).
        """
        sizes = self.sizes(num_tokens, **axes)
        dtype = self.dtype if dtype is None else dtype
        generator = torch.Generator(device=device).manual_seed(seed)
        if self.op == "swiglu_down_backward":
            return _swiglu_down_backward_inputs(sizes, dtype, device, generator)
        if routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
        topk_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        return _moe_experts_backward_inputs(sizes, dtype, topk_dtype, device, generator, routing)


@functools.cache
def load(name: str) -> Problem:
    """The problem ``name`` (one of :data:`PROBLEM_NAMES`) read from ``data/problems``."""
    if name not in PROBLEM_NAMES:
        raise ValueError(f"problem: expected one of {PROBLEM_NAMES}, got {name!r}")
    folder = PROBLEMS_DIR / name
    definition = json.loads((folder / "definition.json").read_text())
    with open(folder / "workloads.jsonl") as lines:
        workloads = [json.loads(line) for line in lines if line.strip()]
    return Problem(
        name=definition["name"],
        op=definition["op"],
        description=definition["description"],
        axes=definition["axes"],
        inputs=definition["inputs"],
        outputs=definition["outputs"],
        reference_source=definition["reference"],
        workloads=workloads,
        suite_provenance=definition.get("suite_provenance", "benchmark"),
    )


def make_inputs(name: str, num_tokens: int, **kwargs) -> dict:
    """Shorthand for ``load(name).make_inputs(num_tokens, **kwargs)``."""
    return load(name).make_inputs(num_tokens, **kwargs)


def _normal(shape, std, dtype, device, generator):
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)


def _swiglu_down_backward_inputs(sizes, dtype, device, generator) -> dict:
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    gate_weight = _normal((I, H), 1 / math.sqrt(H), dtype, device, generator)
    up_weight = _normal((I, H), 1 / math.sqrt(H), dtype, device, generator)
    down_weight = _normal((H, I), 1 / math.sqrt(I), dtype, device, generator)
    x = _normal((T, H), 1 / math.sqrt(H), dtype, device, generator)
    grad_output = _normal((T, H), 1 / math.sqrt(H), dtype, device, generator)
    _, saved = reference.swiglu_expert_forward_reference(x, gate_weight, up_weight, down_weight)
    return dict(grad_output=grad_output, x=x, gate_weight=gate_weight, up_weight=up_weight,
                down_weight=down_weight, **saved)  # fmt: skip


def route_tokens(num_tokens, num_experts, top_k, *, routing="uniform", device="cpu", generator=None,
                 skew: float = 1.2) -> torch.Tensor:  # fmt: skip
    """[num_tokens, top_k] int64 expert indices, K distinct experts per token.

    "uniform": a random permutation's first K (the benchmark's); "skewed": Gumbel-top-k over
    Zipf-like popularities ``rank^-skew`` (a few hot experts, many cold); "hot": every token on the
    same K experts, in a random order per token.
    """
    if num_tokens == 0:
        return torch.empty((0, top_k), dtype=torch.int64, device=device)
    if routing == "hot":
        chosen = torch.randperm(num_experts, generator=generator, device=device)[:top_k]
        order = torch.rand((num_tokens, top_k), generator=generator, device=device).argsort(dim=1)
        return chosen[order]
    scores = torch.rand((num_tokens, num_experts), generator=generator, device=device)
    if routing == "skewed":
        rank = torch.arange(1, num_experts + 1, device=device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(scores.clamp_min(1e-20)))
        scores = -skew * torch.log(rank) + gumbel
    return scores.argsort(dim=1, descending=True)[:, :top_k].contiguous()


def _moe_experts_backward_inputs(sizes, dtype, topk_dtype, device, generator, routing) -> dict:
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    E, K = sizes["num_experts"], sizes["top_k"]
    if K > E:
        raise ValueError(f"top_k: {K} exceeds num_experts={E}")
    grad_output = _normal((T, H), 1.0, dtype, device, generator)
    hidden_states = _normal((T, H), 1.0, dtype, device, generator)
    topk_indices = route_tokens(T, E, K, routing=routing, device=device, generator=generator)
    topk_logits = _normal((T, K), 1.0, torch.float32 if topk_dtype != torch.float64 else topk_dtype,
                          device, generator)  # fmt: skip
    topk_weights = torch.softmax(topk_logits, dim=-1).to(topk_dtype)
    gate_weights = _normal((E, I, H), 0.02, dtype, device, generator)
    up_weights = _normal((E, I, H), 0.02, dtype, device, generator)
    down_weights = _normal((E, H, I), 0.02, dtype, device, generator)
    return dict(grad_output=grad_output, hidden_states=hidden_states, topk_indices=topk_indices,
                topk_weights=topk_weights, gate_weights=gate_weights, up_weights=up_weights,
                down_weights=down_weights)  # fmt: skip
