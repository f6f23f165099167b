"""What P2's host side shares and no design owns: the allocation hook, the target, the persistent grid, dtypes.

A leaf: the designs (:mod:`.designs`), the chooser and the launches import it; it imports none of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..precision import split_halves

# Every output and workspace is allocated through this function (tests replace it with one that fills the memory
# with NaN, to prove that every element the kernels read or return was written).
allocate = torch.empty


def allocate_preactivations(num_slots: int, intermediate_size: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved pre-activations (g, u), [max(T·K, 1), I] each: the two column halves of one [rows, 2I] buffer, so
    that the layer's op hands them to its backward as one tensor, which the engine's backward may write [dg | du]
    over (:func:`.engine_layer.halves_of_one`)."""
    together = allocate((max(num_slots, 1), 2 * intermediate_size), dtype=dtype, device=device)
    return together[:, :intermediate_size], together[:, intermediate_size:]


# the tensor-core operand dtype of each interface dtype: fp32 inputs are multiplied as bf16 (hi + lo halves in A)
OPERAND_DTYPES = {torch.float32: tl.bfloat16, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# the dtype of kernel A's dg, du, aw workspaces and of the operands kernels W and D read, per interface dtype
WORKSPACE_DTYPES = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
# kernel W's products: "plain", one product of operands in the workspace dtype; "bf16x3" (fp32 inputs), hi·hi +
# hi·lo + lo·hi of bf16 halves v = hi + lo of x, dy, dg, du and aw (kernel A then also stores dg, du, aw's lo halves)
PLAIN_PRODUCTS, SPLIT_PRODUCTS = "plain", "bf16x3"
WEIGHT_GRAD_PRODUCTS = (PLAIN_PRODUCTS, SPLIT_PRODUCTS)


@dataclass(frozen=True)
class Target:
    """Where the kernels run, as far as a design's needs go: Triton's CPU interpreter, or a CUDA GPU of a
    compute capability (Hopper by default: the H100 and H200 the configs were measured on)."""

    interpreter: bool = False
    capability: tuple[int, int] = (9, 0)

    @classmethod
    def of(cls, device: torch.device) -> Target:
        """The target of tensors on ``device``: the interpreter wherever it is switched on or there is no GPU."""
        if interpreter_enabled() or device.type != "cuda":
            return cls(interpreter=True)
        return _cuda_target(_device_index(device))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# a GPU's properties do not change while the process runs: read once per device, not on every call
@functools.cache
def _cuda_target(index: int) -> Target:
    return Target(capability=torch.cuda.get_device_capability(index))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def operand_halves(v: torch.Tensor, split_precision: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel A's (hi, lo) view of x or dy: bf16 halves for fp32 inputs, the 16-bit tensor itself twice otherwise."""
    return split_halves(v, dtype) if split_precision else (v, v)


def products_text(products: str) -> str:
    """What a launch plan adds for kernel W's ``products``: nothing for plain ones."""
    if products not in WEIGHT_GRAD_PRODUCTS:
        raise ValueError(f"products: expected one of {WEIGHT_GRAD_PRODUCTS}, got {products!r}")
    return ", as bf16×3 products of hi and lo halves (hi·hi + hi·lo + lo·hi)" if products == SPLIT_PRODUCTS else ""


def default_persistent_programs() -> int:
    """Programs of a persistent launch where no device is at hand: a few under the interpreter, else the
    132 SMs of an H100 or H200."""
    return 3 if interpreter_enabled() else 132


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM on the GPU, a few under the interpreter."""
    if device.type != "cuda" or interpreter_enabled():
        return default_persistent_programs()
    return _cuda_sms(_device_index(device))


def dtype_reason(dtype: torch.dtype) -> str | None:
    """Why the kernels cannot take inputs of ``dtype`` (None: they can)."""
    if dtype not in WORKSPACE_DTYPES:
        return f"dtype {dtype}: the kernels take float32, bfloat16 or float16"
    return None


def tma_reason(target: Target, rows: dict[str, tuple[int, torch.dtype]]) -> str | None:
    """Why a TMA-fed kernel cannot run on ``target`` over ``rows`` (what they are -> elements and dtype of one):
    TMA is the copy engine of Hopper and later GPUs, and it moves rows of whole multiples of 16 bytes only."""
    if not target.interpreter and target.capability < (9, 0):
        major, minor = target.capability
        return f"TMA needs a GPU of compute capability 9.0 (Hopper) or later, got {major}.{minor}"
    for name, (width, dtype) in rows.items():
        if width * dtype.itemsize % 16:
            return (
                f"{name} = {width} {str(dtype).removeprefix('torch.')} elements ({width * dtype.itemsize} bytes) "
                "are no multiple of 16 bytes, as TMA needs"
            )
    return None
