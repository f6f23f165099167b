"""Mutation check: does the test suite kill deliberate bugs? A report per area of the code.

Each mutant is one small plausible bug in the library (or its problem data), applied to a temporary copy of the
repository (the files git tracks or would track: the working tree as it is, uncommitted changes included). The
tests it names, which must notice it, run against that copy; the mutant is *killed* when they fail, and
*survives* when they pass; the copy is restored after each. Every selection of tests also runs once unmutated
first: a selection that fails without a mutant cannot judge one.

Areas (:data:`AREAS`), at least five mutants each: the kernels under the interpreter, races (the waits and counters
between programs of one launch: a bug there gives the right bits under the interpreter, which runs programs one
after another, so their tests check each wait's counter and target and run programs in other orders), dispatch
(which path and which design a call takes: the choosers, ``impl``), validation (the argument checks and guards), the
benchmark's verdicts (checks, timing, export, result files), the notebooks' loaders, and the expert-parallel layer.

    PYTHONPATH=. python scripts/mutation_check.py                      # every mutant, two at a time
    PYTHONPATH=. python scripts/mutation_check.py --area loaders       # one area
    PYTHONPATH=. python scripts/mutation_check.py --only p2_triton_to_reference --jobs 1

Run it before resolving a kernel or benchmark issue, and give a new test the mutant it must kill. Exit status 0
when every mutant is killed, 1 otherwise, 2 when a mutant's text is no longer found (update it first). About
half an hour on two CPU cores (the Triton tests run under the interpreter there; the expert-parallel ones spawn
ranks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900
AREAS = ("kernels", "races", "dispatch", "validation", "bench verdicts", "loaders", "parallel")


@dataclass(frozen=True)
class Mutant:
    """A change of ``old`` (which must occur exactly once in ``path``) to ``new``, and the tests that must kill it."""

    name: str
    area: str  # one of AREAS
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, and "-k" expressions


RULE_TESTS = ("tests/test_robustness.py", "-k", "element_rule or verdicts")
RATIO = '"required_matched_ratio": 0.99'
VERDICTS = ("tests/bench/test_verdicts.py",)
NEWEST = ("tests/lab/test_newest_runs.py",)
P2_SMALL = ("tests/moe_experts/test_backward_triton.py", "-k", "interpreter_small_cases")
RACES = "tests/swiglu_down/test_races.py"
CHAINED_WAIT = "wait_for(tickets_ptr + 1, (arrival // grid + 1) * num_da)"
FEW_TOKENS_WAIT = (
    "COUNT_LATE:\n                launch_number = first(launch_arrival) // tl.num_programs(0)\n"
    "            if has_tile2:\n                wait_for(counters_ptr + 1 + b2,"
)  # few_tokens_kernel's
ONE_TOKEN_LAST = (
    "if has_tile2 & (first(arrived) % N_I2 == N_I2 - 1):\n"
    "            dx_slice_sum(dx_partials_ptr, grad_x_ptr, 0, off_h2, h2_end, T, H, N_I2, 1,"
)
FEW_TOKENS_OVERLAP = "overlapping = (tl.minimum(off_i2 + BLOCK_I2, I) - 1) // BLOCK_I1"
P1_CHOOSER = ("tests/swiglu_down/test_choose.py", "tests/swiglu_down/test_generic_form_boundaries.py")
P2_CHOOSER = ("tests/moe_experts/test_choose_boundaries.py",)
ARGUMENTS = "tests/test_validation.py"
RULE = '(diff.abs() <= rule["atol"] + rule["rtol"] * r.abs())'

MUTANTS = [
    # ---- kernels, under the interpreter
    Mutant(
        "p1_recomputed_sigmoid",
        "kernels",
        "P1's kernel recomputes sigmoid(gate) instead of the saved one",
        "moe_lib/swiglu_down/kernels.py",
        "s = load_tile(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)",
        "s = tl.sigmoid(load_tile(gate_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N))",
        ("tests/test_robustness.py", "-k", "saved_sigmoid"),
    ),
    Mutant(
        "p1_dgate_without_silu_slope",
        "kernels",
        "P1's dGate with s·(1 + gate·s) for silu's slope",
        "moe_lib/swiglu_down/kernels.py",
        "d_gate = d_a * s * (1.0 + gate * (1.0 - s)) * up",
        "d_gate = d_a * s * (1.0 + gate * s) * up",
        (
            "tests/swiglu_down/test_few_tokens.py",
            "tests/swiglu_down/test_designs.py",
            "-k",
            "streamed_tiles or library_gemms_run_on_the_cpu",
        ),
    ),  # the few-token design's and the dSwiGLU pass's
    Mutant(
        "p1_dgate_without_s",
        "kernels",
        "P1's dA epilogue drops the factor s of dGate",
        "moe_lib/swiglu_down/kernels.py",
        "d_gate = d_a * s * (1.0 + load_tile(gate_ptr",
        "d_gate = d_a * (1.0 + load_tile(gate_ptr",
        ("tests/swiglu_down/test_backward.py", "-k", "public_call"),
    ),
    Mutant(
        "p2_dgate_without_silu_slope",
        "kernels",
        "P2's kernel A takes sigmoid(g) for silu's slope",
        "moe_lib/moe_experts/kernels.py",
        "dg = da * u * sig * (1.0 + g * (1.0 - sig))",
        "dg = da * u * sig",
        P2_SMALL,
    ),
    Mutant(
        "p2_token_sum_drops_a_slot",
        "kernels",
        "P2's kernel C sums K − 1 of each token's slots",
        "moe_lib/moe_experts/kernels.py",
        "for k in range(0, top_k):\n        expert = tl.load(",
        "for k in range(0, top_k - 1):\n        expert = tl.load(",
        P2_SMALL,
    ),
    Mutant(
        "p2_topk_grad_one_tile",
        "kernels",
        "grad_topk_weights summed over the first I-tile's partials only",
        "moe_lib/moe_experts/kernels.py",
        "for tile in range(0, num_i_tiles):",
        "for tile in range(0, 1):",
        P2_SMALL,
    ),
    Mutant(
        "p2_topk_grad_of_silu",
        "kernels",
        "grad_topk_weights = ⟨Wdᵀdy, silu(g)⟩ (the up factor forgotten)",
        "moe_lib/moe_experts/kernels.py",
        "tl.sum(dap * act, axis=0)",
        "tl.sum(dap * silu, axis=0)",
        P2_SMALL,
    ),
    Mutant(
        "p2_routing_descending",
        "kernels",
        "P2's routing sorts the slots by descending expert",
        "moe_lib/moe_experts/routing.py",
        "torch.sort(flat, stable=True)",
        "torch.sort(flat, stable=True, descending=True)",
        ("tests/moe_experts/test_backward_triton.py", "-k", "routing_groups or interpreter_small_cases"),
    ),
    # ---- races: the waits and counters between programs of one launch (right bits under the interpreter)
    Mutant(
        "race_chained_wait_one_short",
        "races",
        "the chained launch's tiles of launch 2 wait for nA − 1 dA tiles",
        "moe_lib/swiglu_down/designs/chained.py",
        CHAINED_WAIT,
        CHAINED_WAIT[:-1] + " - 1)",
        (RACES, "-k", "chained_waits"),
    ),
    Mutant(
        "race_chained_wait_on_tickets",
        "races",
        "launch 2's tiles wait on the ticket counter, not the dA count",
        "moe_lib/swiglu_down/designs/chained.py",
        CHAINED_WAIT,
        CHAINED_WAIT.replace(" + 1,", ","),
        (RACES, "-k", "chained_waits"),
    ),
    Mutant(
        "race_chained_wait_first_launch",
        "races",
        "launch 2's wait forgets the launch number (right once only)",
        "moe_lib/swiglu_down/designs/chained.py",
        CHAINED_WAIT,
        "wait_for(tickets_ptr + 1, num_da)",
        (RACES, "-k", "chained_waits"),
    ),
    Mutant(
        "race_chained_count_relaxed",
        "races",
        "the dA tiles count themselves done without release",
        "moe_lib/swiglu_down/designs/chained.py",
        'tl.atomic_add(tickets_ptr + 1, 1, sem="release", scope="gpu")',
        'tl.atomic_add(tickets_ptr + 1, 1, sem="relaxed", scope="gpu")',
        (RACES, "-k", "chained_waits"),
    ),
    Mutant(
        "race_chained_count_before_barrier",
        "races",
        "the dA count without the barrier after the dGate stores",
        "moe_lib/swiglu_down/designs/chained.py",
        "tl.debug_barrier()  # every thread's dGate, dUp stores come before the count\n        tl.atomic_add(",
        "tl.atomic_add(",
        (RACES, "-k", "chained_waits"),
    ),
    Mutant(
        "race_few_tokens_wait_next_block",
        "races",
        "phase 2's tiles wait on the next I-block's counter",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        FEW_TOKENS_WAIT,
        FEW_TOKENS_WAIT.replace("+ 1 + b2,", "+ 2 + b2,"),
        (RACES, "-k", "few_token_waits"),
    ),
    Mutant(
        "race_few_tokens_wait_one_block",
        "races",
        "phase 2's wait counts one phase-1 I-block where two straddle it",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        FEW_TOKENS_OVERLAP + " - off_i2 // BLOCK_I1 + 1",
        "overlapping = 1",
        (RACES, "-k", "few_token_waits and straddl"),
    ),
    Mutant(
        "race_few_tokens_overlap_rounded_up",
        "races",
        "phase 2's wait counts an I-block past an aligned end",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        FEW_TOKENS_OVERLAP,
        "overlapping = tl.minimum(off_i2 + BLOCK_I2, I) // BLOCK_I1",
        (RACES, "-k", "few_token_waits"),
    ),
    Mutant(
        "race_few_tokens_dx_slices_short",
        "races",
        "the sliced dx sum waits for N_I2 − 1 partials",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        "wait_for(counters_ptr + 1 + N_I2 + c2, (launch_number + 1) * N_I2)",
        "wait_for(counters_ptr + 1 + N_I2 + c2, (launch_number + 1) * N_I2 - 1)",
        (RACES, "-k", "few_token_waits"),
    ),
    Mutant(
        "race_few_tokens_arrival_relaxed",
        "races",
        "phase 1's tiles count their dA partials in without release",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        'BLOCK_I2 + 1):\n            tl.atomic_add(counters_ptr + 1 + b, 1, mask=has_tile1, sem="release"',
        'BLOCK_I2 + 1):\n            tl.atomic_add(counters_ptr + 1 + b, 1, mask=has_tile1, sem="relaxed"',
        (RACES, "-k", "few_token_waits"),
    ),
    Mutant(
        "race_one_token_last_by_block",
        "races",
        "one token: the last I-block's tile sums dx, not the last arrival",
        "moe_lib/swiglu_down/designs/few_tokens.py",
        ONE_TOKEN_LAST,
        ONE_TOKEN_LAST.replace("first(arrived) % N_I2 == N_I2 - 1", "b2 == N_I2 - 1"),
        (RACES, "-k", "split_sums and one"),
    ),
    Mutant(
        "race_split_last_by_number",
        "races",
        "split-K: the last split by number sums, not the last to arrive",
        "moe_lib/swiglu_down/kernels.py",
        "is_last = (arrived & (SPLIT - 1)) == SPLIT - 1",
        "is_last = split == SPLIT - 1",
        (RACES, "-k", "split_sums and triton_launches"),
    ),
    Mutant(
        "race_split_arrival_release_only",
        "races",
        "split-K's arrival does not acquire the other splits' partials",
        "moe_lib/swiglu_down/kernels.py",
        'arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel"',
        'arrived = tl.atomic_add(counters_ptr + tile, 1, sem="release"',
        (RACES, "-k", "split_sums"),
    ),
    # ---- dispatch: which path and which design a call takes
    Mutant(
        "p1_triton_to_reference",
        "dispatch",
        'P1\'s API sends impl="triton" to the reference',
        "moe_lib/swiglu_down/api.py",
        'if resolve_impl(impl, x.device, x.dtype) == "reference":',
        'if resolve_impl(impl, x.device, x.dtype) in ("reference", "triton"):',
        ("tests/test_robustness.py", "tests/swiglu_down/test_backward.py", "-k", "impl_triton or public"),
    ),
    Mutant(
        "p2_triton_to_reference",
        "dispatch",
        'P2\'s API sends impl="triton" to the reference',
        "moe_lib/moe_experts/api.py",
        'if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":',
        'if resolve_impl(impl, hidden_states.device, hidden_states.dtype) in ("reference", "triton"):',
        ("tests/test_robustness.py", "-k", "impl_triton"),
    ),
    Mutant(
        "p2_tma_on_unaligned_rows",
        "dispatch",
        "P2's TMA-fed designs claim rows of any width",
        "moe_lib/moe_experts/runtime.py",
        "        if width * dtype.itemsize % 16:",
        "        if False:",
        ("tests/moe_experts/test_choose.py", "-k", "table or answers or unaligned"),
    ),
    Mutant(
        "auto_triton_on_cpu",
        "dispatch",
        'impl="auto" takes the Triton path off CUDA',
        "moe_lib/dispatch.py",
        'use_triton = device.type == "cuda" and dtype in TRITON_DTYPES and triton_importable()',
        "use_triton = dtype in TRITON_DTYPES and triton_importable()",
        (ARGUMENTS, "-k", "auto_impl"),
    ),
    Mutant(
        "p1_few_tokens_faithful_to_127",
        "dispatch",
        "P1's faithful few-token band ends at 127 tokens",
        "moe_lib/swiglu_down/choose.py",
        'FEW_TOKENS_MAX = {"fast": 64, "faithful": 128}',
        'FEW_TOKENS_MAX = {"fast": 64, "faithful": 127}',
        P1_CHOOSER,
    ),
    Mutant(
        "p1_chained_to_1250",
        "dispatch",
        "P1's chained launch to 1250 tokens",
        "moe_lib/swiglu_down/choose.py",
        "CHAINED_MAX_TOKENS = 1249",
        "CHAINED_MAX_TOKENS = 1250",
        P1_CHOOSER,
    ),
    Mutant(
        "p1_narrow_form_strict",
        "dispatch",
        "P1's narrow Gluon form below half the SMs' tiles, not at it",
        "moe_lib/swiglu_down/choose.py",
        "if cdiv(T, 64) * cdiv(I, 64) <= sms // 2:",
        "if cdiv(T, 64) * cdiv(I, 64) < sms // 2:",
        P1_CHOOSER,
    ),
    Mutant(
        "p1_tall_form_to_half_the_sms",
        "dispatch",
        "P1's tall Gluon form at half the SMs' tiles, not below",
        "moe_lib/swiglu_down/choose.py",
        "elif cdiv(T, 128) * cdiv(I, 128) < sms // 2:",
        "elif cdiv(T, 128) * cdiv(I, 128) <= sms // 2:",
        P1_CHOOSER,
    ),
    Mutant(
        "p2_busy_from_513_rows",
        "dispatch",
        "P2's busy-expert tiles from 513 mean rows, not 512",
        "moe_lib/moe_experts/choose.py",
        "if mean_rows >= 512 and input_bytes == 2:",
        "if mean_rows > 512 and input_bytes == 2:",
        P2_CHOOSER,
    ),
    Mutant(
        "p2_busy_tiles_in_fp32",
        "dispatch",
        "P2's 16-bit busy-expert tiles taken for fp32 too",
        "moe_lib/moe_experts/choose.py",
        "if mean_rows >= 512 and input_bytes == 2:",
        "if mean_rows >= 512:",
        P2_CHOOSER,
    ),
    Mutant(
        "p2_w_groups_to_128_rows",
        "dispatch",
        "kernel W in 4 expert groups at 128 mean rows",
        "moe_lib/moe_experts/choose.py",
        "groups = 4 if mean_rows < 128 else",
        "groups = 4 if mean_rows <= 128 else",
        P2_CHOOSER,
    ),
    Mutant(
        "p2_d_busy_from_129_rows",
        "dispatch",
        "kernel D's busy tiles from 129 mean rows",
        "moe_lib/moe_experts/choose.py",
        "    if mean_rows >= 128:  # busy experts",
        "    if mean_rows > 128:  # busy experts",
        P2_CHOOSER,
    ),
    Mutant(
        "p2_tma_before_hopper",
        "dispatch",
        "P2's TMA-fed designs claim compute capability 8.9",
        "moe_lib/moe_experts/runtime.py",
        "target.capability < (9, 0)",
        "target.capability < (8, 9)",
        P2_CHOOSER,
    ),
    # ---- validation: argument checks and guards
    Mutant(
        "check_finite_ignored",
        "validation",
        "check_finite=True checks nothing",
        "moe_lib/validation.py",
        'checked = {name: t for name, t in named.items() if t.is_floating_point() and t.device.type != "meta"}',
        "checked = {}",
        ("tests/test_robustness.py", "-k", "check_finite"),
    ),
    Mutant(
        "double_backward_allowed",
        "validation",
        "the Triton layers' gradients silently treated as constants",
        "moe_lib/validation.py",
        "if not torch.is_grad_enabled() or not anchors:",
        "if True:",
        ("tests/test_robustness.py", "-k", "double_backward"),
    ),
    Mutant(
        "workspace_size_unchecked",
        "validation",
        "the Triton P2 path allocates without checking the size",
        "moe_lib/validation.py",
        "if total is not None and nbytes > total:",
        "if False:",
        ("tests/test_robustness.py", "-k", "workspaces_that_cannot_fit"),
    ),
    Mutant(
        "seed_unchecked",
        "validation",
        "make_inputs takes any seed",
        "moe_lib/problems.py",
        "_check_seed(seed)\n",
        "pass\n",
        ("tests/test_robustness.py", "-k", "make_inputs_names"),
    ),
    Mutant(
        "shapes_of_the_sources_only",
        "validation",
        "only the arguments giving the sizes have their shape checked",
        "moe_lib/validation.py",
        "        _check_shape(argument, t, fixed, sizes, source)",
        "        if argument.name in sizes_from:\n            _check_shape(argument, t, fixed, sizes, source)",
        (ARGUMENTS, "-k", "dim_"),
    ),
    Mutant(
        "device_of_the_floats_only",
        "validation",
        "the routing indices left out of the device check",
        "moe_lib/validation.py",
        "same_device({a.name: values[a.name] for a in order})",
        "same_device({a.name: values[a.name] for a in order if a.dtype != INDEX})",
        (ARGUMENTS, "-k", "other_device"),
    ),
    Mutant(
        "routing_weights_any_float",
        "validation",
        "topk_weights of any float dtype",
        "moe_lib/validation.py",
        "if argument.dtype == FLOAT_OR_FP32 and t.dtype not in (reference.dtype, torch.float32):",
        "if False:",
        (ARGUMENTS, "-k", "other_dtype"),
    ),
    Mutant(
        "indices_any_integer",
        "validation",
        "topk_indices of any integer dtype",
        "moe_lib/validation.py",
        "if t.dtype not in INDEX_DTYPES:",
        "if t.is_floating_point():",
        (ARGUMENTS, "-k", "other_dtype"),
    ),
    Mutant(
        "meta_indices_accepted",
        "validation",
        "P2 takes meta topk_indices (no values to route by)",
        "moe_lib/moe_experts/checks.py",
        "    check_routing_has_values(topk_indices)\n    T, H, I, E, K",
        "    T, H, I, E, K",
        ("tests/test_robustness.py", "-k", "meta_tensors"),
    ),
    Mutant(
        "forward_any_strides",
        "validation",
        "P2's Triton forward takes weights of any strides",
        "moe_lib/moe_experts/launch.py",
        "    check_contiguous(\n        dict(\n            hidden_states=hidden_states,",
        "    (\n        dict(\n            hidden_states=hidden_states,",
        ("tests/test_robustness.py", "-k", "forward_launch_refuses_strided"),
    ),
    # ---- the benchmark's verdicts: checks, timing, export, result files
    Mutant(
        "element_rule_without_rtol",
        "bench verdicts",
        "the element rule without its rtol term",
        "moe_lib/bench/checks.py",
        RULE,
        '(diff.abs() <= rule["atol"])',
        RULE_TESTS,
    ),
    Mutant(
        "wrong_threshold",
        "bench verdicts",
        'the "wrong" relative-error threshold 5e-2 -> 5e-1',
        "moe_lib/bench/checks.py",
        "WRONG_REL_ERROR = 5e-2",
        "WRONG_REL_ERROR = 5e-1",
        RULE_TESTS,
    ),
    Mutant(
        "pass_fraction_p1",
        "bench verdicts",
        "P1's element-rule pass fraction 0.99 -> 0.5",
        "data/problems/swiglu_down_backward/lab.json",
        RATIO,
        '"required_matched_ratio": 0.5',
        RULE_TESTS,
    ),
    Mutant(
        "pass_fraction_p2",
        "bench verdicts",
        "P2's element-rule pass fraction 0.99 -> 0.5",
        "data/problems/moe_experts_backward/lab.json",
        RATIO,
        '"required_matched_ratio": 0.5',
        RULE_TESTS,
    ),
    Mutant(
        "timing_mean",
        "bench verdicts",
        "the timing summary's median -> mean",
        "moe_lib/bench/timing.py",
        "median_ms=float(np.median(samples))",
        "median_ms=float(np.mean(samples))",
        ("tests/test_robustness.py", "tests/bench/test_bench.py", "-k", "summary"),
    ),
    Mutant(
        "worst_fraction_of_the_best_output",
        "bench verdicts",
        "the element rule judged on the best output",
        "moe_lib/bench/checks.py",
        "worst_fraction = min(fractions)",
        "worst_fraction = max(fractions)",
        VERDICTS,
    ),
    Mutant(
        "required_fraction_exclusive",
        "bench verdicts",
        "exactly 99% of the elements no longer pass",
        "moe_lib/bench/checks.py",
        'worst_fraction >= rule["required_fraction"]',
        'worst_fraction > rule["required_fraction"]',
        VERDICTS,
    ),
    Mutant(
        "element_bound_exclusive",
        "bench verdicts",
        "an element exactly at atol + rtol·|ref| fails",
        "moe_lib/bench/checks.py",
        RULE,
        '(diff.abs() < rule["atol"] + rule["rtol"] * r.abs())',
        VERDICTS,
    ),
    Mutant(
        "replay_recheck_ignored",
        "bench verdicts",
        "a graph whose replays write wrong outputs is timed",
        "moe_lib/bench/harness.py",
        'if stats["replay_wrong"] is not None:',
        "if False:",
        (*VERDICTS, "-k", "replay"),
    ),
    Mutant(
        "export_runs_the_reference",
        "bench verdicts",
        "every exported solution calls the reference",
        "moe_lib/bench/official.py",
        '_PEER = peers_for("{problem}")["{impl}"]',
        '_PEER = peers_for("{problem}")["reference"]',
        (*VERDICTS, "-k", "exported"),
    ),
    Mutant(
        "flush_smaller_than_l2",
        "bench verdicts",
        "the L2 flush 64 MiB",
        "moe_lib/bench/timing.py",
        "L2_FLUSH_BYTES = 512 * 2**20",
        "L2_FLUSH_BYTES = 64 * 2**20",
        (*VERDICTS, "-k", "flush"),
    ),
    Mutant(
        "all_correct_on_any_case",
        "bench verdicts",
        "an implementation right on one case is all-correct",
        "moe_lib/bench/results.py",
        "all_correct=bool(len(rows) > 0 and len(ok) == len(rows)),",
        "all_correct=bool(len(ok) > 0),",
        (*VERDICTS, "-k", "wrong_case or every_baseline"),
    ),
    Mutant(
        "results_written_in_place",
        "bench verdicts",
        "result files written in place (half a file on abort)",
        "moe_lib/bench/results.py",
        "        write(temporary)\n        os.replace(temporary, path)",
        "        write(path)",
        ("tests/bench/test_interrupts.py",),
    ),
    Mutant(
        "stale_json_kept",
        "bench verdicts",
        "a rerun keeps the JSON of the run before until its own",
        "moe_lib/bench/results.py",
        "    Path(json_path).unlink(missing_ok=True)\n    write_csv(csv_path, frame)",
        "    write_csv(csv_path, frame)",
        ("tests/bench/test_interrupts.py",),
    ),
    Mutant(
        "long_cases_from_12ms",
        "bench verdicts",
        "fewer repetitions from 12 ms, not 10",
        "moe_lib/bench/timing.py",
        "LONG_CASE_MS = 10.0",
        "LONG_CASE_MS = 12.0",
        ("tests/bench/test_thresholds.py",),
    ),
    # ---- the notebooks' loaders
    Mutant(
        "result_keys_unchecked",
        "loaders",
        "result files load without their keys",
        "moe_lib/lab/results.py",
        "require_keys(document, keys, path)\n",
        "pass\n",
        ("tests/test_robustness.py", "-k", "malformed"),
    ),
    Mutant(
        "results_keep_the_oldest",
        "loaders",
        "load_results keeps the oldest file of each kind",
        "moe_lib/lab/results.py",
        "result.date >= newest[result.key].date",
        "result.date <= newest[result.key].date",
        NEWEST,
    ),
    Mutant(
        "model_runs_by_file_name",
        "loaders",
        "the model suite's newest rows by file name, not date",
        "moe_lib/lab/models.py",
        '.sort_values(["date_utc", "file"], kind="stable")',
        '.sort_values(["file", "date_utc"], kind="stable")',
        NEWEST,
    ),
    Mutant(
        "layer_runs_keep_the_first",
        "loaders",
        "load_layer_runs keeps the oldest file of each kind",
        "moe_lib/lab/training_step.py",
        "        newest[key] = (csv_path, meta)",
        "        newest.setdefault(key, (csv_path, meta))",
        NEWEST,
    ),
    Mutant(
        "rank_work_keeps_the_oldest",
        "loaders",
        "load_rank_work keeps the oldest run per dtype",
        "moe_lib/lab/parallel.py",
        "newest = {run.dtype: run for run in runs}",
        "newest = {run.dtype: run for run in reversed(runs)}",
        NEWEST,
    ),
    Mutant(
        "official_runs_keep_the_first",
        "loaders",
        "load_official_runs keeps the oldest run per impl",
        "moe_lib/lab/official_runs.py",
        '        newest[meta["impl"]] = OfficialRun(path, meta)',
        '        newest.setdefault(meta["impl"], OfficialRun(path, meta))',
        NEWEST,
    ),
    Mutant(
        "parallel_runs_newest_first",
        "loaders",
        "the parallel runs sorted newest first (the oldest kept)",
        "moe_lib/lab/parallel.py",
        "return sorted(runs, key=lambda run: run.date)",
        "return sorted(runs, key=lambda run: run.date, reverse=True)",
        NEWEST,
    ),
    # ---- the expert-parallel layer
    Mutant(
        "ranks_disagree_unchecked",
        "parallel",
        "the ranks' sizes and dtypes go unexchanged",
        "moe_lib/moe_experts/parallel.py",
        "        if len(set(by_rank)) > 1:",
        "        if False:",
        ("tests/test_robustness.py", "-k", "ranks_that_disagree"),
    ),
    Mutant(
        "auto_chunks_from_65537_rows",
        "parallel",
        "two chunks from 65537 rows per rank, not 65536",
        "moe_lib/moe_experts/parallel.py",
        "mean_rows >= AUTO_CHUNKS_MIN_ROWS",
        "mean_rows > AUTO_CHUNKS_MIN_ROWS",
        (*P2_CHOOSER, "-k", "parallel"),
    ),
    Mutant(
        "partition_extra_to_the_last_ranks",
        "parallel",
        "the extra experts go to the last ranks",
        "moe_lib/moe_experts/parallel.py",
        "count = base + (1 if rank < extra else 0)",
        "count = base + (1 if rank >= world_size - extra else 0)",
        ("tests/moe_experts/test_parallel.py", "-k", "partition"),
    ),
    Mutant(
        "chunks_rounded_up",
        "parallel",
        "each chunk's experts rounded up",
        "moe_lib/moe_experts/parallel.py",
        "bounds = [local_experts * c // chunks for c in range(chunks + 1)]",
        "bounds = [-(-local_experts * c // chunks) for c in range(chunks + 1)]",
        ("tests/moe_experts/test_parallel.py", "-k", "expert_chunks"),
    ),
    Mutant(
        "dispatch_sends_wrong_rows",
        "parallel",
        "the backward sends dy of the wrong tokens",
        "moe_lib/moe_experts/parallel.py",
        "send_dy = grad_output[chunk.send_slot // plan.top_k]",
        "send_dy = grad_output[chunk.send_slot % plan.top_k]",
        ("tests/moe_experts/test_parallel.py", "-k", "two_ranks_match"),
    ),
    Mutant(
        "local_weights_unchecked",
        "parallel",
        "the local up and down weights left out of the checks",
        "moe_lib/moe_experts/parallel.py",
        "sizes = check_arguments(PARALLEL_ARGUMENTS, values",
        "sizes = check_arguments(PARALLEL_ARGUMENTS[:4], values",
        (ARGUMENTS, "-k", "moe_experts_parallel"),
    ),
    # ---- held-out audit (notes/tests/held-out-audit.md)
    Mutant(
        "partition_extra_from_rank_0_inclusive",
        "parallel",
        "rank == extra also gets an extra expert",
        "moe_lib/moe_experts/parallel.py",
        "count = base + (1 if rank < extra else 0)",
        "count = base + (1 if rank <= extra else 0)",
        ("tests/moe_experts/test_parallel.py", "-k", "partition"),
    ),
    Mutant(
        "chunks_last_gets_rest",
        "parallel",
        "chunk bounds from local_experts*c//(chunks+1)",
        "moe_lib/moe_experts/parallel.py",
        "bounds = [local_experts * c // chunks for c in range(chunks + 1)]",
        "bounds = [local_experts * c // chunks for c in range(chunks)] + [local_experts - 1]",
        ("tests/moe_experts/test_parallel.py", "-k", "expert_chunks"),
    ),
    Mutant(
        "chunks_bool_accepted",
        "parallel",
        "chunks=True accepted",
        "moe_lib/moe_experts/parallel.py",
        "if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):",
        "if chunks is not None and (not isinstance(chunks, int) or chunks < 1):",
        ("tests/moe_experts/test_parallel.py", "tests/test_validation.py", "-k", "chunks"),
    ),
    Mutant(
        "summary_p20_as_p25",
        "bench verdicts",
        "p20 as the 25th percentile",
        "moe_lib/bench/timing.py",
        "p20_ms=float(np.percentile(samples, 20)),",
        "p20_ms=float(np.percentile(samples, 25)),",
        ("tests/test_robustness.py", "tests/bench/test_bench.py", "-k", "summar"),
    ),
    Mutant(
        "long_cases_no_minimum",
        "bench verdicts",
        "long cases without the 5-rep floor",
        "moe_lib/bench/timing.py",
        "return min(reps, max(MIN_LONG_CASE_REPS, fitting))",
        "return min(reps, fitting)",
        ("tests/bench/test_thresholds.py", "tests/bench/test_bench.py", "-k", "repetitions"),
    ),
    Mutant(
        "geomean_accepts_zero",
        "bench verdicts",
        "geomean takes zero times",
        "moe_lib/bench/results.py",
        "if not values or any(not v > 0 for v in values):",
        "if not values or any(v < 0 for v in values):",
        ("tests/bench/test_thresholds.py", "-k", "geomean"),
    ),
    Mutant(
        "element_rule_any_row",
        "bench verdicts",
        "passes_element_rule true if any row passes",
        "moe_lib/bench/results.py",
        "passes_element_rule=bool(all(element)) if element else None,",
        "passes_element_rule=bool(any(element)) if element else None,",
        ("tests/bench/test_verdicts.py",),
    ),
    Mutant(
        "band_label_strict",
        "loaders",
        "band starts exclusive",
        "moe_lib/lab/tuning_index.py",
        "        if num_tokens < first:\n            break",
        "        if num_tokens <= first:\n            break",
        ("tests/lab/test_tuning_index.py",),
    ),
    Mutant(
        "finite_skips_first",
        "validation",
        "finite checks all but the first tensor",
        "moe_lib/validation.py",
        "for name, t in named.items() if t.is_floating_point()",
        "for name, t in list(named.items())[1:] if t.is_floating_point()",
        ("tests/test_robustness.py", "-k", "check_finite_names_the_argument"),
    ),
    Mutant(
        "p1_few_tokens_work_strict",
        "dispatch",
        "few-token design only below its work cap, not at it",
        "moe_lib/swiglu_down/choose.py",
        "if T * H * I <= FEW_TOKENS_MAX_WORK else None",
        "if T * H * I < FEW_TOKENS_MAX_WORK else None",
        ("tests/swiglu_down/test_choose.py", "tests/swiglu_down/test_generic_form_boundaries.py"),
    ),
    Mutant(
        "p1_table_entry_strict",
        "dispatch",
        "P1's tuned table entry from the one starting below T",
        "moe_lib/swiglu_down/choose.py",
        "max(entry for entry in table if entry[0] <= T)",
        "max(entry for entry in table if entry[0] < T)",
        ("tests/swiglu_down/test_choose.py", "tests/swiglu_down/test_generic_form_boundaries.py"),
    ),
    Mutant(
        "p1_dup_with_sigmoid",
        "kernels",
        "P1's dUp scaled by the saved sigmoid, not silu",
        "moe_lib/swiglu_down/kernels.py",
        "d_up = d_a * load_tile(gate_silu_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)",
        "d_up = d_a * load_tile(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)",
        ("tests/swiglu_down/test_backward.py", "-k", "public_call"),
    ),
    Mutant(
        "p2_preact_store_without_col_mask",
        "kernels",
        "P2's forward stores g and u past the last I column",
        "moe_lib/moe_experts/kernels.py",
        "out_mask = col_ok[:, None] & row_ok[None, :]",
        "out_mask = row_ok[None, :] & (cols >= 0)[:, None]",
        ("tests/moe_experts/test_backward_triton.py", "-k", "interpreter_small_cases"),
    ),
    Mutant(
        "p2_w_stages_from_513_rows",
        "dispatch",
        "kernel W's 4 stages from 513 mean rows, not 512",
        "moe_lib/moe_experts/choose.py",
        "stages = 4 if mean_rows >= 512 else 3",
        "stages = 4 if mean_rows > 512 else 3",
        P2_CHOOSER,
    ),
    Mutant(
        "extra_dims_accepted",
        "validation",
        "a tensor with more dims than expected passes the dim check",
        "moe_lib/validation.py",
        "if t.dim() != count:",
        "if t.dim() < count:",
        (ARGUMENTS, "-k", "p2_bad_inputs"),
    ),
    Mutant(
        "rel_error_zero_ref_is_zero",
        "bench verdicts",
        "an all-zero reference gives relative error 0 whatever the output",
        "moe_lib/bench/checks.py",
        "if ref_sq > 0 else math.sqrt(diff_sq)",
        "if ref_sq > 0 else 0.0",
        ("tests/bench/test_thresholds.py", "-k", "relative_error"),
    ),
    Mutant(
        "speedup_colour_at_one_red",
        "loaders",
        "a model speed-up of exactly 1 coloured as a slowdown",
        "moe_lib/lab/models.py",
        '    if value < 1:\n        return "color: #b00020"',
        '    if value <= 1:\n        return "color: #b00020"',
        ("tests/lab/test_results.py", "-k", "speedup_colours"),
    ),
    Mutant(
        "p2_dup_with_sigmoid",
        "kernels",
        "P2's kernel A scales dU by sigmoid(g), not silu(g)",
        "moe_lib/moe_experts/kernels.py",
        "            du = da * silu\n",
        "            du = da * sig\n",
        P2_SMALL,
    ),
]


def repository_files() -> list[str]:
    """The files of the working tree that git tracks or would track (ignored files left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return [name for name in listed if name and (ROOT / name).is_file()]


def copy_repository(destination: Path, files: list[str]) -> None:
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[bool, str, float]:
    """(passed, the last lines of pytest's report, seconds) of ``tests`` run in ``copy``."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT_S} s", time.perf_counter() - started
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = (failed[:1] + lines[-1:]) if failed else lines[-1:]
    return done.returncode == 0, " | ".join(summary), time.perf_counter() - started


def apply(copy: Path, mutant: Mutant) -> str:
    """Writes the mutant into ``copy``; returns the original text (to restore)."""
    path = copy / mutant.path
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.name}: expected the text to change once in {mutant.path}, found it {count} times")
    path.write_text(original.replace(mutant.old, mutant.new))
    return original


def check_mutant(copy: Path, mutant: Mutant) -> dict:
    original = apply(copy, mutant)
    try:
        passed, report, seconds = run_tests(copy, mutant.tests)
    finally:
        (copy / mutant.path).write_text(original)
    return dict(name=mutant.name, killed=not passed, report=report, seconds=seconds)


def area_report(mutants: list[Mutant], killed: set[str]) -> list[str]:
    """One line per area: mutants killed of those judged, the kill rate, the survivors."""
    lines = [f"{'area':16} {'killed':>8} {'rate':>6}  survived"]
    for area in AREAS:
        names = [m.name for m in mutants if m.area == area]
        if not names:
            continue
        dead = [name for name in names if name in killed]
        survivors = ", ".join(name for name in names if name not in killed) or "-"
        lines.append(f"{area:16} {len(dead):>3} / {len(names):<3} {len(dead) / len(names):>6.0%}  {survivors}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutant names (default: all)")
    parser.add_argument("--area", choices=AREAS, help="the mutants of one area")
    parser.add_argument("--jobs", type=int, default=2, help="mutants checked at once (each in its own copy)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.area is None or m.area == args.area]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"--only: unknown mutants {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in wanted]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.area:15} {mutant.name:34} {mutant.what}")
        return 0

    stale = [m.name for m in mutants if (ROOT / m.path).read_text().count(m.old) != 1]
    if stale:  # the code they change has moved on: update them before judging the tests
        print(f"stale mutants (their text is not found exactly once): {', '.join(stale)}")
        return 2
    files = repository_files()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as folder:
        copies = [Path(folder) / f"copy{i}" for i in range(max(1, min(args.jobs, len(mutants))))]
        for copy in copies:
            copy_repository(copy, files)

        started = time.perf_counter()
        selections = sorted({m.tests for m in mutants})
        print(f"baseline: {len(selections)} test selections, unmutated", flush=True)
        with ThreadPoolExecutor(len(copies)) as pool:  # unmutated copies are only read: any copy serves
            outcomes = pool.map(run_tests, [copies[i % len(copies)] for i in range(len(selections))], selections)
            baseline = dict(zip(selections, outcomes, strict=True))
        broken = {tests: report for tests, (passed, report, _) in baseline.items() if not passed}
        for tests, report in broken.items():
            print(f"  FAILS WITHOUT A MUTANT: {' '.join(tests)}: {report}")

        judged = [m for m in mutants if m.tests not in broken]
        queue = list(enumerate(judged))

        def worker(index: int) -> list[dict]:
            done = []
            while queue:
                try:
                    _, mutant = queue.pop(0)
                except IndexError:
                    break
                result = check_mutant(copies[index], mutant)
                print(
                    f"  {'killed  ' if result['killed'] else 'SURVIVED'} {mutant.area:15} {mutant.name} "
                    f"({result['seconds']:.0f} s)",
                    flush=True,
                )
                done.append(result)
            return done

        print(f"{len(judged)} mutants, {len(copies)} at a time", flush=True)
        with ThreadPoolExecutor(len(copies)) as pool:
            results = {r["name"]: r for batch in pool.map(worker, range(len(copies))) for r in batch}

    print(f"\n{'mutant':34} {'verdict':9} {'s':>4}  what / what killed it")
    for mutant in mutants:
        if mutant.tests in broken:
            print(f"{mutant.name:34} {'UNJUDGED':9} {'':>4}  its tests fail without the mutant")
            continue
        result = results[mutant.name]
        verdict = "killed" if result["killed"] else "SURVIVED"
        print(f"{mutant.name:34} {verdict:9} {result['seconds']:4.0f}  {mutant.what}")
        print(f"{'':50}{result['report'][:150]}")
    killed = {name for name, result in results.items() if result["killed"]}
    print("\n" + "\n".join(area_report(mutants, killed)))
    survived = [m.name for m in mutants if m.name not in killed]
    print(
        f"\n{len(killed)} of {len(mutants)} mutants killed in {time.perf_counter() - started:.0f} s"
        + (f"; not killed: {', '.join(survived)}" if survived else "")
    )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
