"""What both problems' TMA-fed kernels need on the host: an allocator for the descriptors they build on the device.

A kernel that calls ``tl.make_tensor_descriptor`` writes each descriptor (128 bytes) into global scratch memory
that Triton asks the host for at launch, through the allocator set with ``triton.set_allocator``.
"""

import torch
import triton


def install_tma_allocator(device: torch.device) -> None:
    """Gives Triton a torch-backed allocator (graph-capturable) for the descriptors kernels build on the
    device. Set on every launch: Triton keeps it per context, and autograd runs a backward in a thread of
    its own (this replaces an allocator the caller set in that context, any of which would serve)."""

    def allocate(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(allocate)
