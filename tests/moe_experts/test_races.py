"""P2 has no waits or counters between programs: each of its launches' programs reads only what earlier launches
wrote (kernel A's rows, W's and D's inputs, C's sums over each token's slots in a fixed order), so launch order alone
orders its dataflow. Checked under the interpreter with ``interpreter_races.Recorder`` (see
``tests/swiglu_down/test_races.py`` for P1, whose launches do hand data between programs): no atomic and no wait in
any launch, no address one program stores and another program of the same launch loads or stores, in program order,
reversed and shuffled, and the same bits in every order.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_races import Recorder, in_order, races, reversed_order, shuffled_order

from moe_experts.test_backward_triton import OUTPUT_NAMES, run_triton, small_case_inputs
from moe_lib.dispatch import interpreter_enabled


@pytest.mark.skipif(not interpreter_enabled(), reason="needs the Triton interpreter (no CUDA)")
@pytest.mark.parametrize("case", ["hot-looping", "bf16-int32-bf16-topk"])
def test_no_program_reads_what_another_of_its_launch_writes(case, seed, monkeypatch):
    """A hot expert's rows split over programs (row_split 2), experts no token chose; bf16 with int32 indices."""
    from moe_experts.test_backward_triton import SMALL_CASES

    inputs = small_case_inputs(case, seed)
    results = {}
    for name, order in (("in order", in_order), ("reversed", reversed_order), ("shuffled", shuffled_order(seed))):
        with monkeypatch.context() as patch:
            recorder = Recorder(order=order).install(patch)
            results[name] = run_triton(inputs, SMALL_CASES[case][-1])
        assert len(recorder.launches) >= 4  # A, W, D, C at least
        for launch in recorder.launches:
            assert not launch.events("atomic") and not launch.events("wait"), launch.kernel
            found = races(launch)
            assert not found, "\n".join(found[:10])
    for name, got in results.items():
        for output, a, b in zip(OUTPUT_NAMES, got, results["in order"], strict=True):
            assert torch.equal(a, b), (name, output)
