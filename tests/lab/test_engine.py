"""moe_lib.lab.engine: notebook 04's grouped-engine section: the schedules as frames and figures, the twins against
float64 on the CPU, the layer's launches recorded and matched with what the page says each computes."""

import matplotlib
import pytest
import torch
from conftest import rel_error

import moe_lib
from moe_lib import problems
from moe_lib.engine import grouped_gemm, grouped_wgrad
from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.lab import engine
from moe_lib.moe_experts import engine_layer

matplotlib.use("Agg")

SMALL = GemmConfig(64, 64, 32, 2, "pingpong", group_m=2)
COOPERATIVE = GemmConfig(128, 64, 32, 2, "cooperative", group_m=3)


def random_counts(generator, experts=None):
    experts = experts or int(torch.randint(1, 9, (1,), generator=generator))
    counts = torch.randint(0, 200, (experts,), generator=generator)
    counts[torch.rand(experts, generator=generator) < 0.3] = 0  # some experts without rows
    return counts.tolist()


@pytest.mark.parametrize("config", [SMALL, COOPERATIVE], ids=["pingpong", "cooperative"])
def test_schedule_frame_is_the_kernels_schedule_tile_by_tile(config, seed):
    generator = torch.Generator().manual_seed(seed)
    counts = random_counts(generator)
    offsets = engine.offsets_of(counts)
    n = 1 + int(torch.randint(0, 300, (1,), generator=generator))
    programs = 1 + int(torch.randint(0, 9, (1,), generator=generator))
    frame = engine.schedule_frame(offsets, n, config, programs)
    listed = grouped_gemm.schedule(offsets, n, config, programs)
    assert len(frame) == sum(len(tiles) for tiles in listed) == sum(grouped_gemm.expert_tiles(offsets, n, config))
    for row in frame.itertuples():
        assert listed[row.program][row.turn] == (row.expert, row.row0, row.col0)
        assert offsets[row.expert] <= row.row0 < offsets[row.expert + 1]  # a tile starts inside its expert
        assert 0 < row.rows <= config.block_m and row.row0 + row.rows <= offsets[row.expert + 1]
        assert 0 < row.cols <= config.block_n and row.col0 + row.cols <= n
        assert row.consumer == (row.turn % 2 if config.pingpong else 0)
    covered = torch.zeros(offsets[-1], n, dtype=torch.int32)  # every output element in exactly one tile
    for row in frame.itertuples():
        covered[row.row0 : row.row0 + row.rows, row.col0 : row.col0 + row.cols] += 1
    assert (covered == 1).all()


def test_wgrad_schedule_frame_counts_each_experts_k_steps(seed):
    generator = torch.Generator().manual_seed(seed)
    counts = random_counts(generator, experts=5)
    offsets = engine.offsets_of(counts)
    shapes = [(64, 128), (128, 64), (100, 30)]
    frame = engine.wgrad_schedule_frame(offsets, shapes, SMALL, 4)
    assert len(frame) == grouped_wgrad.total_tiles(5, shapes, SMALL)
    listed = grouped_wgrad.schedule(5, shapes, SMALL, 4)
    for row in frame.itertuples():
        assert listed[row.program][row.turn] == (row.expert, row.problem, row.row0, row.col0)
        assert row.k_steps == -(-counts[row.expert] // SMALL.block_k)
    assert set(frame[frame.k_steps == 0].expert) == {e for e, c in enumerate(counts) if c == 0}


def test_figures_draw_every_tile():
    offsets = engine.offsets_of([40, 0, 150, 9])
    frame = engine.schedule_frame(offsets, 100, SMALL, 3)
    fig = engine.schedule_figure(frame, offsets, 100, SMALL, 3)
    labels = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("p")]
    assert sorted(labels) == sorted(f"p{r.program}.{r.turn}" for r in frame.itertuples())
    shapes = [(64, 64), (64, 128)]
    wframe = engine.wgrad_schedule_frame(offsets, shapes, SMALL, 3)
    fig = engine.wgrad_schedule_figure(wframe, offsets, shapes, SMALL, 3, ["dWg", "dWd"])
    assert len(fig.axes) == 2 * 4
    assert len(engine.pipeline_figure(3).axes) == 2
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("through_ring", [True, False])
def test_ring_steps_frame_numbers_each_tiles_k_steps_then_its_saved_chunks(through_ring, seed, monkeypatch):
    """dswiglu's ring step by step: a tile's ⌈K / BLOCK_K⌉ K steps, then (through the ring) BLOCK_N / BLOCK_K chunks
    of its saved u and g, the steps counted on from tile to tile over the stages in turn, as the kernel's step0."""
    monkeypatch.setattr(grouped_gemm, "SAVED_THROUGH_RING", through_ring)
    generator = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 700, (1,), generator=generator))
    tiles = int(torch.randint(1, 4, (1,), generator=generator))
    config = grouped_gemm.RING_DSWIGLU_CONFIG
    frame = engine.ring_steps_frame(k, config, tiles)
    k_steps, chunks = -(-k // config.block_k), (config.block_n // config.block_k if through_ring else 0)
    assert list(frame.step) == list(range(tiles * (k_steps + chunks)))
    assert (frame.stage == frame.step % config.stages).all()
    assert (frame.parity == (frame.step // config.stages) % 2).all()
    for _, steps in frame.groupby("tile"):
        assert list(steps.kind) == ["K step"] * k_steps + ["saved chunk"] * chunks
        assert list(steps["index"]) == [*range(k_steps), *range(chunks)]
    chunk_rows = frame[frame.kind == "saved chunk"]
    assert all(row.a_buffer.startswith("u[") and row.b_buffer.startswith("g[") for row in chunk_rows.itertuples())
    assert engine.ring_steps_frame(k, config, tiles, epilogue="swiglu").kind.eq("K step").all()  # no saved tiles
    fig = engine.ring_steps_figure(frame, config)
    assert len(fig.axes[0].patches) == len(frame)
    matplotlib.pyplot.close("all")


def test_twins_against_float64(seed):
    generator = torch.Generator().manual_seed(seed)
    counts = random_counts(generator, experts=4)
    counts[int(torch.randint(0, 4, (1,), generator=generator))] += 70  # at least one expert spans two row tiles
    table = engine.twin_errors(counts, 64, 96, seed=seed)
    assert (table["NaN left"] == 0).all()
    assert (table["relative error"] < 1e-2).all(), table  # bf16 outputs of the varlen-M kernel
    assert (table.xs("grouped_weight_grad_tl")["relative error"] < 1e-5).all()  # fp32 outputs: rounding only


def test_the_layers_launches_are_those_listed_and_its_gradients_those_of_float64(seed, nan_workspaces):
    inputs = problems.make_inputs(
        "moe_experts_backward",
        20,
        seed=seed,
        routing="skewed",
        hidden_size=64,
        intermediate_size=64,
        num_experts=5,
        top_k=2,
    )
    for name in ("grad_output", "hidden_states", "gate_weights", "up_weights", "down_weights"):
        inputs[name] = inputs[name].to(torch.bfloat16)
    args = [
        inputs[name]
        for name in ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")
    ]
    gemm = engine_layer._Launches.gemm
    with engine.recorded_launches() as forward:
        engine_layer.forward(*args)
    with engine.recorded_launches() as backward:
        grads = engine_layer.backward(inputs["grad_output"], *args)
    assert engine_layer._Launches.gemm is gemm  # the recorder put the layer back
    assert len(engine.launch_table(forward, "forward")) == 2
    table = engine.launch_table(backward, "backward")
    assert list(table["epilogue"]) == ["swiglu", "dswiglu", "none", "–", "–"]
    # x's and dy's rows read through the routing by the loads; by the recomputed swiglu's too where x is the gate and
    # up gradients' A (no x_s written), else from x_s
    x_gathered = engine_layer.x_as_a_in_weight_grads(64, engine_layer._Launches(40, 5).weight_grad_column_tile())
    assert [r["operands"].startswith("A gathered") for r in forward] == [True, False]
    assert [r["operands"].startswith("A gathered") for r in backward[:3]] == [x_gathered, True, False]
    wanted = moe_lib.moe_experts_backward(
        *(t.double() if t.is_floating_point() else t for t in inputs.values()), impl="reference"
    )
    for got, want in zip(grads, wanted, strict=True):
        assert rel_error(got, want) < 2e-2
    with pytest.raises(ValueError, match="record"):
        engine.launch_table(backward[1:], "backward")


def test_backward_memory_frame_counts_each_launch_and_slices_only_where_x_s_is_the_peak():
    T, K, H, I, E = 32768, 6, 2048, 1408, 64  # DeepSeek-V2-Lite at 32768 tokens: T·K > E·I
    frame = engine.backward_memory_frame({"big": (T, K, H, I, E), "p2": (8192, 8, 4096, 2048, 256)})
    whole, sliced, gathered = frame[frame["case"] == "big"].itertuples(index=False)  # 256 divides 2I: x as A
    always = 2 * (T * K * 2 * I + T * K * I + T * H)
    assert whole[2] == pytest.approx((always + 2 * T * K * H) / 1e9)  # dX: dX_s
    assert whole[3] == pytest.approx((always + 4 * E * I * H + 2 * T * K * H) / 1e9)  # dWg, dWu and x_s whole
    assert whole[4] == pytest.approx((always + 6 * E * I * H) / 1e9)  # dWd: the three weight gradients
    assert whole.peak == "dWg, dWu" and sliced.x_s == "3 slices" and sliced.peak == "dWd"
    assert sliced[3] == pytest.approx((always + 4 * E * I * H + 2 * T * K * 768) / 1e9)  # its widest slice
    assert gathered.x_s == "gathered" and gathered[3] == pytest.approx((always + 4 * E * I * H) / 1e9)  # no x_s
    p2 = frame[frame["case"] == "p2"]
    assert list(p2["x_s"]) == ["whole", "gathered"]  # T·K ≤ E·I: no slices; 256 divides I: x gathered as A
    assert p2.iloc[1, 3] == pytest.approx(p2.iloc[0, 3] - 2 * 8192 * 8 * 4096 / 1e9)  # no x_s beside dWg, dWu
    matplotlib.pyplot.close(engine.backward_memory_figure(frame))


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="offsets"):
        engine.schedule_frame([0, 10, 5], 64, SMALL, 2)
    with pytest.raises(ValueError, match="offsets"):
        engine.wgrad_schedule_frame([3, 10], [(64, 64)], SMALL, 2)
    with pytest.raises(ValueError, match="programs"):
        engine.schedule_frame([0, 10], 64, SMALL, 0)
    with pytest.raises(ValueError, match="n"):
        engine.schedule_frame([0, 10], 0, SMALL, 1)
    with pytest.raises(ValueError, match="counts"):
        engine.offsets_of([4, -1])
    with pytest.raises(ValueError, match="stages"):
        engine.pipeline_figure(1)
    with pytest.raises(ValueError, match="k: expected"):
        engine.ring_steps_frame(0, SMALL)
    with pytest.raises(ValueError, match="tiles: expected"):
        engine.ring_steps_frame(64, SMALL, tiles=0)
    with pytest.raises(ValueError, match="epilogue: expected"):
        engine.ring_steps_frame(64, SMALL, epilogue="gelu")
