"""What both problems' TMA-fed kernels need on the host: which operands TMA can address, and an allocator for the
descriptors kernels build on the device.

A TMA copy (the Hopper tensor memory accelerator) moves a tile between global and shared memory given a
descriptor of the whole tensor; the descriptor needs every row stride to be a multiple of 16 bytes
(:func:`rows_fit`) and the tensor's start address on a 16-byte boundary (:func:`aligned`). A kernel that calls
``tl.make_tensor_descriptor`` writes each descriptor (128 bytes) into global scratch memory that Triton asks the
host for at launch, through the allocator set with ``triton.set_allocator`` (:func:`install_tma_allocator`).
"""

import torch


def rows_fit(*row_lengths: int, element_bytes: int) -> bool:
    """Whether TMA can address rows of these many elements of ``element_bytes`` each: 16-byte multiples."""
    return all((length * element_bytes) % 16 == 0 for length in row_lengths)


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether each tensor starts on a 16-byte boundary, as a TMA copy's global address must (a view into a larger
    tensor need not)."""
    return all(tensor.data_ptr() % 16 == 0 for tensor in tensors)


def install_tma_allocator(device: torch.device) -> None:
    """Gives Triton a torch-backed allocator (graph-capturable) for the descriptors kernels build on the
    device. Set on every launch: Triton keeps it per context, and autograd runs a backward in a thread of
    its own (this replaces an allocator the caller set in that context, any of which would serve)."""
    import triton  # only where a TMA kernel is about to run

    def allocate(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(allocate)
