"""P1 on the vendor's GEMMs (cuBLAS, through ``torch.mm``) with the dSwiGLU step as one Triton pass.

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid), 16-bit inputs:

    dA           = dy · Wd                     [T, I]   cuBLAS, fp32 out (``d_a_fp32``; else the input dtype)
    dWd          = dyᵀ · intermediate          [H, I]   cuBLAS (on a second stream with ``streams``)
    [dG | dU]    = dSwiGLU(dA, saved)          [T, 2I]  one Triton pass (kernels.swiglu_grads_kernel):
                   dG = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dU = dA ⊙ gate_silu, side by side in each row
    dx           = [dG | dU] · [Wg; Wu]        [T, H]   one cuBLAS GEMM over K = 2I
    [dWg; dWu]   = [dG | dU]ᵀ · x              [2I, H]  one cuBLAS GEMM with M = 2I (on the second stream with
                                                        ``streams``); dWg and dWu are its two row halves

The faithful path (``with_lo``) keeps dG and dU as hi/lo pairs, each row [dG_hi | dU_hi | dG_lo | dU_lo]
([T, 4I]): dx is one GEMM over K = 4I against [Wg; Wu; Wg; Wu], and [dWg; dWu] the sum of the hi and lo
row halves of one fp32 GEMM with M = 4I. dA is then always kept in fp32, and dWd and dx come from fp32 products
rounded once: a 16-bit product may sum a split reduction's partials in 16 bits (cuBLAS's split-K, which PyTorch
allows by default), and at H = 1000, I = 300 from 1024 tokens dWd then failed the element rule.

Against the two Triton launches (:mod:`.kernels`): dA and dGate/dUp make a round trip through memory (2·T·I·4 +
2·T·2I·2 bytes more), and Wg, Wu are stacked once per call (6 MB at H = 2048, I = 768; no copy where they are the
two halves of one buffer, or with ``dx_in_two``; with ``stack_aside`` the copy runs on the second stream beside dA;
with ``stack_by_memcpy`` it is two device-to-device memcpys); in exchange every product runs at cuBLAS's rate, dx's
two halves and dWg, dWu each merged into one larger GEMM. No host synchronisation: a call captures in a CUDA graph
(the second stream forks from and joins the caller's stream).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...tiling import cdiv
from ...tma import rows_fit
from .. import kernels, runtime
from ..runtime import Device
from .base import SIXTEEN_BIT, Inputs, Outputs, on_triton


@dataclass(frozen=True)
class LibraryGemmsConfig:
    """P1's design on cuBLAS GEMMs (this module's docstring)."""

    name: ClassVar[str] = "library_gemms"

    d_a_fp32: bool = True  # dA in fp32 (the faithful path always); else in the input dtype, as torch.compile's
    streams: bool = False  # dWd beside dA, and [dWg; dWu] beside dx, on a second CUDA stream
    # fast path: dx as dGate · Wg, then + dUp · Wu accumulated onto it (the first half rounded once more), where
    # [Wg; Wu] would have to be stacked; no 2I × H copy per call
    dx_in_two: bool = False
    # where [Wg; Wu] has to be stacked (and dx is one GEMM): the copy runs first thing on the second stream (with
    # ``streams``), beside dA and the dSwiGLU pass, instead of on the caller's stream just before dx
    stack_aside: bool = False
    # where [Wg; Wu] has to be stacked: by two device-to-device memcpys (the GPU's copy engines, not its SMs, where
    # the driver gives them the copy) instead of a copy kernel
    stack_by_memcpy: bool = False
    grads_block: tuple[int, int] = (16, 128)  # [tokens, I] block of one program of the dSwiGLU pass
    grads_warps: int = 4

    @classmethod
    def for_shape(cls, num_tokens: int, intermediate_size: int) -> LibraryGemmsConfig:
        """The fast path's form: both streams, [Wg; Wu] stacked aside; from :data:`D_A_16BIT_MIN_TOKENS` dA in the
        input dtype and the stacking by memcpy; below 2I tokens dx in two products instead of stacking [Wg; Wu] (its
        8·I·H bytes cost more than the 4·T·H of reading dx back), where I's rows are 16-byte multiples (the products
        take dGate, dUp as column slices of K = I: notes/p1/design-07.md, design-26.md)."""
        many = num_tokens >= D_A_16BIT_MIN_TOKENS
        dx_in_two = num_tokens < 2 * intermediate_size and rows_fit(intermediate_size, element_bytes=2)
        return cls(d_a_fp32=not many, streams=True, stack_aside=True, stack_by_memcpy=many, dx_in_two=dx_in_two)

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        if dtype not in SIXTEEN_BIT:
            return f"its dSwiGLU pass takes 16-bit operands, got {dtype}"
        if device.kind != "cuda":
            return "cuBLAS's GEMMs need a CUDA GPU"
        return on_triton(device)

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None:
        """The four gradients into ``out`` (its two weight gradients the row halves of one [2I, H] buffer)."""
        (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate) = inputs
        T, H = x.shape
        I = gate_weight.shape[0]
        grad_x, grad_down_weight = out.grad_x, out.grad_down_weight
        grad_gate_up = gate_up_view(out.grad_gate_weight, out.grad_up_weight)
        if grad_gate_up is None:
            raise ValueError("out: grad_gate_weight and grad_up_weight must be the row halves of one [2I, H] buffer")
        halves = 2 if with_lo else 1
        d_gate_up = runtime.allocate((T, 2 * halves * I), dtype=x.dtype, device=x.device)
        side = SideStream(x.device) if self.streams and x.is_cuda else None
        # [Wg; Wu] as one [2I, H] operand of dx: a view where Wg and Wu are adjacent halves of one buffer, else
        # a copy (or none: dx in two GEMMs; with_lo stacks [Wg; Wu; Wg; Wu] in one copy below)
        gate_up_weight = gate_up_view(gate_weight, up_weight)
        copy_needed = gate_up_weight is None and not with_lo and not self.dx_in_two
        if copy_needed:
            gate_up_weight = runtime.allocate((2 * I, H), dtype=x.dtype, device=x.device)
        stacked = None  # the side stream's mark once its copy is made (stack_aside)

        with branch(side):  # first on the side stream: the copy (stack_aside), then dWd = dyᵀ · intermediate
            if copy_needed and self.stack_aside:
                self.stack(gate_weight, up_weight, gate_up_weight)
                stacked = side.mark() if side is not None else None
            if with_lo:  # an fp32 product rounded once (the module's docstring: the faithful path)
                grad_down_weight.copy_(mm_fp32(grad_output.T, intermediate))
            else:
                torch.mm(grad_output.T, intermediate, out=grad_down_weight)
        if T > 0:
            d_a = mm_fp32(grad_output, down_weight) if self.d_a_fp32 or with_lo else grad_output @ down_weight
            grid = (cdiv(T, self.grads_block[0]), cdiv(I, self.grads_block[1]))
            kernels.swiglu_grads_kernel[grid](
                d_a,
                gate,
                gate_sigmoid,
                gate_silu,
                up,
                d_gate_up,
                T,
                I,
                *self.grads_block,
                with_lo,
                num_warps=self.grads_warps,
            )
        with branch(side):  # [dWg; dWu] = [dG | dU]ᵀ · x
            if with_lo:
                torch.add(*mm_fp32(d_gate_up.T, x).split(2 * I), out=grad_gate_up)
            else:
                torch.mm(d_gate_up.T, x, out=grad_gate_up)
        if copy_needed and not self.stack_aside:
            self.stack(gate_weight, up_weight, gate_up_weight)
        if stacked is not None:
            torch.cuda.current_stream(x.device).wait_event(stacked)
        if with_lo:  # [dG_hi | dU_hi | dG_lo | dU_lo] · [Wg; Wu; Wg; Wu]
            weights = [gate_up_weight] if gate_up_weight is not None else [gate_weight, up_weight]
            grad_x.copy_(mm_fp32(d_gate_up, torch.cat(weights * 2)))  # an fp32 product rounded once, as dWd
        elif gate_up_weight is None:  # dx_in_two, where a copy would be needed
            torch.mm(d_gate_up[:, :I], gate_weight, out=grad_x)
            grad_x.addmm_(d_gate_up[:, I:], up_weight)
        else:
            torch.mm(d_gate_up, gate_up_weight, out=grad_x)
        if side is not None:
            side.join()

    def stack(self, gate_weight, up_weight, gate_up_weight):
        """[Wg; Wu] into ``gate_up_weight`` [2I, H]."""
        if self.stack_by_memcpy:  # a contiguous same-dtype copy_ is a cudaMemcpyAsync, device to device
            gate_up_weight[: gate_weight.shape[0]].copy_(gate_weight)
            gate_up_weight[gate_weight.shape[0] :].copy_(up_weight)
        else:
            torch.cat([gate_weight, up_weight], out=gate_up_weight)


# from here on the fast path keeps dA in the input dtype, as torch.compile's code does, and stacks [Wg; Wu] by two
# memcpys beside dA (the copy engines, leaving every SM to the GEMMs); below, dA in fp32 and the copy as a kernel
# (notes/p1/design-07.md)
D_A_16BIT_MIN_TOKENS = 1024


def gate_up_view(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor | None:
    """[Wg; Wu] as a [2I, H] view where the two are the row halves of one buffer (a fused gate-up weight split
    in two, as many models keep it); None where they are not."""
    I, H = gate_weight.shape
    adjacent = (
        gate_weight.is_contiguous()
        and up_weight.is_contiguous()
        and up_weight.untyped_storage().data_ptr() == gate_weight.untyped_storage().data_ptr()
        and up_weight.storage_offset() == gate_weight.storage_offset() + I * H
    )
    return gate_weight.as_strided((2 * I, H), (H, 1)) if adjacent else None


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b in fp32 from 16-bit operands: cuBLAS's fp32 output on CUDA; the fp32 product elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class SideStream:
    """A second CUDA stream per device that forks from the caller's stream and joins it again."""

    _streams: dict = {}

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        key = str(device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        self.stream = self._streams[key]
        self.forked = False

    def mark(self) -> torch.cuda.Event:
        """An event recorded on the side stream now: the caller's stream can wait for what is queued there so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self):
        if self.forked:
            self.main.wait_stream(self.stream)


@contextlib.contextmanager
def branch(side: SideStream | None):
    """``with branch(side):`` runs its body on the side stream after everything queued so far on the
    caller's stream (``side`` None: on the caller's stream)."""
    if side is None:
        yield
        return
    side.stream.wait_stream(side.main)
    side.forked = True
    with torch.cuda.stream(side.stream):
        yield
