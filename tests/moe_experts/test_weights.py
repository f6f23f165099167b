"""The fused gate_up layout (``moe_lib/moe_experts/weights.py``): its halves split as views and found back."""

import torch

from moe_lib.moe_experts.weights import split_gate_up, stacked_gate_up


def test_split_halves_are_views_found_back_as_the_whole_block():
    for E in (1, 3):
        fused = torch.randn(E, 8, 4)
        gate, up = split_gate_up(fused)
        assert torch.equal(gate, fused[:, :4]) and torch.equal(up, fused[:, 4:])
        block = stacked_gate_up(gate, up)
        assert block is not None and block.is_contiguous() and block.data_ptr() == fused.data_ptr()
        assert torch.equal(block, fused)
        assert stacked_gate_up(fused[:, :4], fused[:, 4:]) is not None  # slices too


def test_weights_of_their_own_are_not_a_block():
    fused = torch.randn(3, 8, 4)
    gate, up = split_gate_up(fused)
    assert stacked_gate_up(up, gate) is None  # up rows first
    assert stacked_gate_up(gate.contiguous(), up.contiguous()) is None
    assert stacked_gate_up(gate, fused.clone()[:, 4:]) is None  # another storage
    assert stacked_gate_up(fused[:, :3], fused[:, 5:]) is None  # not adjacent halves
    assert stacked_gate_up(gate, up.double()) is None
    wider = torch.randn(3, 10, 4)  # [gate; up; 2 more rows]: rows 2I·H apart no longer
    assert stacked_gate_up(wider[:, :4], wider[:, 4:8]) is None
    meta = torch.empty(3, 8, 4, device="meta")
    assert stacked_gate_up(*split_gate_up(meta)) is None
    assert stacked_gate_up(torch.empty(0, 4, 4), torch.empty(0, 4, 4)) is None
