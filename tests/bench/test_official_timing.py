"""The official timing method's pieces that run without a GPU: fresh input addresses and call spans."""

import pytest
import torch

from moe_lib.bench import cli
from moe_lib.bench.official_timing import POOL_SHIFT_BYTES, FreshInputs, GpuActivity, call_spans, unavailable


def test_fresh_inputs_move_every_call_and_keep_the_data(seed):
    torch.manual_seed(seed)
    inputs = dict(x=torch.randn(5, 7), w=torch.randn(3, 2).to(torch.bfloat16), k=4)
    fresh = FreshInputs(inputs, calls=3)
    seen = []
    for _ in range(4):
        copy = fresh.next()
        assert copy["k"] == 4
        for name in ("x", "w"):
            assert copy[name].dtype == inputs[name].dtype and copy[name].shape == inputs[name].shape
            assert torch.equal(copy[name], inputs[name])
            assert copy[name].data_ptr() % POOL_SHIFT_BYTES == fresh.pools[name].data_ptr() % POOL_SHIFT_BYTES
        seen.append(copy["x"].data_ptr())
    assert len(set(seen[:3])) == 3, "each of the first three calls gets its own address"
    assert seen[3] == seen[0], "after `calls` calls the offsets start again"


def test_fresh_inputs_refuse_bad_arguments():
    with pytest.raises(ValueError, match="calls"):
        FreshInputs(dict(x=torch.ones(2)), calls=0)
    with pytest.raises(ValueError, match=r"inputs\['x'\]"):
        FreshInputs(dict(x=torch.ones(4, 4).T), calls=2)


def test_call_spans_run_from_first_start_to_last_end_of_each_calls_own_launches():
    calls = [(100, 200), (1000, 1100)]
    launches = [(110, 1), (150, 2), (1010, 3), (5000, 4)]  # 4 launched outside any call
    activities = [
        GpuActivity(300, 340, 1, "k1"),
        GpuActivity(400, 460, 2, "k2"),  # a gap of 60 ns between them counts
        GpuActivity(1200, 1250, 3, "k1"),
        GpuActivity(1260, 9999, 4, "stray"),
    ]
    spans = call_spans(calls, launches, activities)
    assert [s["span_ms"] for s in spans] == [160 / 1e6, 50 / 1e6]
    assert spans[0]["names"] == ["k1", "k2"] and spans[1]["activities"] == 1


def test_call_spans_refuse_a_call_without_gpu_work():
    with pytest.raises(ValueError, match="call 1"):
        call_spans([(0, 10), (20, 30)], [(5, 1)], [GpuActivity(40, 50, 1)])


def test_official_timing_is_off_without_cuda_and_on_is_refused():
    assert unavailable(torch.device("cpu")) is not None
    args = cli.parse_args(["--problem", "swiglu_down_backward", "--impl", "reference", "--device", "cpu"])
    assert args.official is False
    with pytest.raises(SystemExit):
        cli.parse_args(["--impl", "reference", "--device", "cpu", "--official-timing", "on"])
