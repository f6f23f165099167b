"""What the derivation notebooks (01, 02) compare their hand-written steps against.

The notebooks write each backward step by hand; this module gives them float64 autograd
gradients of every forward tensor (not only of the inputs), relative errors, a step log, the
bf16 error table of P1, what the benchmark's element rule asks of P1's dGate and dUp
(:func:`representation_pass_fractions`) and the tokens-per-expert counts of P2's routings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import problems, reference
from ..moe_experts import route_tokens

P1_OUTPUTS = tuple(problems.load("swiglu_down_backward").output_names)  # notebook 01's problem
P2_OUTPUTS = tuple(problems.load("moe_experts_backward").output_names)  # notebook 02's problem


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (the plain ‖got − want‖ when ``want`` is all zero)."""
    got, want = got.double(), want.double()
    diff = (got - want).norm().item()
    scale = want.norm().item()
    return diff / scale if scale > 0 else diff


class StepLog:
    """Checks hand-derived tensors against autograd one step at a time and remembers the errors."""

    def __init__(self, tolerance: float = 1e-10):
        self.tolerance = tolerance
        self.errors: dict[str, float] = {}

    def check(self, name: str, hand: torch.Tensor, autograd: torch.Tensor) -> None:
        """Print the relative error of ``hand`` against ``autograd``; fail if it exceeds the tolerance."""
        if hand.shape != autograd.shape:
            raise AssertionError(f"{name}: shape {tuple(hand.shape)} by hand, {tuple(autograd.shape)} by autograd")
        error = relative_error(hand, autograd)
        self.errors[name] = error
        print(f"{name:<32} {str(tuple(hand.shape)):<16} relative error vs autograd: {error:.1e}")
        if not error < self.tolerance:
            raise AssertionError(f"{name}: relative error {error:.2e} exceeds {self.tolerance:.0e}")


def _leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _grads(output, named: dict, grad_output) -> dict:
    """Gradients of ⟨grad_output, output⟩ with respect to every tensor in ``named`` (zeros where unused)."""
    grads = torch.autograd.grad(output, list(named.values()), grad_output.double(), allow_unused=True)
    return {name: torch.zeros_like(t) if g is None else g for (name, t), g in zip(named.items(), grads, strict=True)}


def swiglu_autograd_grads(grad_output, x, gate_weight, up_weight, down_weight) -> dict:
    """Float64 autograd gradients of ⟨dy, y⟩ for every tensor of the P1 forward.

    The forward is rebuilt from the four leaves (gate = x·Wgᵀ, gate_sigmoid = σ(gate),
    gate_silu = gate·gate_sigmoid, up = x·Wuᵀ, intermediate = gate_silu·up, y = intermediate·Wdᵀ),
    so the gradient named "gate" is the total one, through σ(gate) as well. Keys: the names of the
    forward tensors and of the leaves.
    """
    x, w_gate, w_up, w_down = _leaves(x, gate_weight, up_weight, down_weight)
    gate = x @ w_gate.T
    gate_sigmoid = torch.sigmoid(gate)
    gate_silu = gate * gate_sigmoid
    up = x @ w_up.T
    intermediate = gate_silu * up
    y = intermediate @ w_down.T
    named = dict(
        intermediate=intermediate,
        gate_silu=gate_silu,
        up=up,
        gate=gate,
        x=x,
        gate_weight=w_gate,
        up_weight=w_up,
        down_weight=w_down,
    )
    return _grads(y, named, grad_output)


def moe_slots(topk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_of_slot, expert_of_slot), each [T·K]: slot s = t·K + k is token t's k-th choice."""
    num_tokens, top_k = topk_indices.shape
    token_of_slot = torch.arange(num_tokens, device=topk_indices.device).repeat_interleave(top_k)
    return token_of_slot, topk_indices.reshape(-1)


def moe_autograd_grads(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights
) -> dict:
    """Float64 autograd gradients of ⟨dy, y⟩ for every tensor of the P2 forward, written per slot.

    Per slot s (token t, expert e): x_slots[s] = x_t (the dispatch), g = Wg_e x_t, u = Wu_e x_t,
    a = silu(g)·u, o = Wd_e a; then y_t = Σ_k w_tk o_tk (the combine). Keys: "x_slots", "g", "u",
    "a", "o" ([T·K, ...] each) and the leaves' names (hidden_states, topk_weights, gate_weights,
    up_weights, down_weights).
    """
    x, w, w_gate, w_up, w_down = _leaves(hidden_states, topk_weights, gate_weights, up_weights, down_weights)
    num_tokens, top_k = topk_indices.shape
    token_of_slot, expert_of_slot = moe_slots(topk_indices)
    x_slots = x[token_of_slot]
    g = torch.einsum("sih,sh->si", w_gate[expert_of_slot], x_slots)
    u = torch.einsum("sih,sh->si", w_up[expert_of_slot], x_slots)
    a = F.silu(g) * u
    o = torch.einsum("shi,si->sh", w_down[expert_of_slot], a)
    y = (w.reshape(-1, 1) * o).reshape(num_tokens, top_k, -1).sum(dim=1)
    named = dict(
        x_slots=x_slots,
        g=g,
        u=u,
        a=a,
        o=o,
        hidden_states=x,
        topk_weights=w,
        gate_weights=w_gate,
        up_weights=w_up,
        down_weights=w_down,
    )
    return _grads(y, named, grad_output)


def swiglu_bf16_errors(inputs: dict) -> dict:
    """How far P1's bf16 reference lands from float64, per output, for bf16 ``inputs`` (the benchmark's).

    Returns {column: {output: relative error}} with the columns
    - "fp32 arithmetic": the reference in fp32 (before rounding) vs float64, same bf16 inputs;
    - "bf16 output rounding": the bf16 outputs vs float64 on the same bf16 inputs;
    - "bf16 saved forward": the bf16 outputs vs float64 autograd of the exact forward from the same
      x, dy and weights (the saved gate, σ, silu, up and intermediate no longer rounded);
    - "recomputed sigmoid": fp32 with σ(fp32(gate)) in place of the saved gate_sigmoid vs the
      reference in fp32 — what a kernel that recomputes σ changes.
    """
    as64 = {k: v.double() for k, v in inputs.items()}
    as32 = {k: v.float() for k, v in inputs.items()}
    exact_saved = reference.swiglu_down_backward_reference(*as64.values())
    fp32 = reference.swiglu_down_backward_reference(*as32.values())
    bf16 = reference.swiglu_down_backward_reference(*inputs.values())
    autograd = swiglu_autograd_grads(
        *(as64[k] for k in ("grad_output", "x", "gate_weight", "up_weight", "down_weight"))
    )
    exact_forward = [autograd[k] for k in ("x", "gate_weight", "up_weight", "down_weight")]
    recomputed = dict(as32, gate_sigmoid=torch.sigmoid(as32["gate"]))
    fp32_recomputed = reference.swiglu_down_backward_reference(*recomputed.values())
    columns = {
        "fp32 arithmetic": (fp32, exact_saved),
        "bf16 output rounding": (bf16, exact_saved),
        "bf16 saved forward": (bf16, exact_forward),
        "recomputed sigmoid": (fp32_recomputed, fp32),
    }
    return {
        column: {name: relative_error(g, w) for name, g, w in zip(P1_OUTPUTS, got, want, strict=True)}
        for column, (got, want) in columns.items()
    }


E4M3_MAX = 448.0  # the largest finite float8 e4m3 value


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).to(torch.float64)


def _fp8(v: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """v [M, N] through fp8 e4m3 with one power-of-two scale per ``block`` (rows, columns) tile, back in
    float64: what a block-scaled fp8 operand carries (each tile's largest element near the format's top)."""
    (m, n), (bm, bn) = v.shape, block
    padded = torch.nn.functional.pad(v, (0, -n % bn, 0, -m % bm))
    tiles = padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-300))))
    rounded = (tiles * scale).to(torch.float8_e4m3fn).to(torch.float64) / scale
    return rounded.reshape(padded.shape)[:m, :n]


# how dGate and dUp can enter the dx, dWg and dWu products, and the tensor work each costs (bf16 products
# per product; an fp8 product runs at twice the bf16 rate on Hopper)
REPRESENTATIONS = {
    "bf16": 1.0,  # rounded to bf16 (the fast path, and torch.compile)
    "fp16": 1.0,  # rounded to fp16, the other operand in fp16 too
    "bf16 hi/lo": 2.0,  # hi = bf16(v), lo = bf16(v − hi), both multiplied (the faithful path)
    "hi + fp8 lo": 1.5,  # hi in bf16; lo in fp8 e4m3 against an fp8 copy of x or of the weights
}
FP8_BLOCK = 128  # elements of the reduction under one fp8 scale


def _represented_products(dg: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> dict:
    """name -> (dg·w, dgᵀ·x) under each of :data:`REPRESENTATIONS` (float64 products of the represented
    operands). The fp8 operands are block-scaled as a kernel can scale them: a scale per FP8_BLOCK elements
    of the reduction (dx = dg·w reduces over I: lo per token × 128 columns, w per 128 × 128 tile; dW = dgᵀ·x
    reduces over T: lo per 128 tokens × column, x per 128 × 128 tile), each K-block's product scaled into
    the fp32 accumulator."""
    hi = _bf16(dg)
    lo = dg - hi
    half = dg.to(torch.float16).double()
    B = FP8_BLOCK
    return {
        "bf16": (hi @ w, hi.T @ x),
        "fp16": (half @ w.to(torch.float16).double(), half.T @ x.to(torch.float16).double()),
        "bf16 hi/lo": ((hi + _bf16(lo)) @ w, (hi + _bf16(lo)).T @ x),
        "hi + fp8 lo": (hi @ w + _fp8(lo, (1, B)) @ _fp8(w, (B, B)), hi.T @ x + _fp8(lo, (B, 1)).T @ _fp8(x, (B, B))),
    }


def representation_pass_fractions(num_tokens: int, scales=(1.0,), seed: int = 0, **axes) -> list[dict]:
    """What the benchmark's element rule asks of P1's dGate and dUp: per activation scale and representation
    (:data:`REPRESENTATIONS`), the fraction of dx, dWg and dWu elements within |out − ref| ≤ atol + rtol·|ref|.

    Inputs as NVIDIA's harness draws them (std-1 activations), the activations (x, dy and the saved tensors)
    multiplied by each of ``scales`` and rounded to bf16; dGate, dUp exact from them, then represented; the
    products exact (float64: a stand-in for fp32 accumulation, whose error is far below these roundings)
    from the represented operands and rounded to bf16 like the outputs; ``ref`` the exact products. Rows:
    tokens, scale, representation, tensor work, "<output> pass" and "<output> rel err" per output."""
    problem = problems.load("swiglu_down_backward")
    rule = problem.element_rule
    weights = ("gate_weight", "up_weight", "down_weight")
    drawn = problem.make_inputs(num_tokens, seed=seed, dtype=torch.float32, distribution="harness", **axes)
    rows = []
    for scale in scales:
        v = {name: _bf16(t.double() * (1.0 if name in weights else scale)) for name, t in drawn.items()}
        s = v["gate_sigmoid"]
        d_a = v["grad_output"] @ v["down_weight"]
        d_gate = d_a * s * (1 + v["gate"] * (1 - s)) * v["up"]
        d_up = d_a * v["gate_silu"]
        gate_terms = _represented_products(d_gate, v["x"], v["gate_weight"])
        up_terms = _represented_products(d_up, v["x"], v["up_weight"])
        exact = {
            "dx": d_gate @ v["gate_weight"] + d_up @ v["up_weight"],
            "dWg": d_gate.T @ v["x"],
            "dWu": d_up.T @ v["x"],
        }
        for name, work in REPRESENTATIONS.items():
            got = {"dx": gate_terms[name][0] + up_terms[name][0], "dWg": gate_terms[name][1], "dWu": up_terms[name][1]}
            row = {"tokens": num_tokens, "scale": float(scale), "representation": name, "tensor work": work}
            for output, ref in exact.items():
                out = _bf16(got[output])
                ok = (out - ref).abs() <= rule["atol"] + rule["rtol"] * ref.abs()
                row[f"{output} pass"] = ok.double().mean().item()
                error = relative_error(out, ref)
                row[f"{output} rel err"] = error if math.isfinite(error) else math.inf  # inf: the format overflowed
            rows.append(row)
    return rows


def routing_load(num_tokens: int, num_experts: int, top_k: int, routing: str, seed: int) -> torch.Tensor:
    """Tokens per expert ([num_experts] int64) for one draw of :func:`moe_lib.moe_experts.route_tokens` seeded
    with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    topk_indices = route_tokens(num_tokens, num_experts, top_k, routing=routing, generator=generator)
    return torch.bincount(topk_indices.reshape(-1), minlength=num_experts)


def load_stats(tokens_per_expert: torch.Tensor) -> dict:
    """min, mean, max, std of the tokens per expert and how many experts got none."""
    counts = tokens_per_expert.double()
    return dict(
        min=int(tokens_per_expert.min()),
        mean=counts.mean().item(),
        max=int(tokens_per_expert.max()),
        std=counts.std().item(),
        empty_experts=int((tokens_per_expert == 0).sum()),
    )


def uniform_load_pmf(num_tokens: int, num_experts: int, top_k: int, counts) -> list[float]:
    """P(an expert gets exactly c tokens) under uniform routing, for each c in ``counts``.

    Each token picks K of the E experts uniformly, so a given expert is picked with probability K/E,
    independently per token: its load is Binomial(T, K/E).
    """
    p = top_k / num_experts
    if p >= 1:
        return [1.0 if c == num_tokens else 0.0 for c in counts]
    log_p, log_q = math.log(p), math.log1p(-p)
    return [
        math.exp(
            math.lgamma(num_tokens + 1)
            - math.lgamma(c + 1)
            - math.lgamma(num_tokens - c + 1)
            + c * log_p
            + (num_tokens - c) * log_q
        )
        if 0 <= c <= num_tokens
        else 0.0
        for c in counts
    ]


# ================================================================ the two draws of P1's inputs (notebook 01)

DRAWS = {"a layer's draw": "forward", "the harness's draw": "harness"}  # label -> make_inputs(distribution=)


def input_scales(num_tokens: int, seed: int = 0, **axes) -> dict:
    """{draw label: {input: standard deviation}} of P1's bf16 inputs under each of :data:`DRAWS`, at the benchmark's
    shape unless ``axes`` say otherwise: how far apart the two draws are, input by input."""
    problem = problems.load("swiglu_down_backward")
    scales = {}
    for label, distribution in DRAWS.items():
        drawn = problem.make_inputs(num_tokens, seed=seed, distribution=distribution, **axes)
        scales[label] = {name: t.double().std().item() for name, t in drawn.items()}
    return scales


def silu_gates_figure(gate_values: torch.Tensor, title: str):
    """Left: σ, silu and silu' over [−6, 6] with the range of ``gate_values`` shaded; right: the histogram of the gate
    values with silu' and its linearisation 1/2 + z/2 over their range. Returns the figure."""
    import matplotlib.pyplot as plt

    low, high = gate_values.min().item(), gate_values.max().item()
    z = torch.linspace(-6, 6, 601, dtype=torch.float64)
    fig, (curves, close_up) = plt.subplots(1, 2, figsize=(12, 4.2))
    curves.plot(z, torch.sigmoid(z), label=r"$\sigma(z)$")
    curves.plot(z, F.silu(z), label=r"$\mathrm{silu}(z) = z\,\sigma(z)$")
    curves.plot(z, reference.silu_grad(z), label=r"$\mathrm{silu}'(z) = \sigma(z)\,(1 + z\,(1-\sigma(z)))$")
    curves.axvspan(low, high, color="tab:gray", alpha=0.35, label="range of the gate values")
    curves.set(xlabel="z", ylabel="value", title="SiLU, its derivative and the sigmoid")
    curves.grid(alpha=0.3)
    curves.legend(loc="upper left", fontsize=9)
    close_up.hist(gate_values, bins=80, density=True, color="tab:gray", alpha=0.6, label="gate values (bf16)")
    close_up.set(xlabel="gate value z", ylabel="density", title=title)
    slope = close_up.twinx()
    z_near = torch.linspace(low, high, 200, dtype=torch.float64)
    slope.plot(
        z_near, reference.silu_grad(z_near), color="tab:green", linewidth=4, alpha=0.5, label=r"$\mathrm{silu}'(z)$"
    )
    slope.plot(z_near, 0.5 + z_near / 2, color="black", linestyle=":", label=r"$1/2 + z/2$")
    slope.set_ylabel(r"$\mathrm{silu}'(z)$")
    handles = close_up.get_legend_handles_labels()[0] + slope.get_legend_handles_labels()[0]
    close_up.legend(handles=handles, loc="upper left", fontsize=9)
    fig.tight_layout()
    return fig


def element_rule_figure(rows: list[dict]):
    """The rows of :func:`representation_pass_fractions` as bars: per activation scale (a panel each), the share of
    each output's elements within the rule under each representation, the rule's 99% dashed. Returns the figure."""
    import matplotlib.pyplot as plt
    import pandas as pd

    table = pd.DataFrame(rows).set_index(["scale", "representation"])
    pass_columns = [c for c in table.columns if c.endswith(" pass")]
    scales = list(dict.fromkeys(table.index.get_level_values("scale")))
    fig, panels = plt.subplots(1, len(scales), figsize=(6.5 * len(scales), 3.6), sharey=True, squeeze=False)
    for panel, scale in zip(panels[0], scales, strict=True):
        part = table.xs(scale, level="scale")
        for offset, column in enumerate(pass_columns):
            panel.bar(
                [i + 0.25 * (offset - 1) for i in range(len(part))],
                100 * part[column],
                width=0.25,
                label=column.removesuffix(" pass"),
            )
        panel.axhline(99, color="black", ls="--", lw=1, label="the rule's 99%")
        panel.set_xticks(range(len(part)), [f"{name}\n({work:g}× work)" for name, work in part["tensor work"].items()])
        panel.set(title=f"activations ×{scale:g} ({int(part['tokens'].iloc[0])} tokens)", ylim=(85, 100.5))
    panels[0, 0].set_ylabel("% of elements within the rule")
    panels[0, -1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    return fig


# ================================================================ P2's element rule and grad_topk_weights (notebook 02)


def _split_bf16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) = (bf16(v), bf16(v − hi)), both back in float64: a bf16×3 operand."""
    hi = _bf16(v)
    return hi, _bf16(v - hi)


def _bf16x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b as three bf16 products hi·hi + hi·lo + lo·hi (float64 accumulation: a stand-in for fp32's)."""
    (a_hi, a_lo), (b_hi, b_lo) = _split_bf16(a), _split_bf16(b)
    return a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi


def topk_weight_grad_rule(num_rows: int, seed: int = 0, **axes) -> dict:
    """Why P2's element rule has atol = 0.11, measured on ``grad_topk_weights``: ``num_rows`` rows of one expert drawn
    with P2's distributions (at the benchmark's H and I unless ``axes`` say otherwise), dw = ⟨W_dᵀ dy, a⟩ computed
    exactly and with its three products (g, u and W_dᵀ dy) taken as one bf16 product each or as bf16×3 products.

    Returns the elements' standard deviation and median magnitude, the rule's atol and rtol, and per way of
    multiplying the share of elements within atol + rtol·|ref| and the relative error."""
    problem = problems.load("moe_experts_backward")
    drawn = problem.make_inputs(num_rows, seed=seed, dtype=torch.float32, num_experts=1, top_k=1, **axes)
    x, dy = drawn["hidden_states"].double(), drawn["grad_output"].double()
    w_gate, w_up = drawn["gate_weights"][0].double().T, drawn["up_weights"][0].double().T  # [H, I]
    w_down = drawn["down_weights"][0].double()  # [H, I]

    def grad_topk(product) -> torch.Tensor:
        g, u, v = product(x, w_gate), product(x, w_up), product(dy, w_down)
        return (v * F.silu(g) * u).sum(dim=1)

    exact = grad_topk(torch.matmul)
    ways = {"one bf16 product": lambda a, b: _bf16(a) @ _bf16(b), "bf16×3": _bf16x3}
    rule = problem.element_rule
    result = {
        "rows": num_rows,
        "std": exact.std().item(),
        "median |dw|": exact.abs().median().item(),
        "atol": rule["atol"],
        "rtol": rule["rtol"],
    }
    for name, product in ways.items():
        got = grad_topk(product)
        within = (got - exact).abs() <= rule["atol"] + rule["rtol"] * exact.abs()
        result[f"{name} pass"] = within.double().mean().item()
        result[f"{name} rel err"] = relative_error(got, exact)
    return result


# ================================================================ P2's routing figures (notebook 02)


def tokens_per_expert_figure(loads: dict, num_tokens: int, top_k: int):
    """One panel per routing of ``loads`` ({routing: tokens per expert}): the experts sorted by load, the mean T·K/E
    dashed (skewed and hot routings on a log scale). Returns the figure."""
    import matplotlib.pyplot as plt

    num_experts = len(next(iter(loads.values())))
    mean_load = num_tokens * top_k / num_experts
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4.2), squeeze=False)
    for ax, (name, load) in zip(axes[0], loads.items(), strict=True):
        ax.bar(range(num_experts), load.sort(descending=True).values, width=1.0, color="tab:blue")
        ax.axhline(mean_load, color="tab:red", linestyle="--", label=f"mean T·K/E = {mean_load:g}")
        ax.set(title=f'"{name}" routing', xlabel="expert (sorted by load)", ylabel="tokens")
        if name != "uniform":
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.8)
            ax.set_ylabel("tokens (log scale)")
        ax.legend(loc="upper right")
    fig.suptitle(f"Tokens per expert: T={num_tokens}, E={num_experts}, K={top_k}")
    fig.tight_layout()
    return fig


def load_histogram_figure(load: torch.Tensor, num_tokens: int, top_k: int, seed: int):
    """The histogram of one uniform routing's loads beside E · Binomial(T, K/E). Returns the figure."""
    import matplotlib.pyplot as plt

    num_experts = len(load)
    mean_load = num_tokens * top_k / num_experts
    counts = range(int(load.min()) - 5, int(load.max()) + 6)
    expected = [num_experts * p for p in uniform_load_pmf(num_tokens, num_experts, top_k, counts)]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.hist(
        load,
        bins=range(counts.start, counts.stop + 1),
        align="left",
        color="tab:blue",
        alpha=0.7,
        label=f"experts, one draw (seed {seed})",
    )
    ax.plot(
        counts,
        expected,
        color="black",
        marker=".",
        label=f"expected: E · Binomial(T, K/E) = {num_experts} · B({num_tokens}, {top_k}/{num_experts})",
    )
    ax.axvline(mean_load, color="tab:red", linestyle="--", label=f"mean {mean_load:g}")
    ax.set(xlabel="tokens per expert", ylabel="experts", title='"uniform" routing: the load of each expert')
    ax.set_ylim(top=1.4 * ax.get_ylim()[1])
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig
