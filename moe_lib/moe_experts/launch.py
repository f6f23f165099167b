"""P2's host side: one call of the backward or the forward, its workspaces and its launch plan.

Each call asks :mod:`.choose` for its tiles and the designs of kernels W and D (:mod:`.designs`), then runs
kernel A, the chosen W, the chosen D and kernel C (A and C have one design each: :mod:`.kernels`).

Workspace (freed when the call returns; outputs are freshly allocated and fully written):
    dg, du, aw        3 · T·K · I   in bf16 (the input dtype for 16-bit inputs)
    dX_slot           T·K · H       fp32
    x, dy sorted      2 · T·K · H   bf16 (the input dtype for 16-bit inputs): the TMA-fed kernel W's operands
    x, dy halves      4 · T · H     bf16, fp32 inputs only
    topk partials     cdiv(I, BLOCK_I) · T·K   fp32
    routing           T·K int32 + E + 1 int32, and torch.sort's int64 outputs (2 · T·K)
At the benchmark's shape (H = 4096, I = 2048, E = 256, K = 8) and T = 8192 (T·K = 65536):
768 MiB + 1 GiB + 1 GiB + 256 MiB + 8 MiB + 1.3 MiB ≈ 3.0 GiB; at T = 2048, ≈ 0.75 GiB.
Where kernel W multiplies bf16×3 (fp32 inputs with many rows per expert: :func:`~.choose.weight_grad_products`),
the lo halves add to these:
    dg, du, aw lo     3 · T·K · I   bf16
    x, dy lo sorted   2 · T·K · H   bf16 (the TMA-fed kernel W's)
At Mixtral-8x7B's shape (H = 4096, I = 14336, E = 8, K = 2) and T = 4096 (T·K = 8192): 672 MiB + 128 MiB more.

Predicted DRAM traffic at the benchmark's shape, T = 2048, with the weights read once per kernel:
fp32: A reads Wg, Wu, Wd (25.8 GB), W writes dWg, dWu, dWd (25.8 GB), D reads Wg, Wu (17.2 GB);
the workspaces and activations add ≈ 1 GB: ≈ 70 GB, 1.35× the floor (≈ 16.5 ms at 4.2 TB/s).
bf16: 12.9 + 12.9 + 8.6 + ≈ 0.6 GB ≈ 35 GB (≈ 8.3 ms). At T = 8192 in fp32 the 18·T·K·H·I FLOPs of
kernel A's split products plus 10·T·K·H·I in W and D (15.4 TFLOP) bound the time instead.
"""

from __future__ import annotations

import functools

import torch

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from ..validation import check_contiguous, fits_in_memory
from . import engine_layer, kernels, runtime
from .choose import Choice, choose
from .config import KernelLaunch, LaunchConfig
from .routing import route_by_expert
from .runtime import (
    OPERAND_DTYPES,
    PLAIN_PRODUCTS,
    SPLIT_PRODUCTS,
    WORKSPACE_DTYPES,
    Target,
    default_persistent_programs,
    operand_halves,
    persistent_programs,
)
from .weights import stacked_gate_up


def launch_plan(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    config: LaunchConfig | Choice,
    *,
    num_programs: int | None = None,
    weight_bytes: int = 2,
) -> dict[str, KernelLaunch]:
    """P2's backward under ``config``: kernels A, W (twice), D and C, by step, in launch order.

    ``config``: a call's :class:`~.choose.Choice`, or a :class:`LaunchConfig` whose designs the chooser picks for
    weights of ``weight_bytes`` (4 for the fp32 interface) on a Hopper GPU (or the interpreter, where it is on).
    The TMA-fed designs of kernels W and D run persistent: ``num_programs`` programs looping over their tiles (one
    per SM; by default :func:`~.runtime.default_persistent_programs`). Kept per arguments: every call asks for its
    plan, and the same shapes give the same plan (a fresh dict each time; its launches are frozen)."""
    key = (num_tokens, hidden_size, intermediate_size, num_experts, top_k, config, num_programs, weight_bytes)
    key += (interpreter_enabled(),)  # the designs and the default programs depend on it
    try:
        hash(key)
    except TypeError:  # a config built with lists: planned afresh
        return _launch_plan(*key)
    return dict(_launch_plan_kept(*key))


def _launch_plan(T, H, I, E, K, config, num_programs, weight_bytes, interpreter) -> dict[str, KernelLaunch]:
    choice = config
    if isinstance(config, LaunchConfig):  # bf16 and fp16 take the same designs
        dtype = torch.float32 if weight_bytes == 4 else torch.bfloat16
        choice = choose(T * K, E, H, I, dtype, Target(interpreter=interpreter), config=config, top_k=K)
    config = choice.config
    launched = T * K > 0
    num_programs = num_programs or default_persistent_programs()
    split = choice.weight_grad_products == SPLIT_PRODUCTS
    plan = {}
    plan["A"] = KernelLaunch(
        "A",
        {"experts": E, "I-tiles": cdiv(I, config.block_i), "row split": config.row_split},
        f"gᵀ, uᵀ, (Wdᵀdy)ᵀ on an I-tile of {config.block_i} (M side) for row blocks r, r+R, … of "
        f"{config.block_m} rows (N side), over H in steps of {config.block_h}; dSwiGLU and ⟨Wdᵀdy, a⟩ in the "
        "epilogue" + ("; dg, du, aw stored as bf16 hi and lo halves" if split else ""),
        launched,
    )
    plan |= choice.weight_grad.plan(E, H, I, config, num_programs, products=choice.weight_grad_products)
    plan["D"] = choice.slot_projection.plan(E, H, I, config, num_programs, launched)
    plan["C"] = KernelLaunch(
        "C",
        {"tokens": T, "H-tiles": cdiv(H, config.block_h_sum)},
        f"grad_hidden_states[t] = Σ_k dX_slot[t·K + k] on {config.block_h_sum} columns; grad_topk_weights "
        "summed over the I-tiles' partials",
        launched,
    )
    return plan


_launch_plan_kept = functools.lru_cache(maxsize=1024)(_launch_plan)


# what kernel A does with the pre-activations g and u (its PREACT)
PREACT_COMPUTED, PREACT_STORED, PREACT_READ = 0, 1, 2


def launch_swiglu_grad(
    config,
    plan,
    routing,
    x_halves,
    dy_halves,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    dgate,
    dup,
    scaled_act,
    topk_partial,
    *,
    forward_only: bool,
    preactivations=None,
    preact=PREACT_COMPUTED,
    lo_workspaces=None,
):
    """Kernel A over every (expert, I-tile, row split); ``forward_only`` stores aw alone (dy unused);
    ``preactivations`` (g, u), each [T·K, I] by sorted position, written (PREACT_STORED) or read
    instead of recomputed (PREACT_READ); ``lo_workspaces`` (dg_lo, du_lo, aw_lo), laid out as dgate, dup and
    scaled_act: where given, the lo halves are stored there (kernel W's bf16×3 products)."""
    H = x_halves[0].shape[1]
    I = gate_weights.shape[1]
    num_slots, top_k = topk_weights.numel(), topk_weights.shape[1]
    gate_pre, up_pre = preactivations if preactivations is not None else (scaled_act, scaled_act)
    store_lo = lo_workspaces is not None
    kernels.swiglu_grad_kernel[(plan["A"].programs,)](
        *x_halves,
        *dy_halves,
        topk_weights,
        gate_weights,
        up_weights,
        down_weights,
        routing.sorted_slot,
        routing.expert_offsets,
        dgate,
        dup,
        scaled_act,
        *(lo_workspaces if store_lo else (dgate, dup, scaled_act)),  # unused without STORE_LO
        topk_partial,
        gate_pre,
        up_pre,
        gate_pre.stride(0),
        num_slots,
        top_k,
        H,
        I,
        plan["A"].grid["I-tiles"],
        config.row_split,
        OPERAND_DTYPE=OPERAND_DTYPES[x_halves[0].dtype],
        SPLIT_PRECISION=gate_weights.dtype == torch.float32,
        FORWARD_ONLY=forward_only,
        PREACT=preact,
        STORE_LO=store_lo,
        INTERPRETER=interpreter_enabled(),
        BLOCK_I=config.block_i,
        BLOCK_M=config.block_m,
        BLOCK_H=config.block_h,
        num_warps=config.warps_a,
        num_stages=config.stages_a,
    )


def launch_token_sum(config, plan, out_slot, topk_indices, num_experts, out, topk_partial=None, grad_topk=None):
    """Kernel C: out[t] = Σ_k out_slot[t·K + k] over the slots routed to an expert in [0, E); with
    ``grad_topk``, also the routing-weight sums."""
    T, H = out.shape
    top_k = topk_indices.shape[1]
    with_topk = grad_topk is not None
    kernels.token_sum_kernel[tuple(plan["C"].grid.values())](
        out_slot,
        topk_partial if with_topk else out_slot,
        topk_indices,
        out,
        grad_topk if with_topk else out,
        T * top_k,
        top_k,
        num_experts,
        H,
        topk_partial.shape[0] if with_topk else 1,
        WITH_TOPK=with_topk,
        INTERPRETER=interpreter_enabled(),
        BLOCK_H=config.block_h_sum,
        BLOCK_K=max(1, 1 << (top_k - 1).bit_length()),
        num_warps=4,
    )


def allocation_bytes(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    choice: Choice,
    *,
    forward_only: bool = False,
    save_preactivations: bool = False,
) -> int:
    """Bytes of the outputs and workspaces one call allocates (the table in this module's docstring, with the lo
    halves where ``choice`` has kernel W multiply bf16×3; a forward that saves the pre-activations adds 2 · T·K · I
    in the hidden dtype)."""
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    slots = max(T * K, 1)
    item = hidden_states.element_size()
    workspace_item = WORKSPACE_DTYPES[hidden_states.dtype].itemsize
    halves = 2 * T * H * workspace_item if hidden_states.dtype == torch.float32 else 0  # per split operand
    routing = 4 * slots + 4 * (E + 1) + 16 * slots
    if forward_only:  # y; aw; y per slot; x's halves; g and u where they are saved
        saved = 2 * slots * I * item if save_preactivations else 0
        return T * H * item + slots * I * workspace_item + slots * H * 4 + halves + routing + saved
    outputs = (T * H + 3 * E * I * H) * item + T * K * topk_weights.element_size()
    split = choice.weight_grad_products == SPLIT_PRODUCTS
    workspaces = (
        (6 if split else 3) * slots * I * workspace_item  # dg, du, aw (and their lo halves)
        + cdiv(I, choice.config.block_i) * slots * 4
        + slots * H * 4
        + 2 * halves
        + choice.weight_grad.workspace_bytes(slots, H, workspace_item, split=split)
    )
    return outputs + workspaces + routing


def check_memory(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    choice: Choice,
    *,
    forward_only=False,
    save_preactivations=False,
) -> None:
    """Refuses, before anything is allocated, a call whose outputs and workspaces exceed the device's memory."""
    T, K = topk_indices.shape
    nbytes = allocation_bytes(
        hidden_states,
        topk_indices,
        topk_weights,
        gate_weights,
        choice,
        forward_only=forward_only,
        save_preactivations=save_preactivations,
    )
    fits_in_memory(
        "num_tokens", nbytes, hidden_states.device, f"the outputs and workspaces of {T} tokens ({T * K} routed slots)"
    )


def check_weight_grads_out(weight_grads_out, gate_weights, down_weights) -> tuple:
    """``weight_grads_out`` as (grad_gate, grad_up, grad_down) when each is a contiguous tensor of its weight's
    shape, dtype and device, or grad_gate and grad_up are the row halves of one fused [E, 2I, H] block
    (:func:`.weights.stacked_gate_up`: a model's ``gate_up_proj`` gradient); a ValueError naming the first that is
    not."""
    expected = (gate_weights, gate_weights, down_weights)
    if not isinstance(weight_grads_out, (tuple, list)) or len(weight_grads_out) != 3:
        raise ValueError(f"weight_grads_out: expected three tensors (gate, up, down), got {type(weight_grads_out)}")
    fused = all(isinstance(out, torch.Tensor) for out in weight_grads_out[:2]) and (
        stacked_gate_up(*weight_grads_out[:2]) is not None
    )
    for name, out, weights in zip(("gate", "up", "down"), weight_grads_out, expected, strict=True):
        if not (
            isinstance(out, torch.Tensor)
            and out.shape == weights.shape
            and out.dtype == weights.dtype
            and out.device == weights.device
            and (out.is_contiguous() or (fused and name != "down"))
        ):
            got = (
                f"{tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ValueError(
                f"weight_grads_out: the {name} gradient must be a contiguous {tuple(weights.shape)} "
                f"{weights.dtype} tensor on {weights.device} (gate and up: or the row halves of one fused block), "
                f"got {got}"
            )
    return tuple(weight_grads_out)


def _separate(gate_weights, up_weights) -> tuple:
    """Kernels A, W, D and C read each weight as packed rows: the halves of a fused [E, 2I, H] block (which the
    engine reads as it lies) are copied; anything else is left as it is for the checks."""
    if stacked_gate_up(gate_weights, up_weights) is None:
        return gate_weights, up_weights
    return gate_weights.contiguous(), up_weights.contiguous()


def choose_for(hidden_states, topk_indices, gate_weights, up_weights, down_weights, config, products=None) -> Choice:
    """The chooser's answer for these inputs (``config``: tiles given by the caller, or None; ``products``: kernel
    W's products given by the caller, or None)."""
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config: expected a LaunchConfig or None, got {type(config).__name__}")
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    aligned = all(w.data_ptr() % 16 == 0 for w in (gate_weights, up_weights, down_weights))
    return choose(
        T * K,
        E,
        H,
        I,
        hidden_states.dtype,
        Target.of(hidden_states.device),
        config=config,
        weights_aligned=aligned,
        top_k=K,
        products=products,
    )


def moe_experts_backward_triton(
    grad_output,
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    config: LaunchConfig | None = None,
    preactivations=None,
    weight_grads_out=None,
    products: str | None = None,
    routing=None,
    spend_preactivations: bool = False,
):
    """P2 with the Triton kernels; inputs already validated and contiguous (see :mod:`.api`), except that gate and
    up weights may be the row halves of one fused [E, 2I, H] block (:mod:`.weights`).

    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]); the
    routing-weight gradient in topk_weights' dtype, the rest in the hidden dtype.
    ``weight_grads_out``: three contiguous tensors of those shapes and dtype (e.g. views of a larger
    set of experts' gradients; gate and up also the row halves of one fused [E, 2I, H] block) that the weight
    gradients are written into and returned as. ``routing``: :func:`layer_routing` of the forward where it made
    one (the engine's), read instead of sorting the slots again. ``config``
    overrides the tile sizes (default: :func:`~.choose.launch_config`'s); ``preactivations`` (g, u) saved by
    :func:`moe_experts_forward_triton` on the same routing are read instead of recomputed (kernel A then does
    one product of three); with ``spend_preactivations`` (the caller needs them no more) the engine may write its
    [dg | du] over them (:func:`.engine_layer.backward`). ``products`` overrides kernel W's ("plain" or "bf16x3",
    fp32 inputs only; default: :func:`~.choose.weight_grad_products`'s rule).
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    # kernel W's products named by the caller ask for kernels A, W, D and C
    if (
        config is None
        and products is None
        and engine_layer.structure(T * K, E, H, I, dtype, Target.of(device)) == "engine"
    ):
        if weight_grads_out is not None:
            weight_grads_out = check_weight_grads_out(weight_grads_out, gate_weights, down_weights)
        return engine_layer.backward(
            grad_output,
            hidden_states,
            topk_indices,
            topk_weights,
            gate_weights,
            up_weights,
            down_weights,
            preactivations=preactivations,
            weight_grads_out=weight_grads_out,
            routing=routing,
            spend_preactivations=spend_preactivations,
        )
    num_slots = T * K
    gate_weights, up_weights = _separate(gate_weights, up_weights)
    choice = choose_for(hidden_states, topk_indices, gate_weights, up_weights, down_weights, config, products)
    config, programs = choice.config, persistent_programs(device)
    plan = launch_plan(T, H, I, E, K, choice, num_programs=programs)
    split_precision = dtype == torch.float32
    check_memory(hidden_states, topk_indices, topk_weights, gate_weights, choice)

    allocate = runtime.allocate
    if weight_grads_out is None:
        grad_gate = allocate((E, I, H), dtype=dtype, device=device)
        grad_up = allocate((E, I, H), dtype=dtype, device=device)
        grad_down = allocate((E, H, I), dtype=dtype, device=device)
    else:
        grad_gate, grad_up, grad_down = check_weight_grads_out(weight_grads_out, gate_weights, down_weights)
    fused_out = None
    if not grad_gate.is_contiguous():  # the halves of a fused block: kernel W writes packed rows, copied in below
        fused_out = grad_gate, grad_up
        grad_gate, grad_up = (allocate((E, I, H), dtype=dtype, device=device) for _ in range(2))
    grad_hidden = allocate((T, H), dtype=dtype, device=device)
    grad_topk = allocate((T, K), dtype=topk_weights.dtype, device=device)

    routing = route_by_expert(topk_indices, E)
    ws_rows = max(num_slots, 1)  # kernels take no zero-size buffers
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    dgate = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    dup = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    scaled_act = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    topk_partial = allocate((plan["A"].grid["I-tiles"], ws_rows), dtype=torch.float32, device=device)
    dx_slot = allocate((ws_rows, H), dtype=torch.float32, device=device)
    x_halves = operand_halves(hidden_states, split_precision, workspace_dtype)
    dy_halves = operand_halves(grad_output, split_precision, workspace_dtype)
    lo_workspaces = None
    if choice.weight_grad_products == SPLIT_PRODUCTS:  # kernel W's bf16×3 products: dg, du and aw's lo halves
        lo_workspaces = tuple(allocate((ws_rows, I), dtype=workspace_dtype, device=device) for _ in range(3))

    if num_slots > 0:
        launch_swiglu_grad(
            config,
            plan,
            routing,
            x_halves,
            dy_halves,
            topk_weights,
            gate_weights,
            up_weights,
            down_weights,
            dgate,
            dup,
            scaled_act,
            topk_partial,
            forward_only=False,
            preactivations=preactivations,
            preact=PREACT_COMPUTED if preactivations is None else PREACT_READ,
            lo_workspaces=lo_workspaces,
        )
    # kernel W runs also without slots: it writes the zeros of experts without rows
    choice.weight_grad.run(
        config,
        routing,
        K,
        x_halves[0],
        dy_halves[0],
        dgate,
        dup,
        scaled_act,
        grad_gate,
        grad_up,
        grad_down,
        num_programs=programs,
        lo_halves=None if lo_workspaces is None else (x_halves[1], dy_halves[1], *lo_workspaces),
    )
    if num_slots > 0:
        # dX_slot = Wg_eᵀ dg + Wu_eᵀ du: Wg[e][i, h] at i·H + h
        choice.slot_projection.run(
            config,
            routing,
            gate_weights,
            up_weights,
            dgate,
            dup,
            dx_slot,
            transposed_weights=True,
            num_programs=programs,
        )
        launch_token_sum(config, plan, dx_slot, topk_indices, E, grad_hidden, topk_partial, grad_topk)
    else:  # no slots at all (T = 0 or K = 0): nothing reaches grad_hidden_states
        grad_hidden.zero_()
    if fused_out is not None:
        for out, grad in zip(fused_out, (grad_gate, grad_up), strict=True):
            out.copy_(grad)
        grad_gate, grad_up = fused_out
    return grad_hidden, grad_topk, grad_gate, grad_up, grad_down


def layer_routing(hidden_states, topk_indices, topk_weights, gate_weights):
    """The routing a layer's forward makes once and hands its backward (``routing`` of both), where the engine runs
    the call (:func:`.engine_layer.saved_routing`); None where kernels A, W, D and C do (they route in place)."""
    if layer_routing_size(hidden_states, topk_indices, gate_weights) == 0:
        return None
    return engine_layer.saved_routing(topk_indices, topk_weights, gate_weights.shape[0])


def layer_routing_size(hidden_states, topk_indices, gate_weights) -> int:
    """The length of :func:`layer_routing`'s tensor (0: none), from the shapes (the layer op's fake says it)."""
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    slots = T * topk_indices.shape[1]
    if engine_layer.structure(slots, E, H, I, hidden_states.dtype, Target.of(hidden_states.device)) != "engine":
        return 0
    return E + 1 + 3 * slots


def moe_experts_forward_triton(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    config: LaunchConfig | None = None,
    save_preactivations: bool = False,
    routing=None,
):
    """The layer's forward y [T, H] (hidden dtype), y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t),
    with the backward's kernels: A without dy (aw = w·a only), D with Wd in place of Wgᵀ and Wuᵀ
    (y per slot), C without the routing-weight gradient. Same precision as the backward: fp32 inputs
    get bf16×3 products for g and u, and a plain bf16 product (aw and Wd rounded) for Wd·aw.
    With ``save_preactivations`` returns (y, (g, u)): the pre-activations, [T·K, I] each in the hidden
    dtype, rows in expert order (the column halves of one buffer: :func:`.runtime.allocate_preactivations`), for
    :func:`moe_experts_backward_triton`'s ``preactivations``. The kernels
    address every input by row-major strides: others are refused by name, except gate and up weights that are the
    row halves of one fused [E, 2I, H] block (:mod:`.weights`: the engine reads the block, the other kernels copy).
    ``routing``: :func:`layer_routing` of these inputs, where the layer keeps it for the backward.
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    num_slots = T * K
    if config is None and engine_layer.structure(num_slots, E, H, I, dtype, Target.of(device)) == "engine":
        return engine_layer.forward(
            hidden_states,
            topk_indices,
            topk_weights,
            gate_weights,
            up_weights,
            down_weights,
            save_preactivations=save_preactivations,
            routing=routing,
        )
    gate_weights, up_weights = _separate(gate_weights, up_weights)
    # the forward runs no kernel W: plain products, whatever its backward will multiply
    choice = choose_for(hidden_states, topk_indices, gate_weights, up_weights, down_weights, config, PLAIN_PRODUCTS)
    config, programs = choice.config, persistent_programs(device)
    check_memory(
        hidden_states,
        topk_indices,
        topk_weights,
        gate_weights,
        choice,
        forward_only=True,
        save_preactivations=save_preactivations,
    )
    check_contiguous(
        dict(
            hidden_states=hidden_states,
            topk_indices=topk_indices,
            topk_weights=topk_weights,
            gate_weights=gate_weights,
            up_weights=up_weights,
            down_weights=down_weights,
        )
    )
    allocate = runtime.allocate
    y = allocate((T, H), dtype=dtype, device=device)
    preactivations = None
    if save_preactivations:
        preactivations = runtime.allocate_preactivations(num_slots, I, dtype, device)
    if num_slots == 0:
        y.zero_()
        return (y, preactivations) if save_preactivations else y
    plan = launch_plan(T, H, I, E, K, choice, num_programs=programs)
    routing = route_by_expert(topk_indices, E)
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    scaled_act = allocate((num_slots, I), dtype=workspace_dtype, device=device)
    y_slot = allocate((num_slots, H), dtype=torch.float32, device=device)
    x_halves = operand_halves(hidden_states, dtype == torch.float32, workspace_dtype)
    # kernel A without dy: the dy, dg, du and top-k partial arguments are never touched
    launch_swiglu_grad(
        config,
        plan,
        routing,
        x_halves,
        x_halves,
        topk_weights,
        gate_weights,
        up_weights,
        down_weights,
        scaled_act,
        scaled_act,
        scaled_act,
        y_slot,
        forward_only=True,
        preactivations=preactivations,
        preact=PREACT_STORED if save_preactivations else PREACT_COMPUTED,
    )
    # y_slot = Wd_e · aw: Wd[e][h, i] at h·I + i
    choice.slot_projection_forward.run(
        config, routing, down_weights, None, scaled_act, None, y_slot, transposed_weights=False, num_programs=programs
    )
    launch_token_sum(config, plan, y_slot, topk_indices, E, y)
    return (y, preactivations) if save_preactivations else y
