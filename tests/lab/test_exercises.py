"""moe_lib.lab.exercises: each checker passes the solution (tests/lab/solutions.py), fails a wrong answer and says so,
and reports a stub as not attempted, without raising (the notebooks run their unsolved exercises)."""

import math

import pytest
import torch

from moe_lib.lab import exercises

from . import solutions


def _wrong_ring(step, buffers):
    slot, ready, _ = solutions.ring_schedule(step, buffers)
    return slot, ready, ready  # the producer waits on the same parity as the consumer: both wait forever


CASES = {  # checker -> (the solution, a wrong answer)
    "check_d_gate_recomputed": (solutions.d_gate_recomputed, lambda d_a, g, u: d_a * u * torch.sigmoid(g)),
    "check_geglu_backward": (
        solutions.geglu_backward,
        lambda d_a, g, u: (d_a * u * 0.5 * (1 + torch.erf(g / math.sqrt(2))), d_a * torch.nn.functional.gelu(g)),
    ),
    "check_hi_lo_split": (
        solutions.hi_lo_split,
        lambda v: (v.to(torch.bfloat16), torch.zeros_like(v, dtype=torch.bfloat16)),
    ),
    "check_grad_topk_weights": (solutions.grad_topk_weights, lambda dy, x, idx, wg, wu, wd: torch.zeros(idx.shape)),
    "check_router_backward": (solutions.router_backward, lambda logits, d_w: d_w * torch.softmax(logits, dim=-1)),
    "check_expected_empty_experts": (solutions.expected_empty_experts, lambda T, E, K: E * math.exp(-T * K / E)),
    "check_p1_cost": (solutions.p1_cost, lambda T, H, I: (12 * T * H * I, 2 * (3 * T * H + 5 * T * I + 3 * I * H))),
    "check_ridge_crossing": (solutions.ridge_crossing, lambda H, I, p, b: p / b),
    "check_expert_intensity": (solutions.expert_intensity, lambda T, H, I, E, K: T * K / E),
    "check_grad_down_kernel": (solutions.grad_down, lambda dy, a: (dy[:16].T @ a[:16]).float()),
    "check_split_ranges": (solutions.split_ranges, lambda K, s, b: [(i * K // s, (i + 1) * K // s) for i in range(s)]),
    "check_ring_schedule": (solutions.ring_schedule, _wrong_ring),
    "check_expert_partition": (
        solutions.expert_partition,
        lambda E, W: [range(r * (E // W), (r + 1) * (E // W)) for r in range(W)],
    ),
    "check_rows_sent": (solutions.rows_sent, lambda idx, E, W: [[idx.shape[0] * idx.shape[1] // W // W] * W] * W),
    "check_exchange_bytes": (solutions.exchange_bytes, lambda T_r, K, H, W, b, b_w: 4 * T_r * K * H * b),
}


def test_every_checker_has_a_case():
    assert set(CASES) == {name for name in dir(exercises) if name.startswith("check_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_solution_passes(name, seed, capsys):
    checker = getattr(exercises, name)
    kwargs = {"seed": seed} if "seed" in checker.__code__.co_varnames else {}
    assert checker(CASES[name][0], **kwargs) is True, capsys.readouterr().out
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_answer_fails_and_says_why(name, capsys):
    assert getattr(exercises, name)(CASES[name][1]) is False
    out = capsys.readouterr().out
    assert out.startswith("✗") and len(out.strip()) > 20, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stub_is_not_attempted(name, capsys):
    def stub(*args):
        raise NotImplementedError

    assert getattr(exercises, name)(lambda *args: None) is False
    assert capsys.readouterr().out.startswith("○")
    assert getattr(exercises, name)(stub) is False
    assert "not attempted" in capsys.readouterr().out


LESSONS = ("01", "02", "03", "04", "06")


@pytest.mark.parametrize("number", LESSONS)
def test_each_lesson_ends_with_two_or_three_exercises_and_their_checkers(number):
    import json
    import re
    from pathlib import Path

    path = next((Path(__file__).resolve().parents[2] / "notebooks").glob(f"{number}_*.ipynb"))
    cells = json.loads(path.read_text())["cells"]
    visible = [cell for cell in cells if "remove-cell" not in cell["metadata"].get("tags", [])]
    heading = next(i for i, cell in enumerate(visible) if "".join(cell["source"]).startswith("## Exercises"))
    calls = [re.findall(r"exercises\.(check_\w+)\(my_\w+\)", "".join(cell["source"])) for cell in visible[heading:]]
    checkers = [name for found in calls for name in found]
    assert 2 <= len(checkers) <= 3 and all(hasattr(exercises, name) for name in checkers), checkers
    assert all(found for found in calls[1:]), "every cell after the heading is an exercise"
