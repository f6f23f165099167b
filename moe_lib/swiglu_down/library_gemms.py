"""P1 on the vendor's GEMMs (cuBLAS, through ``torch.mm``) with the dSwiGLU step as one Triton pass.

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid), 16-bit inputs:

    dA           = dy · Wd                     [T, I]   cuBLAS, fp32 out (``d_a_fp32``; else the input dtype)
    dWd          = dyᵀ · intermediate          [H, I]   cuBLAS (on a second stream with ``streams``)
    [dG | dU]    = dSwiGLU(dA, saved)          [T, 2I]  one Triton pass (kernels.swiglu_grads_kernel):
                   dG = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dU = dA ⊙ gate_silu, side by side in each row
                   (with ``d_a_tile`` dA and this pass are one Triton launch instead,
                   kernels.d_intermediate_rows_kernel: dA's tiles, then the pass's epilogue on each, dA never
                   stored)
    dx           = [dG | dU] · [Wg; Wu]        [T, H]   one cuBLAS GEMM over K = 2I (with ``grad_x_tile`` Triton's
                                                        split-K tiles, kernels.grad_x_rows_kernel, reading Wg and
                                                        Wu where they lie: nothing stacked)
    [dWg; dWu]   = [dG | dU]ᵀ · x              [2I, H]  one cuBLAS GEMM with M = 2I (on the second stream with
                                                        ``streams``); dWg and dWu are its two row halves

The faithful path (``with_lo``) keeps dG and dU as hi/lo pairs, each row [dG_hi | dU_hi | dG_lo | dU_lo]
([T, 4I]): dx is one GEMM over K = 4I against [Wg; Wu; Wg; Wu], and [dWg; dWu] the sum of the hi and lo
row halves of one fp32 GEMM with M = 4I. dA is then always kept in fp32.

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

import torch

from ..tiling import cdiv
from . import kernels, launch


@dataclass(frozen=True)
class LibraryGemmsConfig:
    """P1's design on cuBLAS GEMMs (this module's docstring)."""

    d_a_fp32: bool = True  # dA in fp32 (the faithful path always); else in the input dtype, as torch.compile's
    streams: bool = False  # dWd beside dA, and [dWg; dWu] beside dx, on a second CUDA stream
    # fast path: dx as dGate · Wg, then + dUp · Wu accumulated onto it (the first half rounded once more), where
    # [Wg; Wu] would have to be stacked; no 2I × H copy per call
    dx_in_two: bool = False
    # where [Wg; Wu] has to be stacked (and dx is one GEMM): the copy runs first thing on the second stream (with
    # ``streams``), beside dA and the dSwiGLU pass, instead of on the caller's stream just before dx
    stack_aside: bool = False
    # dx by Triton tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) that read Wg and Wu where they lie
    # (kernels.grad_x_rows_kernel) instead of cuBLAS over a stacked [Wg; Wu]: no copy per call; None: cuBLAS
    grad_x_tile: tuple[int, int, int, int] | None = None
    grad_x_warps: int = 4
    grad_x_stages: int = 3
    # where [Wg; Wu] has to be stacked: by two device-to-device memcpys (the GPU's copy engines, not its SMs, where
    # the driver gives them the copy) instead of a copy kernel
    stack_by_memcpy: bool = False
    grads_block: tuple[int, int] = (16, 128)  # [tokens, I] block of one program of the dSwiGLU pass
    grads_warps: int = 4
    # the dSwiGLU pass by runs of this many consecutive elements of [T, I] per program (swiglu_grads_flat_kernel)
    # instead of [tokens, I] blocks; None: by blocks
    grads_flat_block: int | None = None
    # dA and the dSwiGLU pass as one Triton launch of dA tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) with the pass as
    # their epilogue, instead of cuBLAS's dA and the pass (one launch and dA's round trip through memory fewer);
    # None: cuBLAS and the pass. dA then stays in fp32 registers whatever ``d_a_fp32`` says
    d_a_tile: tuple[int, int, int, int] | None = None
    d_a_warps: int = 4
    d_a_stages: int = 3
    # with ``d_a_tile``: dWd's tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) in that same launch, instead of cuBLAS's dWd
    # (at few tokens dWd is a short reduction, and its tiles fill the SMs that dA's few tiles leave idle)
    grad_down_tile: tuple[int, int, int, int] | None = None

    def __post_init__(self):
        if self.grad_down_tile is not None and self.d_a_tile is None:
            raise ValueError("config: grad_down_tile puts dWd in the launch of dA's Triton tiles; it needs d_a_tile")
        if self.grads_flat_block is not None:
            if self.grads_flat_block < 1 or self.grads_flat_block & (self.grads_flat_block - 1):
                raise ValueError(f"config: grads_flat_block must be a power of two, got {self.grads_flat_block}")
            if self.d_a_tile is not None:
                raise ValueError("config: grads_flat_block cuts the dSwiGLU pass, which d_a_tile folds into dA's tiles")

    def run(self, grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
            intermediate, *, with_lo: bool):  # fmt: skip
        """The four gradients (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight); the two weight
        gradients are the row halves of one [2I, H] allocation."""
        T, H = x.shape
        I = gate_weight.shape[0]
        grad_x = launch.allocate(x.shape, dtype=x.dtype, device=x.device)
        grad_gate_up = launch.allocate((2 * I, H), dtype=x.dtype, device=x.device)
        grad_down_weight = launch.allocate(down_weight.shape, dtype=x.dtype, device=x.device)
        halves = 2 if with_lo else 1
        d_gate_up = launch.allocate((T, 2 * halves * I), dtype=x.dtype, device=x.device)
        side = SideStream(x.device) if self.streams and x.is_cuda else None
        # [Wg; Wu] as one [2I, H] operand of dx: a view where Wg and Wu are adjacent halves of one buffer, else
        # a copy (or none: dx in two GEMMs; with_lo stacks [Wg; Wu; Wg; Wu] in one copy below)
        gate_up_weight = gate_up_view(gate_weight, up_weight)
        copy_needed = gate_up_weight is None and not with_lo and not self.dx_in_two and self.grad_x_tile is None
        if copy_needed:
            gate_up_weight = launch.allocate((2 * I, H), dtype=x.dtype, device=x.device)
        stacked = None  # the side stream's mark once its copy is made (stack_aside)

        with branch(side):  # first on the side stream: the copy (stack_aside), then dWd = dyᵀ · intermediate
            if copy_needed and self.stack_aside:
                self.stack(gate_weight, up_weight, gate_up_weight)
                stacked = side.mark() if side is not None else None
            if self.grad_down_tile is None:
                torch.mm(grad_output.T, intermediate, out=grad_down_weight)
        if self.d_a_tile is not None:
            self.d_a_and_swiglu_grads(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
                                      d_gate_up, grad_down_weight, with_lo=with_lo)  # fmt: skip
        elif T > 0:
            d_a = mm_fp32(grad_output, down_weight) if self.d_a_fp32 or with_lo else grad_output @ down_weight
            if self.grads_flat_block is not None:
                kernels.swiglu_grads_flat_kernel[(cdiv(T * I, self.grads_flat_block),)](
                    d_a, gate, gate_sigmoid, gate_silu, up, d_gate_up, T * I, I, self.grads_flat_block, with_lo,
                    num_warps=self.grads_warps,
                )  # fmt: skip
            else:
                grid = (cdiv(T, self.grads_block[0]), cdiv(I, self.grads_block[1]))
                kernels.swiglu_grads_kernel[grid](
                    d_a, gate, gate_sigmoid, gate_silu, up, d_gate_up, T, I, *self.grads_block, with_lo,
                    num_warps=self.grads_warps,
                )  # fmt: skip
        with branch(side):  # [dWg; dWu] = [dG | dU]ᵀ · x
            if with_lo:
                torch.add(*mm_fp32(d_gate_up.T, x).split(2 * I), out=grad_gate_up)
            else:
                torch.mm(d_gate_up.T, x, out=grad_gate_up)
        if copy_needed and not self.stack_aside:
            self.stack(gate_weight, up_weight, gate_up_weight)
        if stacked is not None:
            torch.cuda.current_stream(x.device).wait_event(stacked)
        if self.grad_x_tile is not None:
            self.grad_x_rows(d_gate_up, gate_weight, up_weight, grad_x, with_lo=with_lo)
        elif with_lo:  # [dG_hi | dU_hi | dG_lo | dU_lo] · [Wg; Wu; Wg; Wu]
            weights = [gate_up_weight] if gate_up_weight is not None else [gate_weight, up_weight]
            torch.mm(d_gate_up, torch.cat(weights * 2), out=grad_x)
        elif gate_up_weight is None:  # dx_in_two, where a copy would be needed
            torch.mm(d_gate_up[:, :I], gate_weight, out=grad_x)
            grad_x.addmm_(d_gate_up[:, I:], up_weight)
        else:
            torch.mm(d_gate_up, gate_up_weight, out=grad_x)
        if side is not None:
            side.join()
        return grad_x, grad_gate_up[:I], grad_gate_up[I:], grad_down_weight

    def stack(self, gate_weight, up_weight, gate_up_weight):
        """[Wg; Wu] into ``gate_up_weight`` [2I, H]."""
        if self.stack_by_memcpy:  # a contiguous same-dtype copy_ is a cudaMemcpyAsync, device to device
            gate_up_weight[: gate_weight.shape[0]].copy_(gate_weight)
            gate_up_weight[gate_weight.shape[0] :].copy_(up_weight)
        else:
            torch.cat([gate_weight, up_weight], out=gate_up_weight)

    def d_a_and_swiglu_grads(self, grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
                             d_gate_up, grad_down_weight, *, with_lo: bool):  # fmt: skip
        """[dG | dU] rows into ``d_gate_up`` from dA's Triton tiles (``d_a_tile``), in one launch; with
        ``grad_down_tile`` dWd into ``grad_down_weight`` in that launch too."""
        T, H = grad_output.shape
        I = down_weight.shape[1]
        grad_down_tile = self.grad_down_tile or (64, 64, 64, 1)  # unused without grad_down_tile
        plan = launch.launch_plan(T, H, I, launch.TileConfig(self.d_a_tile, grad_down_tile, (16, 16, 16, 1),
                                                             (16, 16, 16, 1)))  # fmt: skip
        grad_down, d_a = (kind for kind in plan if kind.launch == 1)
        da_workspace = launch.SplitWorkspace.make("dA rows", d_a.tiles, d_a, grad_output.device)
        dwd_workspace = launch.SplitWorkspace.make("dWd beside dA rows", grad_down.tiles, grad_down, grad_output.device)
        programs = d_a.programs + (grad_down.programs if self.grad_down_tile else 0)
        if programs:
            kernels.d_intermediate_rows_kernel[(programs,)](
                grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate, d_gate_up, grad_down_weight,
                *da_workspace, *dwd_workspace, T, H, I, *self.d_a_tile, *grad_down_tile, 8,
                *launch.dot_flags(grad_output), with_lo, self.grad_down_tile is not None, num_warps=self.d_a_warps,
                num_stages=self.d_a_stages,
            )  # fmt: skip

    def grad_x_rows(self, d_gate_up, gate_weight, up_weight, grad_x, *, with_lo: bool):
        """dx into ``grad_x`` from the [dG | dU] rows by Triton's split-K tiles (``grad_x_tile``), Wg and Wu read
        where they lie."""
        T, H = grad_x.shape
        I = gate_weight.shape[0]
        plan = launch.launch_plan(T, H, I, launch.TileConfig((16, 16, 16, 1), (16, 16, 16, 1), self.grad_x_tile,
                                                             (16, 16, 16, 1)))  # fmt: skip
        (grad_x_kind,) = (kind for kind in plan if kind.kind == "dx")
        workspace = launch.SplitWorkspace.make("dx rows", grad_x_kind.tiles, grad_x_kind, grad_x.device)
        if grad_x_kind.programs:
            kernels.grad_x_rows_kernel[(grad_x_kind.programs,)](
                d_gate_up, gate_weight, up_weight, grad_x, *workspace, T, H, I, *self.grad_x_tile, 8,
                *launch.dot_flags(grad_x), with_lo, num_warps=self.grad_x_warps, num_stages=self.grad_x_stages,
            )  # fmt: skip


def gate_up_view(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor | None:
    """[Wg; Wu] as a [2I, H] view where the two are the row halves of one buffer (a fused gate-up weight split
    in two, as many models keep it); None where they are not."""
    I, H = gate_weight.shape
    adjacent = (
        gate_weight.is_contiguous() and up_weight.is_contiguous()
        and up_weight.untyped_storage().data_ptr() == gate_weight.untyped_storage().data_ptr()
        and up_weight.storage_offset() == gate_weight.storage_offset() + I * H
    )  # fmt: skip
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

