"""Solutions of the lesson notebooks' exercises (moe_lib.lab.exercises), kept off the pages: the tests check that
each checker passes them and fails wrong answers."""

import math

import torch
import triton
import triton.language as tl

from moe_lib.lab.ring import kernel_schedule

# ---------------------------------------------------------------- 01


def d_gate_recomputed(d_a, gate, up):
    s = torch.sigmoid(gate)
    return d_a * up * s * (1 + gate * (1 - s))


def geglu_backward(d_a, gate, up):
    cdf = 0.5 * (1 + torch.erf(gate / math.sqrt(2)))  # Φ(z)
    pdf = torch.exp(-0.5 * gate**2) / math.sqrt(2 * math.pi)  # φ(z)
    return d_a * up * (cdf + gate * pdf), d_a * gate * cdf


def hi_lo_split(v):
    hi = v.to(torch.bfloat16)
    return hi, (v - hi.float()).to(torch.bfloat16)


# ---------------------------------------------------------------- 02


def grad_topk_weights(dy, x, topk_indices, w_gate, w_up, w_down):
    dw = torch.zeros(topk_indices.shape, dtype=dy.dtype)
    for t in range(topk_indices.shape[0]):
        for k in range(topk_indices.shape[1]):
            e = topk_indices[t, k]
            a = torch.nn.functional.silu(w_gate[e] @ x[t]) * (w_up[e] @ x[t])
            dw[t, k] = (w_down[e].T @ dy[t]) @ a
    return dw


def router_backward(logits, d_w):
    w = torch.softmax(logits, dim=-1)
    return w * (d_w - (d_w * w).sum(dim=-1, keepdim=True))


def expected_empty_experts(T, E, K):
    return E * (1 - K / E) ** T


# ---------------------------------------------------------------- 03


def p1_cost(T, H, I):
    return 12 * T * H * I, 2 * (3 * T * H + 5 * T * I + 6 * I * H)


def ridge_crossing(H, I, peak_flops, bandwidth):
    a, b, c = 12 * H * I, 2 * (3 * H + 5 * I), 12 * I * H
    ridge = peak_flops / bandwidth
    return ridge * c / (a - ridge * b) if a > ridge * b else math.inf


def expert_intensity(T, H, I, E, K):
    m = T * K / E
    return 4 * m * H * I / (2 * (m * H + 2 * H * I + 2 * m * I))


# ---------------------------------------------------------------- 04


@triton.jit
def grad_down_kernel(
    dy_ptr, a_ptr, out_ptr, T, H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # of H
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, T, BLOCK_K):
        tokens = k + tl.arange(0, BLOCK_K)
        dy_t = tl.load(
            dy_ptr + tokens[None, :] * H + rows[:, None], mask=(tokens[None, :] < T) & (rows[:, None] < H), other=0.0
        )
        a = tl.load(
            a_ptr + tokens[:, None] * I + cols[None, :], mask=(tokens[:, None] < T) & (cols[None, :] < I), other=0.0
        )
        acc += tl.dot(dy_t, a)
    tl.store(out_ptr + rows[:, None] * I + cols[None, :], acc, mask=(rows[:, None] < H) & (cols[None, :] < I))


def grad_down(dy, a):
    T, H = dy.shape
    I = a.shape[1]
    out = torch.empty((H, I), dtype=torch.float32, device=dy.device)
    grid = (triton.cdiv(H, 16), triton.cdiv(I, 16))
    grad_down_kernel[grid](dy.contiguous(), a.contiguous(), out, T, H, I, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    return out


def split_ranges(K, split, block_k):
    per_split = math.ceil(math.ceil(K / split) / block_k) * block_k
    return [(min(s * per_split, K), min((s + 1) * per_split, K)) for s in range(split)]


ring_schedule = kernel_schedule


# ---------------------------------------------------------------- 06


def expert_partition(E, W):
    base, extra = divmod(E, W)
    blocks, start = [], 0
    for rank in range(W):
        count = base + (rank < extra)
        blocks.append(range(start, start + count))
        start += count
    return blocks


def rows_sent(topk_indices, E, W):
    owner = torch.tensor([rank for rank, block in enumerate(expert_partition(E, W)) for _ in block])
    per_rank = topk_indices.reshape(W, -1)
    return [torch.bincount(owner[per_rank[rank]], minlength=W).tolist() for rank in range(W)]


def exchange_bytes(T_r, K, H, W, b, b_w):
    rows = T_r * K * (W - 1) // W  # each way, in each pass
    return 2 * rows * (2 * H * b + b_w)
