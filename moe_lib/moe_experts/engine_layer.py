"""P2's layer on the grouped engine (:mod:`moe_lib.engine`): forward and backward in six weight passes.

Slots s = t·K + k sorted by expert (:func:`.packed_routing.packed_routing`: position p holds slot sorted_slot[p], and
row_of_slot is its inverse); x_s[p] = x[token of p], dy_s likewise, w_s[p] = topk_weights[slot of p]. Per expert e,
over its rows offsets[e] ≤ p < offsets[e + 1], each line one persistent launch:

    forward    g, u = x_s·Wg_eᵀ, x_s·Wu_eᵀ ;  a = silu(g)·u                        swiglu epilogue, x gathered
               y_s = w_s · (a·Wd_eᵀ)                                                 row_scale epilogue  reads Wd
               y[t] = Σ_k y_s[row_of_slot[t·K + k]]                                  slot-row sum
    backward   (g, u as in the forward, g and u stored only, where the forward did not save them: reads Wg, Wu)
               dAp = dy_s·Wd_e ;  a = silu(g)·u ;  dA = w_s·dAp                     dswiglu epilogue, dy gathered
               dg = dA·u·silu'(g) ;  du = dA·silu(g) ;  aw = w_s·a ;  part[j, p] = Σ_{columns of tile j} dAp·a
               dX_s = dg·Wg_e + du·Wu_e                                              K = 2I              reads Wg, Wu
               grad_x[t] = Σ_k dX_s[row_of_slot[t·K+k]] ; grad_topk[t, k] = Σ_j part[j, row_of_slot[t·K+k]]   one launch
               dWg_e = dg_eᵀ x_s,e ;  dWu_e = du_eᵀ x_s,e                            varlen-K            writes dWg, dWu
               dWd_e = dy_s,eᵀ aw_e                                                  varlen-K, dy gathered  writes dWd

"x gathered", "dy gathered": the launch reads those rows through the routing (:class:`..engine.gathered.Gathered`:
cp.async gathers in the loading partition) rather than from x_s or dy_s written out first (``GATHER_IN_LOADS``).
With the pre-activations saved, the weights are read twice in the forward and twice in the backward and their
gradients written once: six passes, as SonicMoE's layer; recomputing g and u adds a seventh (the op, whose
forward is recomputed, has five). dg and du share one [T·K, 2I] buffer (dg's columns, then du's): dX's product
reads it as one operand of K = 2I. Everything stays on the device (no host sync: graph-capturable); every output
element is written by one tile once (deterministic, no atomics); experts without rows get exact zero gradients.

Memory: dX_s is freed after its sum; x_s is written (where g and u were saved) just before the gradients of Wg and
Wu, and freed with [dg | du] before Wd's gradient is allocated. So no two [T·K, H] workspaces are ever alive beside
the weight gradients: the backward's peak is the larger of (dWg, dWu, [dg | du], aw, x_s) and (dWg, dWu, dWd, aw),
besides the saved g and u, where the layer's backward writes [dg | du] (``spend_preactivations``: the saved g and u
are the halves of one [T·K, 2I] buffer, and dswiglu reads each chunk of them before it writes there). Making x_s and
the gate and up gradients a column slice of H at a time where x_s is the larger (``X_S_IN_COLUMN_SLICES``,
:func:`x_s_column_slices`) keeps one slice of x_s alive, no larger than dWd; gathering x in the weight gradients'
launch as well (``GATHER_X_IN_WEIGHT_GRADS``) saves x_s. Where H > 2I (the fine-grained experts) dX_s is then the
widest workspace: ``DX_IN_COLUMN_SLICES`` makes and sums it a column slice at a time (:func:`dx_column_slices`),
each no wider than [dg | du]; the same products and sums, so the same bits (notes/p2/engine-layer.md, "A backward
without x_s").

The gate and up weights may be the two row halves of one fused [E, 2I, H] block (Hugging Face's ``gate_up_proj``,
as :class:`moe_lib.nn.MoEExperts` hands them): the swiglu and dX products then read that block as it lies, one
stacked B, rather than a pair of weights each copied contiguous (:mod:`.weights`).

bf16 only, on Hopper (the engine's Gluon kernels) or under the interpreter (their plain-Triton twins);
:func:`supports` says why not elsewhere. The readable reference of the same math: :mod:`.reference`.
"""

from __future__ import annotations

import torch

from ..dispatch import interpreter_enabled
from ..engine import grouped_gemm as gemm_gluon
from ..engine import grouped_tl as gemm_tl
from ..engine import grouped_wgrad as wgrad_gluon
from ..engine import grouped_wgrad_tl as wgrad_tl
from ..engine.gathered import Gathered
from ..engine.gluon_gemm import GemmConfig
from ..engine.grouped_gemm import weights_of
from ..tma import aligned
from ..validation import fits_in_memory
from . import runtime
from .packed_routing import packed_routing
from .slot_sum import sum_slot_rows
from .structure import preferred_now
from .weights import stacked_gate_up

DTYPES = (torch.bfloat16,)  # the engine's operands
BLOCK_K = 64  # the [E, K, N] operand forms need K (H for dAp, I for dX) a multiple of it
ENGINE_MIN_ROWS = 64  # the chooser's default: the engine from this many rows an expert on average
# whether the forward's first product and dswiglu's read x's and dy's rows through the routing in their loads
# (Gathered) rather than from x_s and dy_s written out first (notes/p2/engine-layer.md, "Gathered A")
GATHER_IN_LOADS = True
# whether the gate and up weights' gradients read x's rows through the routing as their A operand (128 of its columns
# a tile, as dy is the down gradient's; the gradients written through their transposed views, x_sᵀ·dg), so that x_s
# is never written, where the tiles' 256 columns divide I (dg's columns, their N): measured faster than x_s written
# where they do, slower where a last half-empty column tile is wasted (notes/p2/engine-layer.md, "x gathered as the
# weight gradients' A operand")
X_AS_A_IN_WEIGHT_GRADS = True
# with x as A, whether the gate and up gradients are one product x_sᵀ·[dg | du] of N = 2I written into dWgᵀ and dWuᵀ
# as its two column parts (a tile across I stored into both), so that the tiles need only divide 2I (DeepSeek-V2-
# Lite's I 1408: 2I = 11 · 256), rather than two products of N = I: level or faster at every case measured
# (notes/p2/engine-layer.md, "x gathered as the weight gradients' A operand")
X_AS_A_ONE_PRODUCT = True
# whether they read x's rows through the routing at every shape (as B where x is not A): no x_s at any shape, but
# slower where I is not a multiple of the tiles' columns (notes/p2/engine-wgrad.md, "Gathered operands")
GATHER_X_IN_WEIGHT_GRADS = False
# whether dX_s is made and summed a column slice at a time where H > 2I, so that no workspace is wider than [dg | du]
# (notes/p2/engine-layer.md, "A backward without x_s"); off until measured
DX_IN_COLUMN_SLICES = False
# whether the gate and up weights' gradients take x_s a column slice of H at a time where x_s [T·K, H] is larger than
# one weight's gradient [E, I, H] (T·K > E·I), each slice no larger than that: their launch then no longer holds the
# backward's peak (notes/p2/engine-layer.md, "x_s in column slices")
X_S_IN_COLUMN_SLICES = True
# whether a backward asked to spend the saved pre-activations (``spend_preactivations``: the layer's op, which runs
# its backward once) writes [dg | du] over them, the two halves of one [T·K, 2I] buffer (dswiglu reads each chunk of
# g and u before it writes dg and du there): no [T·K, 2I] workspace at the backward's peak, the same time
# (notes/p2/engine-layer.md, "Gradients over the saved pre-activations")
GRADS_OVER_SAVED = True


def structure(
    num_slots: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    target: runtime.Target,
) -> str:
    """Which structure runs a call of T·K = ``num_slots`` slots: the one :func:`.structure.preferred` asks for (a
    ValueError saying why where the engine cannot take the call: an explicit request is not dropped silently), else
    the engine where it runs and experts average at least :data:`ENGINE_MIN_ROWS` rows, kernels A, W, D and C
    otherwise."""
    asked = preferred_now()
    if asked == "kernels":
        return "kernels"
    reason = supports(hidden_size, intermediate_size, dtype, target)
    if asked == "engine" and reason is not None:
        raise ValueError(f"structure: 'engine' was asked for, but {reason}")
    # below 64 rows an expert kernel A's narrow row blocks beat the engine's 128-row tiles (notes/p2/engine-layer.md)
    busy = num_slots >= ENGINE_MIN_ROWS * max(num_experts, 1)
    return "engine" if reason is None and (asked == "engine" or busy) else "kernels"


def supports(hidden_size: int, intermediate_size: int, dtype: torch.dtype, target: runtime.Target) -> str | None:
    """Why the engine's layer cannot run these shapes on ``target`` (None: it can)."""
    if dtype not in DTYPES:
        return f"dtype {dtype}: the engine's layer takes bfloat16"
    if not target.interpreter and target.capability < (9, 0):
        return "the engine's Gluon kernels need a Hopper GPU (compute capability 9.0)"
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size % BLOCK_K:
            return f"{name} = {size}: the engine's layer takes multiples of {BLOCK_K}"
    return None


def gemm_config(num_slots: int, num_experts: int) -> GemmConfig:
    """Tiles of the varlen-M products: ping-pong 64 × 256 while experts are small (its epilogue overlaps the other
    tile's K loop, and an expert's last row tile wastes at most 63 rows), cooperative 128 × 256 from 1024 rows an
    expert (notes/p2/engine-grouped.md, Measured; notes/p2/engine-layer.md, Row tiles)."""
    if num_slots >= 1024 * max(num_experts, 1):
        return GemmConfig(128, 256, 64, 3, "cooperative")
    return GemmConfig(64, 256, 64, 4, "pingpong")


def column_slices(columns: int, widest: int, column_tile: int) -> list[slice]:
    """``columns`` in ⌈columns / widest⌉ slices as equal as whole ``column_tile``s allow (the products' tile width:
    no tile straddles two slices, and each slice starts 16-byte aligned, as TMA needs); one slice where
    ``widest`` ≥ ``columns``."""
    pieces = -(-columns // widest) if 0 < widest < columns else 1
    width = -(-columns // pieces)
    width = -(-width // column_tile) * column_tile
    if pieces == 1 or width >= columns:
        return [slice(0, columns)]
    return [slice(start, min(start + width, columns)) for start in range(0, columns, width)]


def dx_column_slices(hidden_size: int, intermediate_size: int, column_tile: int) -> list[slice]:
    """dX's columns as the backward makes them: all H at once, or (``DX_IN_COLUMN_SLICES``) slices no wider than
    2I, each of whole ``column_tile``s (:func:`column_slices`)."""
    return column_slices(hidden_size, 2 * intermediate_size if DX_IN_COLUMN_SLICES else 0, column_tile)


def x_s_column_slices(
    num_slots: int, hidden_size: int, intermediate_size: int, num_experts: int, column_tile: int
) -> list[slice]:
    """The columns of x_s, and of the gate and up weights' gradients, a launch of theirs takes: all H at once, or
    (``X_S_IN_COLUMN_SLICES``) slices of x_s [T·K, H] each no larger than one weight's gradient [E, I, H], of whole
    ``column_tile``s (:func:`column_slices`). The backward's peak (g and u saved and spent, their buffer alive to the
    end) is the larger of the gate and up gradients' launch, dWg + dWu + x_s + aw, and Wd's, dWg + dWu + dWd + aw:
    with x_s's slices no larger than dWd, the first is no longer the larger."""
    widest = max(num_experts * intermediate_size * hidden_size // max(num_slots, 1), 1)  # x_s's columns as large as dWd
    return column_slices(hidden_size, widest if X_S_IN_COLUMN_SLICES else 0, column_tile)


def allocation_bytes(
    num_tokens: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    *,
    backward: bool,
    saved: bool = False,
) -> int:
    """At most this many bytes allocated by one call (bf16; outputs included): the forward's x_s, a, y_s and y
    (and g, u where saved); the backward's outputs with, at its widest, two [T·K, H] workspaces (x_s with dy_s or
    dX_s where g and u are recomputed), [dg | du], aw, the partials, and g and u where recomputed."""
    T, K, H, I, E = num_tokens, top_k, hidden_size, intermediate_size, num_experts
    slots = T * K
    if not backward:
        return 2 * (slots * H + slots * I + slots * H + T * H + (2 * slots * I if saved else 0))
    recomputed = 0 if saved else 2 * slots * I
    partials = 4 * slots * -(-I // 64)
    return 2 * (2 * slots * H + recomputed + 3 * slots * I + T * H + T * K + 3 * E * I * H) + partials


def _check_memory(device: torch.device, nbytes: int, num_tokens: int, top_k: int) -> None:
    fits_in_memory(
        "num_tokens",
        nbytes,
        device,
        f"the outputs and workspaces of {num_tokens} tokens ({num_tokens * top_k} routed slots)",
    )


def weight_operand(weights: torch.Tensor) -> torch.Tensor:
    """A weight as TMA reads it: contiguous and starting on a 16-byte boundary (a copy where it does not: a view at
    an odd offset). The layer's other operands are its own allocations, or read through the routing where their
    rows are not aligned (:meth:`_Routed.rows`); so the engine's launches skip their argument checks."""
    return (
        weights
        if weights.is_contiguous() and aligned(weights)
        else weights.clone(memory_format=torch.contiguous_format)
    )


def column_slice(b, cols: slice):
    """The columns ``cols`` of B [E, K, N] as it lies (of each of a pair along K): views, read through their strides."""
    if cols.start == 0 and cols.stop == weights_of(b)[0].shape[2]:
        return b
    if isinstance(b, tuple):
        return tuple(w[:, :, cols] for w in b)
    return b[:, :, cols]


def gate_up_operand(gate_weights: torch.Tensor, up_weights: torch.Tensor):
    """B of the swiglu and dX products: the fused [E, 2I, H] block where the two weights are its row halves (read as
    it lies), else the pair (gate, up), each as :func:`weight_operand` gives it."""
    stacked = stacked_gate_up(gate_weights, up_weights)
    if stacked is not None and aligned(stacked):
        return stacked
    return weight_operand(gate_weights), weight_operand(up_weights)


class _Launches:
    """The engine's launches of one call: the Gluon kernels with the tiles of :func:`gemm_config` on the GPU, their
    plain-Triton twins with their small tiles under the interpreter."""

    def __init__(self, num_slots: int, num_experts: int):
        self.interpreter = interpreter_enabled()
        self.config = None if self.interpreter else gemm_config(num_slots, num_experts)

    def gemm(self, a, b, offsets, **kwargs):
        if self.interpreter:
            return gemm_tl.grouped_gemm_tl(a, b, offsets, **kwargs)
        config = None if kwargs.get("epilogue") == "dswiglu" else self.config  # dswiglu: its own tiles
        # the layer's operands pass the launch's checks by construction (weight_operand): not checked again
        return gemm_gluon.grouped_gemm(a, b, offsets, config=config, check=False, **kwargs)

    def column_tile(self) -> int:
        """The varlen-M products' output tile width."""
        return gemm_tl.SMALL_TILES.block_n if self.interpreter else self.config.block_n

    def partial_rows(self, intermediate_size: int) -> int:
        """Rows of dswiglu's routing-weight partials: one per column tile."""
        config = gemm_tl.SMALL_TILES if self.interpreter else gemm_gluon.default_config("dswiglu")
        return gemm_gluon.partial_rows(intermediate_size, config)

    def weight_grad_column_tile(self) -> int:
        """The weight gradients' output tile width."""
        return wgrad_tl.SMALL_TILES.block_n if self.interpreter else wgrad_gluon.DEFAULT_CONFIG.block_n

    def weight_grad(self, problems, offsets, outs):
        if self.interpreter:
            return wgrad_tl.grouped_weight_grad_tl(problems, offsets, outs=outs)
        return wgrad_gluon.grouped_weight_grad(problems, offsets, outs=outs, check=False)


class _Routed:
    """The routing of one call in expert order, and the gathers and sums over it: offsets [E + 1] (expert e's rows
    are offsets[e] ≤ p < offsets[e + 1]), token_of_row and row_of_slot [T·K] int32, scale w_s [T·K] fp32."""

    def __init__(self, offsets, token_of_row, row_of_slot, scale, num_tokens: int, top_k: int):
        self.offsets, self.token_of_row, self.row_of_slot, self.scale = offsets, token_of_row, row_of_slot, scale
        self.num_tokens, self.top_k = num_tokens, top_k

    @classmethod
    def of(cls, topk_indices: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> _Routed:
        """The routing of ``topk_indices`` [T, K] (sorted on the device: :func:`.packed_routing.packed_routing`)."""
        return cls.unpack(packed_routing(topk_indices, topk_weights, num_experts), *topk_indices.shape, num_experts)

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_tokens: int, top_k: int, num_experts: int) -> _Routed:
        """The routing :func:`.packed_routing.packed_routing` packed, as views of it (nothing computed again)."""
        slots = num_tokens * top_k
        offsets, token_of_row, row_of_slot, scale = packed.split((num_experts + 1, slots, slots, slots))
        return cls(offsets, token_of_row, row_of_slot, scale.view(torch.float32), num_tokens, top_k)

    def gather(self, v: torch.Tensor) -> torch.Tensor:
        """v's rows in expert order, [T·K, cols]."""
        return v.index_select(0, self.token_of_row)

    def rows(self, v: torch.Tensor) -> Gathered | torch.Tensor:
        """v's rows in expert order as an operand of the engine's kernels: read through the routing in the kernel's
        loads, or gathered here where v's rows are not 16-byte aligned (a view at an odd offset)."""
        if v.stride(1) == 1 and (v.stride(0) * v.element_size()) % 16 == 0 and aligned(v):
            return Gathered(v, self.token_of_row)
        return self.gather(v)

    def token_sum(self, rows: torch.Tensor, partial: torch.Tensor | None = None, topk_dtype=None, out=None):
        """[T, cols]: each token's K rows summed in fp32, rounded once (into ``out`` where given); with dswiglu's
        ``partial`` [J, T·K] also (in the same launch) the routing-weight gradient [T, K] in ``topk_dtype``, each
        slot's J parts summed."""
        return sum_slot_rows(rows, self.row_of_slot, self.num_tokens, self.top_k, partial, topk_dtype, out)


def saved_routing(topk_indices: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The routing of one call packed in one int32 tensor: made once by a layer's forward, handed to
    :func:`forward` and :func:`backward` as ``routing`` so that the backward does not sort the slots again."""
    return packed_routing(topk_indices, topk_weights, num_experts)


def _routed(routing, topk_indices, topk_weights, num_experts: int) -> _Routed:
    if routing is None:
        return _Routed.of(topk_indices, topk_weights, num_experts)
    return _Routed.unpack(routing, *topk_indices.shape, num_experts)


def forward(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    save_preactivations: bool = False,
    routing=None,
):
    """y [T, H] (and, with ``save_preactivations``, (g, u) [T·K, I] each in expert order for :func:`backward`);
    ``routing``: :func:`saved_routing` of these inputs, else the routing is made here."""
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    num_slots = T * topk_indices.shape[1]
    _check_memory(
        hidden_states.device,
        allocation_bytes(T, topk_indices.shape[1], H, I, E, backward=False, saved=save_preactivations),
        T,
        topk_indices.shape[1],
    )
    allocate = runtime.allocate
    preactivations = None
    if save_preactivations:  # g and u the halves of one buffer, which the backward may write [dg | du] over
        preactivations = runtime.allocate_preactivations(num_slots, I, hidden_states.dtype, hidden_states.device)
    if num_slots == 0:
        y = allocate((T, H), dtype=hidden_states.dtype, device=hidden_states.device).zero_()
        return (y, preactivations) if save_preactivations else y
    launches = _Launches(num_slots, E)
    routed = _routed(routing, topk_indices, topk_weights, E)
    x_s = routed.rows(hidden_states) if GATHER_IN_LOADS else routed.gather(hidden_states)
    gate_pre, up_pre = preactivations or (None, None)
    act = allocate((num_slots, I), dtype=hidden_states.dtype, device=hidden_states.device)
    launches.gemm(
        x_s,
        gate_up_operand(gate_weights, up_weights),
        routed.offsets,
        epilogue="swiglu",
        out=act,
        gate_out=gate_pre,
        up_out=up_pre,
    )
    del x_s
    y_s = launches.gemm(
        act,
        weight_operand(down_weights),
        routed.offsets,
        epilogue="row_scale",
        scale=routed.scale,
        out=allocate((num_slots, H), dtype=act.dtype, device=act.device),
        b_transposed=True,
    )
    y = routed.token_sum(y_s)
    return (y, preactivations) if save_preactivations else y


def halves_of_one(gate_pre: torch.Tensor, up_pre: torch.Tensor) -> torch.Tensor | None:
    """[g | u] as one [rows, 2I] view where ``gate_pre`` and ``up_pre`` are the two halves of one buffer (as the
    forwards keep them: :func:`.runtime.allocate_preactivations`), else None."""
    rows, I = gate_pre.shape
    together = gate_pre.stride() == up_pre.stride() == (2 * I, 1) and up_pre.shape == gate_pre.shape
    if not together or up_pre.data_ptr() != gate_pre.data_ptr() + I * gate_pre.element_size():
        return None
    return gate_pre.as_strided((rows, 2 * I), (2 * I, 1))


def x_rows_for_weight_grads(
    routed: _Routed, hidden_states: torch.Tensor, gathered: bool, cols: slice = slice(None)
) -> Gathered | torch.Tensor:
    """x's rows in expert order as the weight gradients' operand: read through the routing by the loads (all
    columns; ``gathered``: :func:`gathered_in_weight_grads`), or x_s written out (its columns ``cols``)."""
    if gathered:
        return routed.rows(hidden_states)
    return routed.gather(hidden_states[:, cols])


def x_as_a_in_weight_grads(intermediate_size: int, column_tile: int) -> bool:
    """Whether the gate and up gradients read x gathered as their A operand: with ``X_AS_A_IN_WEIGHT_GRADS`` and
    ``GATHER_IN_LOADS``, where their tiles' ``column_tile`` columns divide their N: I, or 2I as one product
    (``X_AS_A_ONE_PRODUCT``)."""
    columns = 2 * intermediate_size if X_AS_A_ONE_PRODUCT else intermediate_size
    return X_AS_A_IN_WEIGHT_GRADS and GATHER_IN_LOADS and columns % column_tile == 0


def gathered_in_weight_grads(intermediate_size: int, column_tile: int) -> bool:
    """Whether the gate and up gradients' launches read x's rows through the routing (no x_s written)."""
    return (GATHER_X_IN_WEIGHT_GRADS and GATHER_IN_LOADS) or x_as_a_in_weight_grads(intermediate_size, column_tile)


def backward(
    grad_output,
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    preactivations=None,
    weight_grads_out=None,
    routing=None,
    spend_preactivations: bool = False,
):
    """(grad_hidden_states [T, H], grad_topk_weights [T, K], grad_gate [E, I, H], grad_up, grad_down [E, H, I]),
    freshly allocated (the weight gradients into ``weight_grads_out`` where given: where its gate and up gradients
    are the row halves of one fused [E, 2I, H] block, one product writes that block, [dg | du]ᵀ·x_s);
    ``preactivations`` (g, u) saved by :func:`forward` on the same routing, else recomputed; ``routing`` the
    forward's :func:`saved_routing`, else made again. ``spend_preactivations``: the caller needs g and u no more, so
    [dg | du] may be written over them (:data:`GRADS_OVER_SAVED`; their buffer then holds [dg | du])."""
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    num_slots = T * K
    dtype, device = hidden_states.dtype, hidden_states.device
    _check_memory(device, allocation_bytes(T, K, H, I, E, backward=True, saved=preactivations is not None), T, K)
    allocate = runtime.allocate
    launches = _Launches(num_slots, E)
    routed = _routed(routing, topk_indices, topk_weights, E)
    gate_up = gate_up_operand(gate_weights, up_weights)
    x_as_a = x_as_a_in_weight_grads(I, launches.weight_grad_column_tile())
    gathered_x = gathered_in_weight_grads(I, launches.weight_grad_column_tile())
    x_s = None  # x's rows in expert order for the weight gradients (and the first product, recomputed): x_s or Gathered
    if preactivations is None:  # the forward's first product again, g and u stored only
        x_s = x_rows_for_weight_grads(routed, hidden_states, gathered_x)
        gate_pre = allocate((num_slots, I), dtype=dtype, device=device)
        up_pre = allocate((num_slots, I), dtype=dtype, device=device)
        if num_slots:
            launches.gemm(
                x_s,
                gate_up,
                routed.offsets,
                epilogue="swiglu",
                gate_out=gate_pre,
                up_out=up_pre,
            )
    else:
        gate_pre, up_pre = (p[:num_slots] for p in preactivations)
    spend = spend_preactivations and GRADS_OVER_SAVED and preactivations is not None
    d_preact = halves_of_one(gate_pre, up_pre) if spend else None
    if d_preact is None:
        d_preact = allocate((num_slots, 2 * I), dtype=dtype, device=device)  # [dg | du]
    dgate, dup = d_preact[:, :I], d_preact[:, I:]
    scaled_act = allocate((num_slots, I), dtype=dtype, device=device)
    topk_partial = allocate((launches.partial_rows(I), num_slots), dtype=torch.float32, device=device)
    if num_slots:
        launches.gemm(
            routed.rows(grad_output) if GATHER_IN_LOADS else routed.gather(grad_output),
            weight_operand(down_weights),
            routed.offsets,
            epilogue="dswiglu",
            gate=gate_pre,
            up=up_pre,
            scale=routed.scale,
            dgate_out=dgate,
            dup_out=dup,
            scaled_act_out=scaled_act,
            topk_partial=topk_partial,
            b_transposed=False,
        )
        grad_hidden, grad_topk = allocate((T, H), dtype=dtype, device=device), None
        for cols in dx_column_slices(H, I, launches.column_tile()):
            dx_s = launches.gemm(  # [dg | du] · [Wg_e; Wu_e][:, cols]: K = 2I, B the fused block or the pair along K
                d_preact,
                column_slice(gate_up, cols),
                routed.offsets,
                out=allocate((num_slots, cols.stop - cols.start), dtype=dtype, device=device),
                b_transposed=False,
            )
            if grad_topk is None:  # the routing-weight gradient with the first slice's sums, in the same launch
                _, grad_topk = routed.token_sum(dx_s, topk_partial, topk_weights.dtype, out=grad_hidden[:, cols])
            else:
                routed.token_sum(dx_s, out=grad_hidden[:, cols])
            del dx_s
    else:
        grad_hidden = allocate((T, H), dtype=dtype, device=device).zero_()
        grad_topk = allocate((T, K), dtype=topk_weights.dtype, device=device).zero_()
    del gate_pre, up_pre, topk_partial, gate_up

    # the weight gradients, also without slots (experts without rows get their zeros here): Wg's and Wu's first (a
    # column slice of x_s at a time: X_S_IN_COLUMN_SLICES), then Wd's, allocated once [dg | du] and x_s are freed
    def weight_grad(p, shape):
        return allocate(shape, dtype=dtype, device=device) if weight_grads_out is None else weight_grads_out[p]

    grad_gate, grad_up = weight_grad(0, (E, I, H)), weight_grad(1, (E, I, H))
    fused_grad = stacked_gate_up(grad_gate, grad_up)
    whole = x_s is not None or gathered_x  # x_s made for the first product, or never written
    for cols in [slice(0, H)] if whole else x_s_column_slices(num_slots, H, I, E, launches.weight_grad_column_tile()):
        x_cols = x_s if x_s is not None else x_rows_for_weight_grads(routed, hidden_states, gathered_x, cols)
        if x_as_a and fused_grad is not None:  # x_sᵀ·[dg | du] = [dWg; dWu]ᵀ: through the block's transposed view
            launches.weight_grad([(x_cols, d_preact)], routed.offsets, [fused_grad.transpose(1, 2)])
        elif x_as_a and X_AS_A_ONE_PRODUCT:  # the same into dWgᵀ and dWuᵀ as its two column parts
            parts = (grad_gate.transpose(1, 2), grad_up.transpose(1, 2))
            launches.weight_grad([(x_cols, d_preact)], routed.offsets, [parts])
        elif x_as_a:  # x_sᵀ·dg = dWgᵀ, x_sᵀ·du = dWuᵀ: through the gradients' transposed views
            transposed = [grad_gate.transpose(1, 2), grad_up.transpose(1, 2)]
            launches.weight_grad([(x_cols, dgate), (x_cols, dup)], routed.offsets, transposed)
        elif fused_grad is not None:  # the fused block's gradient: [dWg_e; dWu_e] = [dg | du]_eᵀ x_s,e, one product
            launches.weight_grad([(d_preact, x_cols)], routed.offsets, [column_slice(fused_grad, cols)])
        else:
            outs = [column_slice(grad_gate, cols), column_slice(grad_up, cols)]
            launches.weight_grad([(dgate, x_cols), (dup, x_cols)], routed.offsets, outs)
        del x_cols
    del x_s, d_preact, dgate, dup
    grad_down = weight_grad(2, (E, H, I))
    launches.weight_grad([(routed.rows(grad_output), scaled_act)], routed.offsets, [grad_down])
    return grad_hidden, grad_topk, grad_gate, grad_up, grad_down
