"""Routing metadata for the grouped expert kernels, built on the device without host synchronisation.

A token t sends its hidden state to K experts; slot s = t·K + k is the flat index of (t, k) in
``topk_indices`` and ``topk_weights``. The kernels walk the slots expert by expert:

    sorted_slot     = stable argsort of topk_indices.flatten()        [T·K]   slot ids in expert order
    expert_offsets  = searchsorted(sorted experts, [0, 1, …, E])      [E + 1] rows of expert e are the
                      sorted positions offsets[e] ≤ p < offsets[e + 1]; its count is the difference

Every shape here depends on T, K and E only (never on the routing), nothing is read back to the
host, and no atomics are used, so the metadata is deterministic and can be captured in a CUDA
graph. Expert indices must lie in [0, E) (``validate=True`` in :mod:`moe_lib.api` checks that);
slots routed outside that range would belong to no expert and be left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertRouting:
    sorted_slot: torch.Tensor  # [T·K] int32: flat slot ids t·K + k, grouped by expert, by token within one
    expert_offsets: torch.Tensor  # [E + 1] int32: first sorted position of each expert, then T·K

    @property
    def counts(self) -> torch.Tensor:
        """[E] int32: how many slots each expert received."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


def route_by_expert(topk_indices: torch.Tensor, num_experts: int) -> ExpertRouting:
    """Group the slots of ``topk_indices`` [T, K] (int64 or int32) by expert, on its device."""
    flat = topk_indices.reshape(-1)
    sorted_experts, sorted_slot = torch.sort(flat, stable=True)
    expert_offsets = torch.searchsorted(sorted_experts, expert_ids(num_experts, flat), out_int32=True)
    return ExpertRouting(sorted_slot=sorted_slot.to(torch.int32), expert_offsets=expert_offsets)


_EXPERT_IDS: dict = {}  # (E, device, dtype) -> [0, 1, …, E], made once: read only, never written


def expert_ids(num_experts: int, like: torch.Tensor) -> torch.Tensor:
    """[0, 1, …, num_experts] on ``like``'s device in its dtype: the experts' boundaries searched for, kept per
    (E, device, dtype) rather than made on every call (an allocation and a launch each)."""
    key = (num_experts, like.device, like.dtype)
    ids = _EXPERT_IDS.get(key)
    if ids is None:
        ids = torch.arange(num_experts + 1, device=like.device, dtype=like.dtype)
        # memory of a CUDA graph's private pool must not outlive the graph: made inside a capture, it is not kept
        if not (like.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _EXPERT_IDS[key] = ids
    return ids
