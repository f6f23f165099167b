"""moe_lib.bench.rank_work on CPU at tiny shapes, and what moe_lib.lab.parallel makes of its files."""

import json

import pandas as pd
import pytest
import torch

from moe_lib.bench import parallel as bench_parallel
from moe_lib.bench import rank_work
from moe_lib.distributed import expert_partition
from moe_lib.lab import parallel


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_work")
    written = rank_work.main(["--small", "--device", "cpu", "--dtypes", "float32", "--seed", "3", "--out", str(out)])
    return pd.read_csv(written[0]), json.loads(written[1].read_text())


def test_rank_work_receives_the_rows_rank_0_of_the_group_receives(small_run):
    frame, document = small_run
    assert list(frame.columns) == rank_work.CSV_COLUMNS
    assert (frame.status == "ok").all() and frame.correct.all() and (frame.same_work_ms > 0).all()
    assert document["provenance"]["git_commit"] and document["world_sizes"] == rank_work.SMALL_WORLD_SIZES
    axes = bench_parallel.SMALL_AXES
    args = rank_work.parse_args(["--small", "--device", "cpu", "--seed", "3"])
    for row in frame.itertuples():
        inputs = bench_parallel.global_inputs("float32", row.tokens_per_rank, row.world_size, args, torch.device("cpu"))
        block = expert_partition(axes["num_experts"], row.world_size)[0]
        ids = inputs["topk_indices"]
        assert row.rows_received == int(((ids >= block.start) & (ids < block.stop)).sum())  # every rank's tokens
        assert row.local_experts == len(block) and row.rows_per_expert == row.rows_received / len(block)


def test_rank_work_checks_the_smallest_token_count_in_float64(small_run):
    frame, _ = small_run
    smallest = frame.tokens_per_rank == frame.tokens_per_rank.min()
    assert (frame.check[smallest] == "float64").all() and (frame.check[~smallest] == "finite").all()
    assert (frame.max_rel_error[smallest] < 1e-5).all() and (frame.max_rel_error[smallest] > 0).all()


def test_rank_work_stops_on_non_finite_outputs_without_timing(tmp_path, monkeypatch):
    real_step = rank_work.same_work_step

    def poisoned(rows, shard, impl):
        output, *grads = real_step(rows, shard, impl)
        return (torch.full_like(output, float("nan")), *grads)

    monkeypatch.setattr(rank_work, "same_work_step", poisoned)
    with pytest.raises(SystemExit, match="float32: wrong results, not timed .*non-finite outputs"):
        rank_work.main(
            [
                "--small",
                "--device",
                "cpu",
                "--dtypes",
                "float32",
                "--world-sizes",
                "2",
                "--tokens",
                "16",
                "--out",
                str(tmp_path),
            ]
        )
    frame = pd.read_csv(next(tmp_path.glob("*/*.csv")))
    assert frame.status.str.startswith("wrong").all() and frame.same_work_ms.isna().all()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-sizes", "0"], "--world-sizes: expected 1 to 8"),
        (["--world-sizes", "2,9"], "got 9"),
        (["--tokens", "0"], "--tokens: expected positive"),
        (["--dtypes", "float16"], "--dtypes: expected"),
        (["--dtypes", ","], "--dtypes: expected at least one"),
    ],
)
def test_rank_work_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        rank_work.parse_args(["--small", "--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def _stand_in_run(folder, rates_tflops: dict[int, float]):
    """A full-size rank-work file whose expert work runs at ``rates_tflops[W]`` (written here, not measured)."""
    axes = bench_parallel.FULL_AXES
    rows = []
    for world_size, rate in rates_tflops.items():
        for tokens in (2048, 8192):
            received = tokens * axes["top_k"]
            flops = parallel.STEP_FLOPS_PER_ROW_HI * received * axes["hidden_size"] * axes["intermediate_size"]
            local = axes["num_experts"] // world_size
            rows.append(
                dict(
                    problem=rank_work.PROBLEM,
                    dtype="bfloat16",
                    world_size=world_size,
                    local_experts=local,
                    tokens_per_rank=tokens,
                    rows_received=received,
                    rows_per_expert=received / local,
                    same_work_ms=flops / (rate * 1e12) * 1e3,
                    status="ok",
                )
            )
    (folder / "H200").mkdir(parents=True)
    stem = folder / "H200" / f"2026-12-04-{rank_work.PROBLEM}-bfloat16"
    pd.DataFrame(rows).reindex(columns=rank_work.CSV_COLUMNS).to_csv(f"{stem}.csv", index=False)
    (folder / "H200" / f"{stem.name}.json").write_text(
        json.dumps(dict(problem=rank_work.PROBLEM, dtype="bfloat16", axes=axes, provenance={}))
    )


def test_lab_reads_rank_work_and_models_each_world_size_at_its_own_rate(tmp_path):
    _stand_in_run(tmp_path, {2: 300.0, 8: 600.0})
    runs = parallel.load_rank_work(tmp_path, "H200")
    assert list(runs) == ["bfloat16"]
    table = parallel.rank_work_table(runs)
    assert table.loc[("bfloat16", 8), ("TFLOP/s", 8192)] == pytest.approx(600.0)
    assert table.loc[("bfloat16", 8), ("local experts", "")] == 32
    assert parallel.rank_work_rate(runs["bfloat16"], 8, 2048) == pytest.approx(600e12)
    assert parallel.rank_work_rate(runs["bfloat16"], 16, 2048) is None  # not measured
    parallel.rank_work_figure(runs)
    with pytest.raises(FileNotFoundError, match="no moe_experts_rank_work results"):
        parallel.load_rank_work(tmp_path, "B200")

    measured = parallel.load_parallel_results()
    shares = parallel.node_scaling_table(
        measured, gpu_key="H200", tokens_per_rank=8192, gpus_per_node=8, network_bandwidth=50e9, rank_work=runs
    )
    at_w = shares[(shares.experts == "measured at W") & (shares.chunks == 1)].set_index("setting")
    assert at_w.dtype.eq("bfloat16").all()  # no float32 file: no such rows for it
    assert [setting.split(",")[0] for setting in at_w.index] == ["W = 2", "W = 8"]  # W = 16 was not measured
    # the same exchange over faster experts: a larger exposed share, and W = 8's at the rate given for it
    w8 = parallel.model_step(
        [8192], world_size=8, flops_rate=600e12, chunks=1, **parallel.measured_model_inputs(measured["bfloat16"])[3]
    )
    assert at_w.share.iloc[1] == pytest.approx(float(w8["share"][0]))
    assert at_w.share.iloc[1] > at_w.share.iloc[0]


def test_rank_work_profile_lists_the_step_s_work(tmp_path, capsys):
    written = rank_work.main(
        [
            "--small",
            "--device",
            "cpu",
            "--dtypes",
            "float32",
            "--world-sizes",
            "2",
            "--tokens",
            "16",
            "--profile",
            "--out",
            str(tmp_path),
        ]
    )
    kernels = json.loads(written[1].read_text())["kernels"]
    assert [(case["world_size"], case["tokens_per_rank"]) for case in kernels] == [(2, 16)]
    assert kernels[0]["kernels"] and all(k["ms"] > 0 and k["calls"] >= 1 for k in kernels[0]["kernels"])
    assert "W=2 T_r=16: " in capsys.readouterr().out
