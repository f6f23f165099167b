"""P1's fast path on the grouped GEMM engine (``moe_lib/engine/``) as one expert: three launches.

Dataflow (T tokens, H hidden, I intermediate; the engine's E = 1 expert, offsets [0, T]), bf16:

    [dG | dU]   = dSwiGLU(dy · Wd; saved)     [T, 2I]  grouped_gemm, dswiglu epilogue: dA = dy · Wd in fp32 (never
                  stored), dG = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)), dU = dA ⊙ silu, from the saved gate, up,
                  s = gate_sigmoid and silu = gate_silu (P1's definition), written into the two column halves of
                  one buffer
    dx          = [dG | dU] · [Wg; Wu]         [T, H]   grouped_gemm over K = 2I: B a [1, 2I, H] view where Wg and Wu
                                                        are the row halves of one buffer, else the pair (Wg, Wu) along
                                                        K (the engine reads both, no stacked copy)
    [dWg; dWu]  = [dG | dU]ᵀ · x               [2I, H]  } grouped_weight_grad: one launch of two products over
    dWd         = dyᵀ · intermediate           [H, I]   } K = T, into [1, 2I, H] and [1, H, I] views of the outputs;
                                                        with ``beside``, on a second stream beside dx's launch

The fast path only (dG and dU rounded to bf16 before dx, dWg and dWu, as torch.compile does): the engine's epilogue
has no hi/lo halves, so ``run`` refuses ``with_lo``, and the chooser sends only the fast path here.

The saved gate_sigmoid and gate_silu are read as given (the engine's epilogue with ``gate_sigmoid``/``gate_silu``:
its four saved tiles leave room for a 3-stage ring), so the design follows P1's definition whether or not they are
the forward's of the gate (the harness draws them independently). dA stays in fp32 (the careful PyTorch rounds it
to bf16 first). The engine's epilogue takes a routing weight per row; P1 has none: ``scale`` is ones.

Fill at E = 1 (132 SMs, H 2048, I 768), where the varlen forms meet a dense problem:
- dA: ⌈T/128⌉ · 6 tiles of 128 × 128 (the dswiglu epilogue's tiles): 54 at 1087 tokens, 132 at 2767 (one wave),
  384 at 8192 (2.9 waves);
- dx: ⌈T/128⌉ · 8 tiles of 128 × 256 or twice as many of 128 × 128: 72 / 144 at 1087 tokens, 176 / 352 at 2767,
  512 / 1024 at 8192;
- the weight gradients: 12 · 8 + 16 · 3 = 144 tiles of 128 × 256 at every T (1.09 waves: 12 programs take two
  tiles, so a launch on all the SMs lasts two tile-times with 55% of their time busy), or 192 + 96 = 288 of 128 ×
  128 (2.18 waves: three half tile-times, 73% busy).
One after the other (``beside`` False), :func:`tiles_in_turn` takes for each launch the tiles whose rounds over the
SMs end first (the weight gradients in 128 × 128; dx in 128 × 128 at 2767 tokens, 128 × 256 at 1087 and 8192). Side
by side (``beside``, the default), :func:`tiles_beside` splits the SMs between the two launches so that the slower
ends first: at this shape from 512 tokens the 144 weight-gradient tiles of 128 × 256 on 72 SMs (two whole rounds)
and dx on at most the other 60 (57 programs in 9 rounds at 8192 tokens); the two launches' programs are resident
together, one an SM (each takes most of an SM's shared memory).
A split of K = T into E = S row slices (fp32 partials summed afterwards) was weighed instead and not built
(notes/p1/design-28.md: the prediction by token count).

Under the interpreter the engine's plain-Triton twins run (their small tiles); on a Hopper GPU its Gluon kernels.
No host synchronisation: the offsets and the ones are made on the device and kept (the offsets per token count, the
ones in power-of-two lengths), so that a CUDA graph captured with them finds them on every replay; the launches
capture in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from ...dispatch import interpreter_enabled
from ...engine import grouped_gemm as gemm_gluon
from ...engine import grouped_tl as gemm_tl
from ...engine import grouped_wgrad as wgrad_gluon
from ...engine import grouped_wgrad_tl as wgrad_tl
from ...engine.gluon_gemm import GemmConfig
from ...tiling import cdiv
from .. import runtime
from ..runtime import Device, device_of
from .base import Inputs, Outputs
from .library_gemms import SideStream, branch, gate_up_view

BLOCK_K = 64  # the engine's [E, K, N] operand forms take K (H for dA, I for each half of dx's pair) in whole steps
WIDE = GemmConfig()  # cooperative 128 × 256 × 64, 3 stages: the engine's default tiles
SQUARE = GemmConfig(128, 128, 64, 5)  # cooperative 128 × 128 × 64, 5 stages
# a 128 × 128 tile's rate against a 128 × 256 one's where both fill the GPU (the dense probe's geomeans over its
# filling shapes: 0.959 and 0.994 of torch.mm, notes/p2/engine-probe.md)
SQUARE_RATE = 0.96
# a tile's prologue and epilogue (the ring's first loads, the output tile's store) as so many more rows of K
TILE_OVERHEAD_K = 2 * BLOCK_K


class EngineCall(NamedTuple):
    """One launch of the engine: ``kind`` "gemm" (``grouped_gemm``) or "weight_grad" (``grouped_weight_grad``), and
    its keyword arguments (``config`` among them for the Gluon kernel; the plain-Triton twins take their own)."""

    kind: str
    arguments: dict
    side: bool = False  # on the second stream (after everything queued before it on the caller's)


@dataclass(frozen=True)
class EngineDesign:
    """P1's fast path as three launches of the grouped engine with one expert (this module's docstring)."""

    name: ClassVar[str] = "engine"

    # the weight-gradient launch on a second stream beside dx's, the SMs split between them (:func:`tiles_beside`);
    # else the two one after the other, each on every SM (:func:`tiles_in_turn`)
    beside: bool = True
    grad_x_tiles: GemmConfig | None = None  # dx's tiles on the GPU (None: by the call's shape)
    weight_grad_tiles: GemmConfig | None = None  # the weight gradients' tiles on the GPU (None: by the call's shape)

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        if dtype != torch.bfloat16:
            return f"the engine's operands are bfloat16, got {dtype}"
        if not device.hopper and device.kind != "interpreter":
            return "the engine's Gluon kernels need a Hopper GPU (sm_90), or the interpreter for their Triton twins"
        for name, size in (("H", hidden_size), ("I", intermediate_size)):
            if size % BLOCK_K:
                return f"{name} = {size}: the engine's [E, K, N] operands take multiples of {BLOCK_K}"
        if not aligned:
            return "TMA needs every operand to start on a 16-byte boundary"
        if num_tokens == 0:
            return "no tokens: the engine's products need at least one row"
        return None

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None:
        """The four gradients into ``out`` (its two weight gradients the row halves of one [2I, H] buffer)."""
        if with_lo:
            raise ValueError(
                "with_lo: the engine design runs the fast path only (dGate and dUp rounded to bf16; its epilogue has "
                "no hi/lo halves): call it with precision='fast'"
            )
        interpreter = interpreter_enabled()
        side = SideStream(inputs.x.device) if self.beside and inputs.x.is_cuda else None
        for call in self.calls(inputs, out, sms=device_of(inputs.x).sms):
            with branch(side if call.side else None):
                if interpreter:  # the plain-Triton twins, with their own small tiles
                    arguments = {key: value for key, value in call.arguments.items() if key != "config"}
                    TWINS[call.kind](**arguments)
                else:
                    GLUON[call.kind](**call.arguments)
        if side is not None:
            side.join()

    def calls(self, inputs: Inputs, out: Outputs, *, sms: int) -> list[EngineCall]:
        """The three launches of a call on ``sms`` SMs in launch order (with ``beside`` the weight gradients' on the
        second stream before dx's), their workspace ([dG | dU]) allocated: what :meth:`run` launches and what
        ``scripts/p1/p1_compile_check.py`` compiles (meta tensors do)."""
        (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate) = inputs
        T, H = x.shape
        I = gate_weight.shape[0]
        grad_gate_up = gate_up_view(out.grad_gate_weight, out.grad_up_weight)
        if grad_gate_up is None:
            raise ValueError("out: grad_gate_weight and grad_up_weight must be the row halves of one [2I, H] buffer")
        offsets, ones = one_expert(T, x.device)
        d_gate_up = runtime.allocate((T, 2 * I), dtype=x.dtype, device=x.device)  # [dG | dU]
        gate_up_weight = gate_up_view(gate_weight, up_weight)
        weights = gate_up_weight[None] if gate_up_weight is not None else (gate_weight[None], up_weight[None])
        grad_x_tiles, weight_grad_tiles = self.tiles(T, H, I, sms)
        d_a = dict(
            a=grad_output,
            b=down_weight[None],  # Wd [1, H, I] as it lies: K = H, N = I
            offsets=offsets,
            epilogue="dswiglu",
            b_transposed=False,
            gate=gate,
            up=up,
            gate_sigmoid=gate_sigmoid,
            gate_silu=gate_silu,
            scale=ones,
            dgate_out=d_gate_up[:, :I],
            dup_out=d_gate_up[:, I:],
        )  # the dswiglu epilogue's own tiles (its default config with the saved σ and silu)
        grad_x = dict(a=d_gate_up, b=weights, offsets=offsets, out=out.grad_x, b_transposed=False, config=grad_x_tiles)
        weight_grads = dict(
            problems=[(d_gate_up, x), (grad_output, intermediate)],
            offsets=offsets,
            outs=[grad_gate_up[None], out.grad_down_weight[None]],
            config=weight_grad_tiles,
        )
        if self.beside:
            return [
                EngineCall("gemm", d_a),
                EngineCall("weight_grad", weight_grads, side=True),
                EngineCall("gemm", grad_x),
            ]
        return [EngineCall("gemm", d_a), EngineCall("gemm", grad_x), EngineCall("weight_grad", weight_grads)]

    def tiles(self, T: int, H: int, I: int, sms: int) -> tuple[GemmConfig, GemmConfig]:
        """(dx's tiles, the weight gradients' tiles) on the GPU: the config's where it names them, else by the call's
        shape; side by side each with its share of the SMs (``programs``)."""
        if self.beside:
            return tiles_beside(T, H, I, sms, self.grad_x_tiles, self.weight_grad_tiles)
        grad_x, weight_grads = tiles_in_turn(T, H, I, sms)
        return self.grad_x_tiles or grad_x, self.weight_grad_tiles or weight_grads


GLUON = {"gemm": gemm_gluon.grouped_gemm, "weight_grad": wgrad_gluon.grouped_weight_grad}
TWINS = {"gemm": gemm_tl.grouped_gemm_tl, "weight_grad": wgrad_tl.grouped_weight_grad_tl}


def weight_grad_tile_count(config: GemmConfig, H: int, I: int) -> int:
    """Tiles of the weight-gradient launch: [dWg; dWu] [2I, H] and dWd [H, I]."""
    return config.tiles(2 * I, H) + config.tiles(H, I)


def tile_time(config: GemmConfig, K: int) -> float:
    """A tile's time in arbitrary units: its multiply-adds (K in whole steps, and its prologue and epilogue) over
    its rate."""
    rate = SQUARE_RATE if (config.block_m, config.block_n) == (SQUARE.block_m, SQUARE.block_n) else 1.0
    return config.block_m * config.block_n * (cdiv(K, BLOCK_K) * BLOCK_K + TILE_OVERHEAD_K) / rate


@functools.lru_cache(maxsize=1024)  # host arithmetic on every call
def tiles_in_turn(T: int, H: int, I: int, sms: int) -> tuple[GemmConfig, GemmConfig]:
    """(dx's tiles, the weight gradients' tiles) for the two launches one after the other on ``sms`` SMs: for each,
    WIDE or SQUARE, whichever ends its rounds (one tile an SM each) first (a tie goes to WIDE)."""

    def grad_x_time(config):
        return cdiv(config.tiles(T, H), sms) * tile_time(config, 2 * I)

    def weight_grad_time(config):
        return cdiv(weight_grad_tile_count(config, H, I), sms) * tile_time(config, T)

    return min((WIDE, SQUARE), key=grad_x_time), min((WIDE, SQUARE), key=weight_grad_time)


@functools.lru_cache(maxsize=1024)
def tiles_beside(
    T: int, H: int, I: int, sms: int, grad_x: GemmConfig | None = None, weight_grads: GemmConfig | None = None
) -> tuple[GemmConfig, GemmConfig]:
    """(dx's tiles, the weight gradients' tiles), each with its programs, for the two launches side by side on
    ``sms`` SMs (both resident at once, a program an SM): of the tiles given (else WIDE and SQUARE each) and of the
    weight gradients' round counts, the pair whose slower launch ends first; each launch then as few programs as
    take its rounds. One after the other (:func:`tiles_in_turn`) where there are fewer than two SMs."""
    if sms < 2:
        return tiles_in_turn(T, H, I, sms)
    best = None
    for weight_config in (weight_grads,) if weight_grads else (WIDE, SQUARE):
        weight_tiles = weight_grad_tile_count(weight_config, H, I)
        for grad_x_config in (grad_x,) if grad_x else (WIDE, SQUARE):
            grad_x_tiles = grad_x_config.tiles(T, H)
            for rounds in range(1, weight_tiles + 1):
                programs = cdiv(weight_tiles, rounds)  # the fewest programs that take those rounds
                if programs >= sms:
                    continue
                grad_x_rounds = cdiv(grad_x_tiles, sms - programs)
                time = max(rounds * tile_time(weight_config, T), grad_x_rounds * tile_time(grad_x_config, 2 * I))
                if best is None or time < best[0]:
                    best = (time, weight_config, programs, grad_x_config, cdiv(grad_x_tiles, grad_x_rounds))
    _, weight_config, weight_programs, grad_x_config, grad_x_programs = best
    return (
        dataclasses.replace(grad_x_config, programs=grad_x_programs),
        dataclasses.replace(weight_config, programs=weight_programs),
    )


# made outside a CUDA graph's capture, kept: a graph captured later reads them on every replay
_OFFSETS: dict = {}  # (device, T) -> int32 [0, T]
_ONES: dict = {}  # device -> fp32 ones, one buffer of each power-of-two length asked for so far (the longest last)


def one_expert(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [0, T] int32, the row scales: ones [T] fp32) of one expert owning all T rows, made on the device
    (no host-to-device copy: capturable); made inside a capture they are the graph's own."""
    keep = device.type != "meta" and not runtime.capturing(device)
    offsets = _OFFSETS.get((str(device), T))
    if offsets is None:
        offsets = torch.arange(2, dtype=torch.int32, device=device) * T
        if keep:
            _OFFSETS[(str(device), T)] = offsets
    ones = _ONES.get(str(device), [None])[-1]
    if ones is None or ones.numel() < T:
        ones = torch.ones(1 << max(T - 1, 0).bit_length(), dtype=torch.float32, device=device)
        if keep:
            _ONES.setdefault(str(device), []).append(ones)
    return offsets, ones[:T]
