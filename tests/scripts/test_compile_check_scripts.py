"""The offline sm_90 compile checks in scripts/ stay in step with the kernels they compile.

Each script gives every kernel argument a type or a compile-time value before ``triton.compile``; a kernel
that gains an argument the script does not know makes the script report "no value or type" for it, and
the check is silently useless until someone reads its output. Here the scripts run in one child process
without the interpreter (they compile the kernels as the GPU would), with ``triton.compile`` replaced by a
stub that records what it was given, so that all of them run in seconds: what is checked is that each
reaches the compiler for every kernel with a complete signature. (The compilation itself, ptxas and the
resource report, is what the scripts are for; it runs in them, not here.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import compile_env

ROOT = Path(__file__).resolve().parents[2]

# script and its arguments -> the fewest kernels it compiles
CASES = {
    "p2/p2_compile_check.py --dtype fp32": 4,
    "p2/p2_compile_check.py --dtype bf16": 4,
    "p2/p2_tma_compile_check.py --cases bf16:2048,fp32:2048": 4,
    "p2/p2_tma_d_compile_check.py --cases bf16:2048 --uses backward,forward": 3,
    # the chooser's design and every named one at the default shape, each distinct kernel once, and the layer's step
    "p1/p1_compile_check.py --precision faithful": 30,
    "p1/p1_compile_check.py --precision fast": 30,
    "p1/p1_compile_check.py --precision faithful --shape 1,2048,768 default": 3,
    "p1/p1_few_tokens_check.py --compile-only a_reg a_reg_132 a_reg_cl_st_mv": 4,
}

# Runs each script as __main__ with a stub compiler; prints one JSON line per script: what reached the
# compiler (kernel name, its constexprs, the arguments given as constants and those given types) and what
# the script printed.
CHILD = r"""
import contextlib, io, json, runpy, sys
import triton

class StubCompiled(Exception):
    pass

reached = []

def stub_compile(source, target=None, options=None):
    fn = source.fn
    reached.append({"kernel": fn.__name__, "constexprs": [p.name for p in fn.params if p.is_constexpr],
                    "given": sorted(name for name, kind in source.signature.items() if kind == "constexpr"),
                    "typed": sorted(name for name, kind in source.signature.items() if kind != "constexpr"),
                    "arguments": list(fn.arg_names)})
    raise StubCompiled("stub compiler: " + fn.__name__)

triton.compile = stub_compile
for case in json.loads(sys.argv[1]):
    script, *args = case.split()
    folder = "scripts/" + script.rpartition("/")[0]
    sys.path.insert(0, folder)  # as when a script runs directly: it may import its neighbours
    reached.clear()
    out = io.StringIO()
    status = 0
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path("scripts/" + script, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
    sys.path.remove(folder)
    print(json.dumps({"case": case, "status": status, "reached": list(reached), "out": out.getvalue()}))
"""


@pytest.fixture(scope="module")
def runs():
    env = compile_env(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(list(CASES))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {run["case"]: run for run in lines}


@pytest.mark.parametrize("case", list(CASES))
def test_compile_check_reaches_the_compiler_with_every_argument(runs, case):
    run = runs[case]
    assert run["status"] in (None, 0), run["out"]
    assert "no value or type" not in run["out"], run["out"]
    assert len(run["reached"]) >= CASES[case], run["out"]
    for kernel in run["reached"]:  # every constexpr got a value, every other argument a value or a type
        assert set(kernel["constexprs"]) <= set(kernel["given"]), kernel
        assert set(kernel["given"]) | set(kernel["typed"]) == set(kernel["arguments"]), kernel
