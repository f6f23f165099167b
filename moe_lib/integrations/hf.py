"""Hugging Face transformers drop-in: moe_lib's experts behind transformers' own extension point.

transformers 5 picks the implementation of a MoE model's experts by name: its expert modules (Qwen3-MoE, Mixtral,
DeepSeek-V3, OLMoE, ..., those decorated ``@use_experts_implementation``) look their forward up in
``ExpertsInterface`` under ``config._experts_implementation`` ("eager", "grouped_mm", ...). :func:`register` adds
moe_lib's under the name "moe_lib"; after it, ``model.set_experts_implementation("moe_lib")`` or
``from_pretrained(..., experts_implementation="moe_lib")`` selects it, as for transformers' own.
:func:`apply_moe_lib` does both for a model and sets moe_lib's options (``impl``, ``save_activations``).

The experts keep their parameters (``gate_up_proj`` [E, 2I, H], gate rows first; ``down_proj`` [E, H, I]: the
layout of :class:`moe_lib.nn.MoEExperts`): the forward hands :func:`moe_lib.moe_experts_gate_up` them as they
lie, so checkpoints, optimizers and the routing stay the model's. Supported: SiLU-gated experts in that layout without
biases; others are refused by name. The router's top-k gives each token distinct, in-range experts by
construction, so the ids are not validated per call (no host sync in the step).
"""

from __future__ import annotations

import torch
from torch import nn

from ..dispatch import check_impl
from ..moe_experts import moe_experts_gate_up
from ..validation import flag

try:
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as hf_moe
    from transformers.integrations.moe import ExpertsInterface
except ImportError as error:  # transformers < 5 has no experts interface
    raise ImportError(
        "moe_lib.integrations.hf needs transformers 5 (its ExpertsInterface): pip install 'moe_lib[hf]'"
    ) from error

EXPERTS_IMPLEMENTATION = "moe_lib"
DEFAULT_OPTIONS = dict(impl="auto", save_activations=False)


def register() -> None:
    """Adds moe_lib's experts forward to transformers' ``ExpertsInterface`` as "moe_lib" (for every model)."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of transformers' expert modules that select their forward by name."""
    return hasattr(module, "is_transposed") and hasattr(module, "gate_up_proj") and hasattr(module, "config")


def unsupported_reason(module: nn.Module) -> str | None:
    """Why moe_lib cannot run ``module``'s experts (None where it can)."""
    if not getattr(module, "has_gate", False) or not getattr(module, "is_concatenated", True):
        return "its experts are not gated with [gate; up] fused in gate_up_proj"
    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed ([E, H, 2I])"
    if getattr(module, "has_bias", False):
        return "its experts have biases"
    if not isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)):
        return f"its activation is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is not getattr(hf_moe, "_default_apply_gate", gate):  # silu(gate) ⊙ up or other
        return "it gates with its own _apply_gate"
    return None


def experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts forward transformers calls for ``experts_implementation="moe_lib"``: hidden_states [T, H],
    top_k_index and top_k_weights [T, K] → [T, H], as its "eager" and "grouped_mm" forwards."""
    reason = unsupported_reason(module)
    if reason is not None:
        raise NotImplementedError(f"experts_implementation='moe_lib': {type(module).__name__}: {reason}")
    options = getattr(module, "moe_lib_options", DEFAULT_OPTIONS)
    return moe_experts_gate_up(
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        impl=options["impl"],
        validate=False,
        save_activations=options["save_activations"],
    )


def apply_moe_lib(model: nn.Module, *, impl: str = "auto", save_activations: bool = False) -> nn.Module:
    """Runs every expert module of a transformers ``model`` on moe_lib: registers "moe_lib" with transformers, sets
    the options on each expert module and selects it (``model.set_experts_implementation("moe_lib")``). Returns
    the model (changed in place); ``model.set_experts_implementation("eager")`` (or another name) switches back.
    Raises a ValueError naming the first expert module moe_lib cannot run, or when the model has none."""
    check_impl(impl)
    flag("save_activations", save_activations)
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    experts = {name: module for name, module in model.named_modules() if is_experts_module(module)}
    if not experts:
        raise ValueError(
            f"model: {type(model).__name__} has no expert modules that select their implementation "
            "by name (transformers' @use_experts_implementation)"
        )
    for name, module in experts.items():
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"model: {name} ({type(module).__name__}): {reason}")
    register()
    for module in experts.values():
        module.moe_lib_options = dict(impl=impl, save_activations=save_activations)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model
