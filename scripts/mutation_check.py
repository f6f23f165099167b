"""Mutation check: does the test suite kill deliberate bugs?

Each mutant is one small semantic change to the library (or its problem data), applied to a temporary copy
of the repository (the files git tracks or would track: the working tree as it is, uncommitted changes
included). The tests that should notice it run against that copy; the mutant is *killed* when they fail,
and *survives* when they pass. Every selection of tests also runs once unmutated first: a selection that
fails without a mutant cannot judge one.

    PYTHONPATH=. python scripts/mutation_check.py            # every mutant, two at a time
    PYTHONPATH=. python scripts/mutation_check.py --only p2_triton_to_reference --jobs 1

Exit status 0 when every mutant is killed, 1 otherwise. A few minutes on two CPU cores (the Triton tests
run under the interpreter there).
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
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    """A change of ``old`` (which must occur exactly once in ``path``) to ``new``, and the tests that judge it."""

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, and "-k" expressions


RULE_TESTS = ("tests/test_robustness.py", "-k", "element_rule or verdicts")
RATIO = '"required_matched_ratio": 0.99'

MUTANTS = [
    Mutant("element_rule_without_rtol", "the element rule without its rtol term", "moe_lib/bench/checks.py",
           '(diff.abs() <= rule["atol"] + rule["rtol"] * r.abs())', '(diff.abs() <= rule["atol"])', RULE_TESTS),
    Mutant("wrong_threshold", 'the "wrong" relative-error threshold 5e-2 -> 5e-1', "moe_lib/bench/checks.py",
           "WRONG_REL_ERROR = 5e-2", "WRONG_REL_ERROR = 5e-1", RULE_TESTS),
    Mutant("pass_fraction_p1", "P1's element-rule pass fraction 0.99 -> 0.5",
           "data/problems/swiglu_down_backward/lab.json", RATIO, '"required_matched_ratio": 0.5', RULE_TESTS),
    Mutant("pass_fraction_p2", "P2's element-rule pass fraction 0.99 -> 0.5",
           "data/problems/moe_experts_backward/lab.json", RATIO, '"required_matched_ratio": 0.5', RULE_TESTS),
    Mutant("timing_mean", "the timing summary's median -> mean", "moe_lib/bench/timing.py",
           "median_ms=float(np.median(samples))", "median_ms=float(np.mean(samples))",
           ("tests/test_robustness.py", "tests/test_bench.py", "-k", "summary")),
    Mutant("p1_recomputed_sigmoid", "the Triton P1 kernel recomputes sigmoid(gate) instead of the saved one",
           "moe_lib/swiglu_down/kernels.py", "s = load_tile(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)",
           "s = tl.sigmoid(load_tile(gate_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N))",
           ("tests/test_robustness.py", "-k", "saved_sigmoid")),
    Mutant("p1_triton_to_reference", 'P1\'s API sends impl="triton" to the reference', "moe_lib/swiglu_down/api.py",
           'if resolve_impl(impl, x.device, x.dtype) == "reference":',
           'if resolve_impl(impl, x.device, x.dtype) in ("reference", "triton"):',
           ("tests/test_robustness.py", "tests/swiglu_down/test_backward.py", "-k", "impl_triton or public")),
    Mutant("p2_triton_to_reference", 'P2\'s API sends impl="triton" to the reference', "moe_lib/moe_experts/api.py",
           'if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":',
           'if resolve_impl(impl, hidden_states.device, hidden_states.dtype) in ("reference", "triton"):',
           ("tests/test_robustness.py", "-k", "impl_triton")),
    Mutant("p2_tma_on_unaligned_rows", "P2's TMA-fed designs claim rows of any width", "moe_lib/moe_experts/runtime.py",
           "        if width * dtype.itemsize % 16:", "        if False:",
           ("tests/test_moe_experts_choose.py", "-k", "table or answers or unaligned")),
    # the guarantees of the robustness work itself
    Mutant("check_finite_ignored", "check_finite=True checks nothing", "moe_lib/validation.py",
           'checked = {name: t for name, t in named.items() if t.is_floating_point() and t.device.type != "meta"}',
           "checked = {}", ("tests/test_robustness.py", "-k", "check_finite")),
    Mutant("double_backward_allowed", "the Triton layers' gradients silently treated as constants",
           "moe_lib/validation.py", "if not torch.is_grad_enabled() or not anchors:", "if True:",
           ("tests/test_robustness.py", "-k", "double_backward")),
    Mutant("workspace_size_unchecked", "the Triton P2 path allocates without checking the size",
           "moe_lib/validation.py", "if total is not None and nbytes > total:", "if False:",
           ("tests/test_robustness.py", "-k", "workspaces_that_cannot_fit")),
    Mutant("seed_unchecked", "make_inputs takes any seed", "moe_lib/problems.py", "_check_seed(seed)\n", "pass\n",
           ("tests/test_robustness.py", "-k", "make_inputs_names")),
    Mutant("result_keys_unchecked", "result files load without their keys", "moe_lib/lab/results.py",
           "require_keys(document, keys, path)\n", "pass\n", ("tests/test_robustness.py", "-k", "malformed")),
    Mutant("ranks_disagree_unchecked", "the ranks' sizes and dtypes go unexchanged", "moe_lib/moe_experts/parallel.py",
           "        if len(set(by_rank)) > 1:", "        if False:",
           ("tests/test_robustness.py", "-k", "ranks_that_disagree")),
]  # fmt: skip


def repository_files() -> list[str]:
    """The files of the working tree that git tracks or would track (ignored files left out)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")  # fmt: skip
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutant names (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants checked at once (each in its own copy)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"--only: unknown mutants {sorted(unknown)}")
        mutants = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name:28} {mutant.what}")
        return 0

    files = repository_files()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as folder:
        copies = [Path(folder) / f"copy{i}" for i in range(max(1, min(args.jobs, len(mutants))))]
        for copy in copies:
            copy_repository(copy, files)
        stale = [m.name for m in mutants if (ROOT / m.path).read_text().count(m.old) != 1]
        if stale:  # the code they change has moved on: update them before judging the tests
            print(f"stale mutants (their text is not found exactly once): {', '.join(stale)}")
            return 2

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
                print(f"  {'killed  ' if result['killed'] else 'SURVIVED'} {mutant.name} ({result['seconds']:.0f} s)",
                      flush=True)  # fmt: skip
                done.append(result)
            return done

        print(f"{len(judged)} mutants, {len(copies)} at a time", flush=True)
        with ThreadPoolExecutor(len(copies)) as pool:
            results = {r["name"]: r for batch in pool.map(worker, range(len(copies))) for r in batch}

    print(f"\n{'mutant':28} {'verdict':9} {'s':>4}  what / what killed it")
    for mutant in mutants:
        if mutant.tests in broken:
            print(f"{mutant.name:28} {'UNJUDGED':9} {'':>4}  its tests fail without the mutant")
            continue
        result = results[mutant.name]
        verdict = "killed" if result["killed"] else "SURVIVED"
        print(f"{mutant.name:28} {verdict:9} {result['seconds']:4.0f}  {mutant.what}")
        print(f"{'':44}{result['report'][:150]}")
    survived = [m.name for m in mutants if m.tests in broken or not results[m.name]["killed"]]
    killed = len(mutants) - len(survived)
    print(f"\n{killed} of {len(mutants)} mutants killed in {time.perf_counter() - started:.0f} s"
          + (f"; not killed: {', '.join(survived)}" if survived else ""))  # fmt: skip
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
