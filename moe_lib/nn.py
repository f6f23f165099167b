"""``nn.Module``s over the layers: :class:`SwiGLUExpert` (one expert) and :class:`MoEExperts` (all routed experts).

Parameters in the layout of Hugging Face's expert modules (transformers 5: Qwen3-MoE, Mixtral, DeepSeek-V3, ...):
the gate and up projections fused in one ``gate_up_proj`` (gate rows first, then up rows) and the down projection
in ``down_proj``, each stored as ``[out_features, in_features]`` like ``nn.Linear.weight``:

    SwiGLUExpert   gate_up_proj [2I, H]      down_proj [H, I]
    MoEExperts     gate_up_proj [E, 2I, H]   down_proj [E, H, I]

so a ``MoEExperts``' state dict loads into those models' ``mlp.experts`` and back, names and shapes alike. The
forward hands :func:`moe_lib.moe_experts_gate_up` the fused ``gate_up_proj`` whole (the grouped engine reads it
as it lies and writes its gradient as one block; the other paths copy the halves contiguous), and
:func:`moe_lib.swiglu_expert` its two row halves as views (contiguous already). The routing is left to the
caller, as in the functional API:
``MoEExperts`` takes the token-to-expert assignment (``topk_indices``, ``topk_weights``) with the hidden states.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .dispatch import check_impl
from .moe_experts import moe_experts_gate_up
from .moe_experts.weights import split_gate_up
from .swiglu_down import swiglu_expert
from .swiglu_down.checks import check_precision
from .validation import flag


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _init_like_linear(weight: torch.Tensor, in_features: int) -> None:
    """nn.Linear's default: uniform in ±1/√in_features (its kaiming_uniform with a = √5), per expert alike."""
    bound = 1 / math.sqrt(in_features)
    nn.init.uniform_(weight, -bound, bound)


class SwiGLUExpert(nn.Module):
    """One SwiGLU expert, y = down_proj · (silu(g) ⊙ u) with [g; u] = gate_up_proj · x, for x [..., H].

    ``impl`` and ``precision`` are those of :func:`moe_lib.swiglu_expert` ("fast": the intermediate gradients
    rounded to the input dtype, as training frameworks do). A dense MLP with separate ``gate_proj``/``up_proj``
    weights maps onto it by ``gate_up_proj = torch.cat([gate_proj.weight, up_proj.weight])``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        impl: str = "auto",
        precision: str = "fast",
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size = _positive("hidden_size", hidden_size)
        self.intermediate_size = _positive("intermediate_size", intermediate_size)
        check_impl(impl)
        check_precision(precision)
        self.impl, self.precision = impl, precision
        factory = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_like_linear(self.gate_up_proj, self.hidden_size)
        _init_like_linear(self.down_proj, self.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_expert(
            x, *split_gate_up(self.gate_up_proj), self.down_proj, impl=self.impl, precision=self.precision
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, impl={self.impl!r}, "
            f"precision={self.precision!r}"
        )


class MoEExperts(nn.Module):
    """All routed SwiGLU experts of one MoE layer: y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t),
    e = topk_indices[t, k], for hidden_states [..., H] and topk_indices, topk_weights [..., K].

    ``impl``, ``validate`` and ``save_activations`` are those of :func:`moe_lib.moe_experts`. ``validate=True``
    checks the expert ids on every call (one host sync); a router's top-k gives valid ids by construction, so
    training code that wants no host sync in its step (CUDA graphs, ``mode="reduce-overhead"``) passes False.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        impl: str = "auto",
        validate: bool = True,
        save_activations: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.num_experts = _positive("num_experts", num_experts)
        self.hidden_size = _positive("hidden_size", hidden_size)
        self.intermediate_size = _positive("intermediate_size", intermediate_size)
        check_impl(impl)
        self.impl = impl
        self.validate = flag("validate", validate)
        self.save_activations = flag("save_activations", save_activations)
        factory = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_like_linear(self.gate_up_proj, self.hidden_size)
        _init_like_linear(self.down_proj, self.intermediate_size)

    def forward(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        arguments = (hidden_states, topk_indices, topk_weights)
        lead = None
        if all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in arguments):  # [..., n] → [T, n]
            lead = hidden_states.shape[:-1]
            arguments = tuple(t.reshape(-1, t.shape[-1]) for t in arguments)
        y = moe_experts_gate_up(
            *arguments,
            self.gate_up_proj,
            self.down_proj,
            impl=self.impl,
            validate=self.validate,
            save_activations=self.save_activations,
        )
        return y if lead is None else y.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, impl={self.impl!r}, validate={self.validate}, "
            f"save_activations={self.save_activations}"
        )
