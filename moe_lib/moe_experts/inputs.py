"""P2's inputs drawn with the benchmark's distributions, and the routings the tests and benchmarks use.

grad_output and hidden_states ``randn``; each token picks K distinct experts (uniformly: the
benchmark's); topk_weights ``softmax(randn)`` over K; expert weights ``randn·0.02``.
"""

from __future__ import annotations

import torch

from ..swiglu_down.inputs import normal

ROUTINGS = ("uniform", "skewed", "hot")
WEIGHT_STD = 0.02  # the expert weights' standard deviation (the benchmark's)


def route_tokens(
    num_tokens, num_experts, top_k, *, routing="uniform", device="cpu", generator=None, skew: float = 1.2
) -> torch.Tensor:
    """[num_tokens, top_k] int64 expert indices, K distinct experts per token.

    "uniform": a random permutation's first K (the benchmark's); "skewed": Gumbel-top-k over
    Zipf-like popularities ``rank^-skew`` (a few hot experts, many cold); "hot": every token on the
    same K experts, in a random order per token.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
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


def make_inputs(
    sizes: dict, dtype: torch.dtype, device, generator: torch.Generator, *, routing: str = "uniform"
) -> dict:
    """The seven inputs of ``moe_experts_backward`` for the axis values ``sizes``, in the definition's order.

    topk_weights are fp32 for bf16 inputs (as routers produce them), the input dtype otherwise.
    """
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    E, K = sizes["num_experts"], sizes["top_k"]
    if K > E:
        raise ValueError(f"top_k: {K} exceeds num_experts={E}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
    topk_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    grad_output = normal((T, H), 1.0, dtype, device, generator)
    hidden_states = normal((T, H), 1.0, dtype, device, generator)
    topk_indices = route_tokens(T, E, K, routing=routing, device=device, generator=generator)
    logits_dtype = torch.float32 if topk_dtype != torch.float64 else topk_dtype
    topk_weights = torch.softmax(normal((T, K), 1.0, logits_dtype, device, generator), dim=-1).to(topk_dtype)
    gate_weights = normal((E, I, H), WEIGHT_STD, dtype, device, generator)
    up_weights = normal((E, I, H), WEIGHT_STD, dtype, device, generator)
    down_weights = normal((E, H, I), WEIGHT_STD, dtype, device, generator)
    return dict(
        grad_output=grad_output,
        hidden_states=hidden_states,
        topk_indices=topk_indices,
        topk_weights=topk_weights,
        gate_weights=gate_weights,
        up_weights=up_weights,
        down_weights=down_weights,
    )
