"""The engine layer's packed routing (``moe_lib/moe_experts/packed_routing.py``): the kernel's parts against the
readable torch form and against what a routing must be (every slot once, experts in order, stable within one).

CPU: the kernel under the interpreter, its output first filled with -1 (a NaN scale), fresh routings each run; GPU
(``gpu``): the compiled kernel at a model's size.
"""

from __future__ import annotations

import pytest
import torch

from moe_lib.moe_experts import packed_routing as pr
from moe_lib.moe_experts.inputs import route_tokens


@pytest.fixture
def poisoned_packing(monkeypatch):
    def filled(size, *, dtype, device):
        return torch.full((size,), -1, dtype=dtype, device=device)

    monkeypatch.setattr(pr, "allocate", filled)


def parts(packed, T, K, E):
    S = T * K
    offsets, token_of_row, row_of_slot, scale = packed.split((E + 1, S, S, S))
    return offsets, token_of_row, row_of_slot, scale.view(torch.float32)


def check_is_the_routing(packed, indices, weights, E):
    """What any correct packing of this routing is, independent of how it was made."""
    T, K = indices.shape
    offsets, token_of_row, row_of_slot, scale = (p.cpu() for p in parts(packed, T, K, E))
    flat, w = indices.reshape(-1).cpu().long(), weights.reshape(-1).cpu().float()
    counts = torch.bincount(flat, minlength=E)
    assert offsets[0] == 0 and torch.equal((offsets[1:] - offsets[:-1]).long(), counts)
    slot_of_row = torch.empty(T * K, dtype=torch.long)
    slot_of_row[row_of_slot.long()] = torch.arange(T * K)  # a permutation: each row once
    assert torch.equal(torch.sort(row_of_slot.long()).values, torch.arange(T * K))
    assert torch.equal(token_of_row.long(), slot_of_row // K)
    assert torch.equal(scale, w[slot_of_row])
    experts = flat[slot_of_row]
    assert torch.all(experts[1:] >= experts[:-1])  # grouped by expert, in expert order
    same = experts[1:] == experts[:-1]
    assert torch.all(slot_of_row[1:][same] > slot_of_row[:-1][same])  # stable: slots in order within an expert


@pytest.mark.parametrize(
    "T, E, K, routing, index_dtype, weight_dtype",
    [
        (13, 5, 2, "uniform", torch.int64, torch.float32),
        (24, 7, 3, "skewed", torch.int32, torch.bfloat16),  # experts without rows
        (9, 3, 1, "uniform", torch.int64, torch.float32),
        (20, 4, 2, "hot", torch.int64, torch.float16),
        (700, 64, 3, "uniform", torch.int64, torch.float32),  # 2100 slots: three programs, the last one partial
    ],
)
def test_packed_routing_equals_the_torch_form(T, E, K, routing, index_dtype, weight_dtype, seed, poisoned_packing):
    generator = torch.Generator().manual_seed(seed)
    indices = route_tokens(T, E, K, routing=routing, generator=generator).to(index_dtype)
    weights = torch.softmax(torch.randn(T, K, generator=generator), dim=-1).to(weight_dtype)
    packed = pr.packed_routing(indices, weights, E)
    assert packed.dtype == torch.int32 and packed.shape == (pr.packed_size(T * K, E),)
    assert torch.equal(packed, pr.packed_routing_reference(indices, weights, E))
    check_is_the_routing(packed, indices, weights, E)


def test_no_tokens_gives_zero_offsets():
    packed = pr.packed_routing(torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), 4)
    assert torch.equal(packed, torch.zeros(5, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("T, E, K", [(8192, 64, 8), (2048, 256, 8), (1000, 128, 6)])
def test_gpu_packed_routing_equals_the_torch_form(T, E, K, seed, poisoned_packing):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    indices = route_tokens(T, E, K, device="cuda", generator=generator)
    weights = torch.softmax(torch.randn(T, K, device="cuda", generator=generator), dim=-1).to(torch.bfloat16)
    packed = pr.packed_routing(indices, weights, E)
    assert torch.equal(packed, pr.packed_routing_reference(indices, weights, E))
    check_is_the_routing(packed, indices, weights, E)
