"""moe_lib.lab.ladder and moe_lib.lab.ring: notebook 04's costs by hand, its measured tables from the committed files,
and the ring's model of mbarrier phases."""

import json
import math
import statistics

import matplotlib
import pytest

from moe_lib import roofline
from moe_lib.lab import ladder, ring, tuning_index

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SPEC = roofline.GPUSpec.from_measured(copy_bandwidth=4.2e12, bf16_rate=790e12)
CUDA_CORES = 67e12


def test_p1_rung_costs_by_hand():
    T, H, I = 4093, 2048, 768
    table = ladder.p1_rung_costs(T, SPEC, CUDA_CORES)
    naive, tiled, fused = table.index
    floor = (T * H + H * I + 4 * T * I + 2 * T * I) * 2  # dy, W_d, four saved in; dG, dU out; bf16
    assert table.loc[fused, "bytes from DRAM (MB)"] * 1e6 == pytest.approx(floor)
    assert table.loc[tiled, "dA round trip (MB)"] * 1e6 == pytest.approx(2 * T * I * 4)
    flops = 2 * T * H * I
    assert table.loc[fused, "predicted (µs)"] == pytest.approx(1e6 * max(floor / 4.2e12, flops / 790e12))
    first = 1e6 * max((T * H + H * I + T * I * 2) * 2 / 4.2e12, flops / CUDA_CORES)  # dy, W_d in; dA (fp32) out
    second = 1e6 * (T * I * 4 + 6 * T * I * 2) / 4.2e12  # dA and the saved tensors in, dG and dU out
    assert table.loc[naive, "predicted (µs)"] == pytest.approx(first + second)
    assert table.loc[naive, "bytes asked (MB)"] > 50 * table.loc[fused, "bytes asked (MB)"]  # W_d read T times
    assert list(table["predicted (µs)"]) == sorted(table["predicted (µs)"], reverse=True)


def test_p1_launch2_ladder_reads_the_probe_and_predicts_by_hand():
    table = ladder.p1_launch2_ladder(SPEC)
    assert list(table.index) == [2447, 4093, 8192]
    runs = json.loads(tuning_index.run("gluon_launch2_probe").path.read_text())["runs"]
    triton = [
        row["us"]
        for run in runs
        for row in run["rows"]
        if row.get("product") == "launch 2" and row["impl"] == "triton launch 2 (default)" and row["T"] == 8192
    ]
    assert table.loc[8192, "Triton"] == pytest.approx(statistics.median(triton))
    T, H, I = 8192, 2048, 768
    traffic = (4 * T * I + 2 * T * H + 4 * I * H) * 2
    assert table.loc[8192, "predicted (µs)"] == pytest.approx(1e6 * max(traffic / 4.2e12, 16 * T * H * I / 790e12))
    assert (table["Gluon (the library's)"] < table["Triton"]).all()


def test_p2_tma_ladder_holds_the_committed_runs():
    table = ladder.p2_tma_ladder(SPEC)
    assert list(table.index) == ["bf16:2048", "bf16:8192", "bf16:32768", "fp32:2048"]
    rows = json.loads(tuning_index.run("p2_tma_weight_grad").path.read_text())
    pointer = next(r["ms"] for r in rows if r["case"] == "bf16:32768" and r["config"] == "(a) launch_weight_grads")
    assert table.loc["bf16:32768", "W pointer-based (ms)"] == pytest.approx(pointer)
    assert (table["W TMA, fastest (ms)"] <= table["W TMA, default (ms)"]).all()
    assert (table["W floor (ms)"] < table["W TMA, fastest (ms)"]).all()  # a floor is below what ran
    assert math.isnan(table.loc["bf16:8192", "D pointer-based (ms)"])  # kernel D was not timed at 8192


def test_p2_rung_costs_count_a_launch_per_busy_expert():
    table = ladder.p2_rung_costs(2048, SPEC)
    per_expert, grouped = table.index
    assert table.loc[per_expert, "launches"] == round(256 * (1 - (1 - 8 / 256) ** 2048))
    assert table.loc[grouped, "launches"] == 1
    gap = table.loc[per_expert, "predicted (µs)"] - table.loc[grouped, "predicted (µs)"]
    assert gap > (table.loc[per_expert, "launches"] - 1) * ladder.LAUNCH_FLOOR_US


def test_figures_render():
    for fig in (
        ladder.p1_rungs_figure(),
        ring.ring_diagram(6),
        ladder.ladder_figure(
            ladder.p1_launch2_ladder(SPEC), list(ladder.LAUNCH2_LABELS.values()), "t", predicted="predicted (µs)"
        ),
    ):
        assert fig.axes
        plt.close(fig)


def test_an_mbarrier_lets_a_wait_pass_once_the_phase_of_its_parity_is_done():
    bar = ring.MBarrier()
    assert bar.can_pass(1) and not bar.can_pass(0)  # a fresh barrier: phase 0 under way, parity 1 "done"
    bar.arrive()
    assert bar.can_pass(0) and not bar.can_pass(1)


@pytest.mark.parametrize("buffers", [1, 2, 4, 6])
def test_the_kernels_schedule_delivers_every_step_in_any_order(buffers, seed):
    for offset in range(20):
        run = ring.simulate(ring.kernel_schedule, buffers, 17, seed=seed + offset)
        assert run.error is None, run.error
        assert [step for _, role, step, _, _ in run.events if role == "consumer"] == list(range(17))


def test_wrong_schedules_are_caught():
    same_parity = lambda i, b: (i % b, (i // b) & 1, (i // b) & 1)  # noqa: E731
    assert "deadlock" in ring.simulate(same_parity, 4, 10).error
    never_flips = lambda i, b: (i % b, 0, 1)  # noqa: E731
    errors = {ring.simulate(never_flips, 2, 9, seed=s).error for s in range(10)}
    assert any("read buffer" in e or "overwrote" in e for e in errors if e)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ring.simulate(ring.kernel_schedule, 0, 4), "buffers"),
        (lambda: ring.simulate(ring.kernel_schedule, 2, -1), "steps"),
        (lambda: ladder.p1_rung_costs(0, SPEC, CUDA_CORES), "num_tokens"),
        (lambda: ladder.p2_rung_costs(-3, SPEC), "num_tokens"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
