"""The engine layer's routing of one call, packed in one int32 tensor, made by three launches instead of a dozen.

Slots s = t·K + k sorted by expert, stably (position p holds slot sorted_slot[p]), then, for S = T·K slots:

    offsets[e]         = first position of expert e (searchsorted; offsets[E] = S)        [E + 1]
    token_of_row[p]    = sorted_slot[p] // K                                              [S]
    row_of_slot[s]     = p where sorted_slot[p] = s  (the inverse permutation)            [S]
    scale[p]           = topk_weights.flat[sorted_slot[p]] in fp32, kept by its bits      [S]

    packed = [offsets | token_of_row | row_of_slot | scale]                                int32 [E + 1 + 3·S]

The sort and the search are torch's; one Triton kernel writes the last three parts from sorted_slot (each program a
block of positions: two stores and a scatter of distinct slots, so no two programs write one element). Each small
torch op costs the host a dispatch, and mostly an allocation and a launch, on every layer call
(notes/p2/host-time.md); the readable form with those ops, :func:`packed_routing_reference`, is the one the tests
compare with. Nothing is read back to the host: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from .routing import expert_ids, route_by_expert

BLOCK = 1024  # positions per program
# the packed tensor is allocated through this function (tests replace it with one that fills it with -1)
allocate = torch.empty


@triton.jit
def routed_rows_kernel(
    sorted_slot_ptr,  # [S] int64: the slot ids t·K + k in expert order (torch.sort's indices)
    weights_ptr,  # [S] the routing weights topk_weights [T, K] flattened, any float dtype
    token_of_row_ptr,  # out [S] int32: token_of_row[p] = sorted_slot[p] // K
    row_of_slot_ptr,  # out [S] int32: row_of_slot[sorted_slot[p]] = p
    scale_ptr,  # out [S] fp32: scale[p] = weights[sorted_slot[p]]
    num_slots,  # S = T·K
    top_k,  # K
    BLOCK: tl.constexpr,
):
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_slots
    slot = tl.load(sorted_slot_ptr + positions, mask=inside, other=0)
    tl.store(token_of_row_ptr + positions, (slot // top_k).to(tl.int32), mask=inside)
    tl.store(row_of_slot_ptr + slot, positions.to(tl.int32), mask=inside)
    weight = tl.load(weights_ptr + slot, mask=inside, other=0.0)
    tl.store(scale_ptr + positions, weight.to(tl.float32), mask=inside)


def packed_size(num_slots: int, num_experts: int) -> int:
    return num_experts + 1 + 3 * num_slots


def packed_routing(topk_indices: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E + 1 + 3·T·K]: the routing of ``topk_indices`` [T, K] (expert ids in [0, E)) with ``topk_weights``
    [T, K] packed as the module's docstring lays it out. The kernel on CUDA (and under the interpreter), the
    reference's torch ops elsewhere."""
    if not (topk_indices.is_cuda or interpreter_enabled()) or topk_indices.numel() == 0:
        return packed_routing_reference(topk_indices, topk_weights, num_experts)
    flat = topk_indices.reshape(-1)
    slots = flat.numel()
    packed = allocate(packed_size(slots, num_experts), dtype=torch.int32, device=flat.device)
    offsets, token_of_row, row_of_slot, scale = packed.split((num_experts + 1, slots, slots, slots))
    sorted_experts, sorted_slot = torch.sort(flat, stable=True)
    torch.searchsorted(sorted_experts, expert_ids(num_experts, flat), out_int32=True, out=offsets)
    routed_rows_kernel[(cdiv(slots, BLOCK),)](
        sorted_slot,
        topk_weights.reshape(-1),
        token_of_row,
        row_of_slot,
        scale.view(torch.float32),
        slots,
        topk_indices.shape[1],
        BLOCK=BLOCK,
        num_warps=4,
    )
    return packed


def packed_routing_reference(topk_indices: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """:func:`packed_routing` with torch's ops, one part after another."""
    top_k = topk_indices.shape[1]
    routing = route_by_expert(topk_indices, num_experts)
    sorted_slot = routing.sorted_slot
    token_of_row = torch.div(sorted_slot, max(top_k, 1), rounding_mode="floor")
    row_of_slot = torch.empty_like(sorted_slot)
    row_of_slot[sorted_slot] = torch.arange(sorted_slot.numel(), device=sorted_slot.device, dtype=torch.int32)
    scale = topk_weights.reshape(-1)[sorted_slot].float()
    return torch.cat((routing.expert_offsets, token_of_row, row_of_slot, scale.view(torch.int32)))
