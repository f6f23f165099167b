"""moe_lib.lab.parallel and .parallel_live: the committed multi-GPU runs, the exchanges and the cost model by hand."""

import json
import shutil
import statistics

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

from moe_lib.lab import parallel, parallel_live

FIRST_RUN_DATE = "2026-11-29"  # the first run on GPUs, whose forward looped over the experts in PyTorch


@pytest.fixture(scope="module")
def runs():
    return parallel.load_parallel_results()


def test_committed_runs_load_narrowest_dtype_first(runs):
    assert list(runs) == ["bfloat16", "float32"]
    bf16 = runs["bfloat16"]
    assert bf16.world_size == 2 and bf16.element_bytes == 2 and bf16.weight_bytes == 4  # fp32 routing weights
    assert list(bf16.cases) == sorted(bf16.cases) and set(bf16.ok.index) <= set(bf16.cases)
    with pytest.raises(FileNotFoundError, match="no moe_experts_parallel results"):
        parallel.load_parallel_results("data/results", "B200")
    with pytest.raises(FileNotFoundError, match="dated 1999-01-01"):
        parallel.load_parallel_results(date="1999-01-01")


def test_exchange_bytes_count_only_the_other_ranks():
    # rank 0 sends 3 + 1 rows to the other ranks and receives 4 + 2 from them (5 stay local)
    table = parallel.exchange_bytes(
        [5, 3, 1], [5, 4, 2], 0, hidden_size=8, element_bytes=2, weight_bytes=4, max_local_experts=2
    )
    row, row_and_weight = 8 * 2, 8 * 2 + 4
    assert table.loc["dispatch", ["rows out", "bytes out", "rows in"]].tolist() == [4, 4 * row_and_weight, 6]
    assert table.loc["combine", ["bytes out", "bytes in"]].tolist() == [6 * row, 4 * row]
    assert table.loc["backward_dispatch", ["bytes out", "bytes in"]].tolist() == [4 * row, 6 * row]
    assert table.loc["backward_combine", ["bytes out", "bytes in"]].tolist() == [6 * row_and_weight, 4 * row_and_weight]
    assert table.loc["counts_exchange", "bytes out"] == 2 * (3 + 2) * 8  # two other ranks, int64 [3 + L_max]


def test_model_tends_to_its_asymptotic_share():
    shapes = dict(
        world_size=4,
        hidden_size=4096,
        intermediate_size=2048,
        num_experts=256,
        top_k=8,
        element_bytes=2,
        weight_bytes=0,
        link_bandwidth=100e9,
        flops_rate=500e12,
    )
    model = parallel.model_step([2**30], **shapes)
    assert model["expert_flops"][0] == 22 * 2**30 * 8 * 4096 * 2048
    share = parallel.asymptotic_share(
        world_size=4, intermediate_size=2048, element_bytes=2, link_bandwidth=100e9, flops_rate=500e12
    )
    assert model["share"][0] == pytest.approx(share, rel=1e-12)


def test_model_of_overlapped_chunks():
    shapes = dict(
        world_size=4,
        hidden_size=4096,
        intermediate_size=2048,
        num_experts=256,
        top_k=8,
        element_bytes=2,
        weight_bytes=4,
        link_bandwidth=50e9,
        flops_rate=500e12,
        memory_bandwidth=4e12,
    )
    one, four = parallel.model_step([512, 32768], **shapes), parallel.model_step([512, 32768], **shapes, chunks=4)
    a, x = one["all_to_all_s"], one["expert_s"]
    assert one["step_s"] == pytest.approx(a + x) and one["share"] == pytest.approx(a / (a + x))
    # chunks by expert group read each weight once: the same bytes and FLOPs, only the exchange overlaps
    assert (four["all_to_all_s"] == a).all() and (four["expert_bytes"] == one["expert_bytes"]).all()
    a4, x4 = four["all_to_all_s"], four["expert_s"]
    assert four["step_s"] == pytest.approx([max(p, q) + min(p, q) / 4 for p, q in zip(a4, x4, strict=True)])
    assert (four["share"] < one["share"]).all()  # at these sizes the exchange hides behind the experts
    costly = parallel.model_step([512, 32768], **shapes, chunks=4, chunk_overhead_s=1e-3)
    assert costly["step_s"] == pytest.approx(four["step_s"] + 3e-3)
    with pytest.raises(ValueError, match="chunks: expected a positive integer"):
        parallel.model_step([512], **shapes, chunks=0)


def test_model_of_two_levels_of_links():
    """Ranks in nodes: the rows to the same node cross the link, the rest the network, both at once."""
    shapes = dict(
        hidden_size=4096,
        intermediate_size=2048,
        num_experts=256,
        top_k=8,
        element_bytes=2,
        weight_bytes=4,
        link_bandwidth=300e9,
        flops_rate=500e12,
    )
    row_bytes = 4 * 4096 * 2 + 2 * 4
    rows = 8192 * 8
    one_node = parallel.model_step([8192], world_size=8, **shapes)
    assert one_node["all_to_all_s"][0] == pytest.approx(rows * 7 / 8 * row_bytes / 300e9)
    assert one_node["network_s"][0] == 0
    two = parallel.model_step([8192], world_size=16, gpus_per_node=8, network_bandwidth=50e9, **shapes)
    assert two["network_s"][0] == pytest.approx(rows * 8 / 16 * row_bytes / 50e9)
    assert two["all_to_all_s"][0] == two["network_s"][0] > rows * 7 / 16 * row_bytes / 300e9
    assert two["all_to_all_bytes"][0] == pytest.approx(rows * 15 / 16 * row_bytes)
    assert two["share"][0] > one_node["share"][0]
    # a fast enough network leaves the link the longer leg
    fast = parallel.model_step([8192], world_size=16, gpus_per_node=8, network_bandwidth=1e15, **shapes)
    assert fast["all_to_all_s"][0] == pytest.approx(rows * 7 / 16 * row_bytes / 300e9)
    with pytest.raises(ValueError, match="^network_bandwidth: expected a positive bandwidth"):
        parallel.model_step([8192], world_size=16, gpus_per_node=8, **shapes)
    with pytest.raises(ValueError, match="^gpus_per_node: expected an integer from 1 to world_size"):
        parallel.model_step([8192], world_size=4, gpus_per_node=8, network_bandwidth=50e9, **shapes)


def test_node_scaling_table_from_the_committed_runs(runs):
    table = parallel.node_scaling_table(
        runs, gpu_key="H200", tokens_per_rank=8192, gpus_per_node=8, network_bandwidth=50e9
    )
    assert set(table.dtype) == set(runs) and set(table.chunks) == {1, 4}
    settings = list(dict.fromkeys(table.setting))
    assert [setting.split(",")[0] for setting in settings] == ["W = 2", "W = 8", "W = 16"]
    share = table.pivot_table(index="setting", columns=["dtype", "experts", "chunks"], values="share")
    assert (share.loc[settings[2]] > share.loc[settings[1]]).all()  # two nodes: the network leg
    assert (share.loc[settings[1]] > share.loc[settings[0]]).all()  # more ranks: more rows leave the rank
    assert (
        table[table.setting == settings[2]].network_bound.all()
        and not table.network_bound[table.setting != settings[2]].any()
    )
    for dtype, run in runs.items():  # the measured world size reproduces the run's share within a few points
        measured = run.ok.loc[8192, "all_to_all_ms"] / run.ok.loc[8192, "total_ms"]
        row = table[
            (table.setting == settings[0])
            & (table.dtype == dtype)
            & (table.experts == "as measured")
            & (table.chunks == 1)
        ]
        assert abs(row.share.iloc[0] - measured) < 0.05, dtype


def test_live_case_partitions_experts_and_sends_the_routed_rows():
    case = parallel_live.LiveCase(
        world_size=3, tokens_per_rank=4, hidden_size=8, intermediate_size=4, num_experts=5, top_k=2, routing="skewed"
    )
    assert [(block.start, block.stop) for block in case.partition] == [(0, 2), (2, 4), (4, 5)]
    indices = parallel_live.live_inputs(case)["topk_indices"]
    sent = parallel_live.expected_rows_sent(indices, case.num_experts, case.world_size)
    assert [sum(row) for row in sent] == [4 * 2] * 3
    owner = torch.tensor([0, 0, 1, 1, 2])
    assert sent[1] == torch.bincount(owner[indices[4:8].reshape(-1)], minlength=3).tolist()
    errors = parallel_live.relative_errors(*[dict.fromkeys(parallel_live.OUTPUT_NAMES, torch.ones(2))] * 2)
    assert set(errors.values()) == {0.0}


def test_overlap_curves_from_the_committed_runs(runs):
    grid = [256, 4096, 65536]
    curves = parallel.overlap_curves(runs, gpu_key="H200", world_size=8, chunk_counts=(1, 2, 4), tokens_grid=grid)
    assert list(curves) == list(runs)
    for models in curves.values():
        assert list(models) == [1, 2, 4] and (models[1]["relative_step"] == 1).all()
        # chunking costs at few tokens (each further chunk's launches and calls) and pays at many
        assert models[4]["relative_step"][0] > 1 > models[4]["relative_step"][-1]
    figure = parallel.overlap_figure(curves, "test")
    assert len(figure.axes) == len(runs) and len(figure.axes[0].lines) == 3 + 1
    plt.close(figure)
    # the rows without overlap (chunks 1) are the plain table's rows; the other chunk counts come beside them
    for run in runs.values():
        plain = run.chunked.xs(1, level="chunks")
        assert plain.index.equals(run.ok.index) and (plain["total_ms"] == run.ok["total_ms"]).all()
        assert len(run.chunked) >= len(run.ok)


def test_step_timeline_pairs_each_exchange_with_its_wait():
    timeline = [
        dict(name="dispatch issued", start_ms=0.0, end_ms=0.0),
        dict(name="dispatch issued", start_ms=0.1, end_ms=0.1),
        dict(name="dispatch", start_ms=0.2, end_ms=1.0),
        dict(name="expert_forward", start_ms=1.0, end_ms=3.0),
        dict(name="combine issued", start_ms=3.0, end_ms=3.0),
        dict(name="dispatch", start_ms=3.0, end_ms=3.0),
        dict(name="expert_forward", start_ms=3.0, end_ms=5.0),
        dict(name="combine issued", start_ms=5.0, end_ms=5.0),
        dict(name="combine", start_ms=5.0, end_ms=6.0),
        dict(name="total", start_ms=0.0, end_ms=6.5),
    ]
    spans = parallel.step_timeline(timeline)
    assert spans[spans["lane"] == "experts"][["start_ms", "end_ms"]].values.tolist() == [[1.0, 3.0], [3.0, 5.0]]
    # a wait of zero length (the second dispatch had arrived) is no span; "total" is no phase of the layer
    assert spans[spans["lane"] == "waits"]["name"].tolist() == ["dispatch", "combine"]
    flight = spans[spans["lane"] == "in flight"].set_index(["name", "start_ms"])["end_ms"]
    assert flight[("dispatch", 0.0)] == 1.0 and flight[("dispatch", 0.1)] == 3.0  # each dispatch until its wait
    assert flight[("combine", 3.0)] == 6.0 and flight[("combine", 5.0)] == 6.0  # every combine until the last wait
    figure = parallel.timeline_figure([timeline, timeline], "test")
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()][:3] == [
        "rank 0: experts",
        "rank 0: waits",
        "rank 0: in flight",
    ]
    plt.close(figure)


def test_forward_scaling_shows_the_host_bound_forward_of_the_first_run():
    first = parallel.load_parallel_results(date=FIRST_RUN_DATE)["bfloat16"]  # before the Triton forward
    table = parallel.forward_scaling_table(first)
    case = first.cases[2048]
    assert list(table.loc[2048, "rows received"]) == [sum(r) for r in case["rows_received_by_rank"]]
    assert table.loc[(2048, 0), "expert forward ms"] == case["times_by_rank"][0]["expert_forward_ms"]
    rows_0 = sum(case["rows_received_by_rank"][0])
    assert table.loc[(2048, 0), "forward ms / 1000 rows"] == pytest.approx(
        1e3 * case["times_by_rank"][0]["expert_forward_ms"] / rows_0
    )
    # four times the rows, about the same forward time: the host's loop over the experts, not the GPU's work
    forward = table["expert forward ms"]
    assert forward.loc[(8192, 0)] == pytest.approx(forward.loc[(2048, 0)], rel=0.05)
    assert table.loc[(8192, 0), "rows received"] > 3.5 * table.loc[(2048, 0), "rows received"]
    # at 2048 tokens rank 0's forward was > 20% slower than rank 1's for a few per cent more rows
    assert forward.loc[(2048, 0)] > 1.2 * forward.loc[(2048, 1)]
    assert table.loc[(2048, 0), "rows received"] < 1.05 * table.loc[(2048, 1), "rows received"]


def test_forward_scales_with_its_rows_in_the_newest_run(runs):
    table = parallel.forward_scaling_table(runs["bfloat16"])
    forward, rows = table["expert forward ms"], table["rows received"]
    for rank in range(runs["bfloat16"].world_size):  # the Triton forward: time follows the rows
        assert forward.loc[(8192, rank)] > 2 * forward.loc[(2048, rank)]
        assert rows.loc[(8192, rank)] > 3.5 * rows.loc[(2048, rank)]
    # and the ranks agree: no rank's forward is 20% slower than another's at 2048 tokens per rank
    assert forward.loc[2048].max() < 1.2 * forward.loc[2048].min()


def test_chunk_overhead_and_overlap_table_from_the_committed_runs(runs):
    for run in runs.values():
        table = parallel.overlap_table(run)
        assert list(table["total ms"].columns) == [1, 2, 4]
        assert (table["vs one chunk"][1] == 1).all()
        plain = run.ok
        assert (table["total ms"][1] == plain["total_ms"]).all()
        # by hand: each chunked case's excess over the ideal pipeline, per further chunk; their median
        samples = []
        for tokens in plain.index:
            a = plain.loc[tokens, "all_to_all_ms"]
            x = plain.loc[tokens, "total_ms"] - a
            samples += [(table["total ms"].loc[tokens, c] - max(a, x) - min(a, x) / c) / (c - 1) / 1e3 for c in (2, 4)]
        assert parallel.chunk_overhead(run) == pytest.approx(statistics.median(samples), rel=1e-12)
        assert 0 < parallel.chunk_overhead(run) < 0.01
    first = parallel.load_parallel_results(date=FIRST_RUN_DATE)["bfloat16"]  # no chunked cases
    assert parallel.chunk_overhead(first) == 0.0


def test_scaling_runs_keep_the_newest_run_of_each_world_size(tmp_path):
    from moe_lib.lab.results import ROOT

    source = ROOT / "data" / "results" / "H200"
    folder = tmp_path / "H200"
    folder.mkdir()
    stem = "2026-12-01-moe_experts_parallel-bfloat16"
    for suffix in (".csv", ".json"):  # the committed 2-GPU run, and the same numbers as if from 4 GPUs a day later
        shutil.copy(source / f"{stem}{suffix}", folder / f"{stem}{suffix}")
    four = "2026-12-02-moe_experts_parallel-bfloat16-4gpus"
    document = json.loads((source / f"{stem}.json").read_text())
    document["provenance"]["world_size"] = 4
    (folder / f"{four}.json").write_text(json.dumps(document))
    frame = pd.read_csv(source / f"{stem}.csv").assign(world_size=4)
    frame.to_csv(folder / f"{four}.csv", index=False)

    one = "2026-12-03-moe_experts_parallel-bfloat16-1gpus"  # newest of all, but on one GPU: no exchange to model
    document["provenance"]["world_size"] = 1
    (folder / f"{one}.json").write_text(json.dumps(document))
    frame.assign(world_size=1).to_csv(folder / f"{one}.csv", index=False)

    series = parallel.load_scaling_runs(tmp_path, "H200")
    assert list(series) == [("bfloat16", 1), ("bfloat16", 2), ("bfloat16", 4)]
    assert parallel.load_parallel_results(tmp_path, "H200", world_size=1)["bfloat16"].csv.name == f"{one}.csv"
    series.pop(("bfloat16", 1))
    assert parallel.load_parallel_results(tmp_path, "H200")["bfloat16"].world_size == 4  # the newest
    assert parallel.load_parallel_results(tmp_path, "H200", world_size=2)["bfloat16"].csv.name == f"{stem}.csv"
    with pytest.raises(FileNotFoundError, match="on 8 GPUs"):
        parallel.load_parallel_results(tmp_path, "H200", world_size=8)
    table = parallel.scaling_table(series)
    assert list(table.index.get_level_values("world size").unique()) == [2, 4]
    assert table.xs(4, level="world size")["step ms"].tolist() == table.xs(2, level="world size")["step ms"].tolist()
