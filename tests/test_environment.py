"""The project's set-up files agree with each other."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _normalise(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).replace('"', "'").lower()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from_pyproject = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        from_pyproject |= set(extra)
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    from_conda = {line.strip()[2:] for line in lines[start + 1 :] if line.strip().startswith("- ")}
    assert {_normalise(r) for r in from_conda} == {_normalise(r) for r in from_pyproject}


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_import_needs_only_the_core_libraries():
    """`import moe_lib` (and its benchmark modules) must not pull in the report or notebook stack."""
    import subprocess
    import sys

    code = (
        "import sys, moe_lib, moe_lib.roofline, moe_lib.bench.cli, moe_lib.bench.parallel, moe_lib.bench.tuning\n"
        "heavy = {'papermill', 'yaml', 'nbconvert', 'nbformat', 'jupyter_client', 'IPython'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_kernel_core_runs_without_the_lab_libraries():
    """moe_lib's functions, layers, problems, roofline and choosers import and run with pandas and matplotlib absent
    (they are the ``lab`` extra's: the benchmark, the notebooks' helpers, the report)."""
    import subprocess
    import sys

    code = (
        # an import of either raises (a probe of whether they exist, as torch makes, still finds them)
        "import importlib.abc, importlib.util, sys\n"
        "class Refuse(importlib.abc.Loader):\n"
        "    def create_module(self, spec):\n"
        "        raise ImportError(spec.name)\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in {'pandas', 'matplotlib'}:\n"
        "            return importlib.util.spec_from_loader(name, Refuse())\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import moe_lib, moe_lib.distributed, moe_lib.roofline\n"
        "import moe_lib.swiglu_down.choose, moe_lib.moe_experts.choose\n"
        "from moe_lib.problems import make_inputs\n"
        "p1 = make_inputs('swiglu_down_backward', 3, seed=0, hidden_size=24, intermediate_size=8)\n"
        "p2 = make_inputs('moe_experts_backward', 3, seed=0, hidden_size=24, intermediate_size=8, num_experts=4,"
        " top_k=2)\n"
        "print(len(moe_lib.swiglu_down_backward(**p1)), len(moe_lib.moe_experts_backward(**p2)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "5"]
