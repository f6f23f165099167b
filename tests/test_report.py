"""The report runner: config planning and checks, a sweep over notebook 01, failures that do not stop the rest."""

import html
import json
from pathlib import Path

import pytest

from moe_lib import pagecheck, report

papermill = pytest.importorskip("papermill")
nbformat = pytest.importorskip("nbformat")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
P1 = "01_swiglu_backward_derivation"
KERNELSPEC = {"name": report.KERNEL_NAME, "display_name": "Python (moe-backward-lab)", "language": "python"}


@pytest.fixture(scope="module")
def kernel_name():
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    try:
        kernelspec.KernelSpecManager().get_kernel_spec(report.KERNEL_NAME)
    except kernelspec.NoSuchKernel:
        pytest.skip(f"Jupyter kernel {report.KERNEL_NAME!r} not installed (make setup installs it)")
    return report.KERNEL_NAME


def write_notebook(path: Path, parameters: str | None, body: str) -> Path:
    """A notebook with an optional cell tagged 'parameters' and one code cell."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = KERNELSPEC
    if parameters is not None:
        cell = nbformat.v4.new_code_cell(parameters)
        cell.metadata["tags"] = ["parameters"]
        notebook.cells.append(cell)
    notebook.cells.append(nbformat.v4.new_code_cell(body))
    nbformat.write(notebook, path)
    return path


@pytest.fixture
def toy_notebooks(tmp_path):
    """00 fails on purpose; 01 doubles its parameter into summary.json (both start in about a second)."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    output_dir = 'output_dir: str = "."  # outputs'
    write_notebook(folder / "00_fails.ipynb", output_dir, 'raise ValueError("deliberate failure 42")')
    write_summary = "\n".join(
        [
            "import json, pathlib",
            'pathlib.Path(output_dir, "summary.json").write_text(json.dumps({"doubled": 2 * value}))',
        ]
    )
    write_notebook(folder / "01_doubles.ipynb", f"value: int = 1  # what to double\n{output_dir}", write_summary)
    return folder


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ---------------------------------------------------------------- planning (no kernel)


def test_plan_merges_defaults_parameters_and_sweep(toy_notebooks, tmp_path):
    notebooks = report.find_notebooks(toy_notebooks)
    config = {"defaults": {"value": 5}, "notebooks": {1: {"sweep": {"value": [7, 8]}}}}  # unquoted YAML 01 is 1
    runs = report.plan_runs(config, notebooks, notebooks, tmp_path / "r")
    assert [run.name for run in runs] == ["00_fails", "01_doubles__value-7", "01_doubles__value-8"]
    assert "value" not in runs[0].parameters  # 00 does not define it: not passed
    assert [run.parameters["value"] for run in runs[1:]] == [7, 8]
    assert runs[2].swept == {"value": 8}
    assert runs[2].parameters["output_dir"] == str((tmp_path / "r" / "01_doubles__value-8").resolve())
    only = report.plan_runs({"defaults": {"value": 5}}, notebooks, report.select_notebooks(notebooks, "01"), tmp_path)
    assert [(run.name, run.parameters["value"]) for run in only] == [("01_doubles", 5)]


def test_the_repository_config_fits_the_notebooks(tmp_path):
    notebooks = report.find_notebooks(report.NOTEBOOKS_DIR)
    runs = report.plan_runs(report.load_config(ROOT / "report.yaml"), notebooks, notebooks, tmp_path)
    assert {run.notebook for run in runs} == set(notebooks)


BAD_CONFIGS = [
    pytest.param({"sweeps": {}}, None, r"unknown key.*sweeps", id="unknown-top-level-key"),
    pytest.param({"defaults": {"nonsense": 1}}, None, r"no notebook defines a parameter 'nonsense'", id="default"),
    pytest.param(
        {"notebooks": {"01": {"parameters": {"valu": 3}}}},
        None,
        r"notebook 01_doubles does not define a parameter 'valu'",
        id="parameter",
    ),
    pytest.param(
        {"notebooks": {"01_doubles": {"sweep": {"seed": [1, 2]}}}},
        None,
        r"notebook 01_doubles does not define a parameter 'seed'",
        id="sweep-parameter",
    ),
    pytest.param(
        {"notebooks": {"01": {"parameters": {"value": "three"}}}},
        None,
        r"01_doubles declares value: int.*'three'",
        id="type",
    ),
    pytest.param({"notebooks": {"01": {"sweep": {"value": 3}}}}, None, r"non-empty list", id="sweep-not-a-list"),
    pytest.param(
        {"notebooks": {"01": {"parameters": {"output_dir": "x"}}}}, None, r"'output_dir' is set by the", id="output_dir"
    ),
    pytest.param({"notebooks": {"01": {"params": {}}}}, None, r"notebooks.01: unknown key.*params", id="section-key"),
    pytest.param({"notebooks": {"09": {}}}, None, r"notebooks section '09': no such notebook", id="section-name"),
    pytest.param({}, "07", r"notebook filter '07': no such notebook \(available: 00_fails, 01_doubles\)", id="filter"),
]


@pytest.mark.parametrize("config, only, message", BAD_CONFIGS)
def test_bad_config_is_named_before_anything_runs(toy_notebooks, tmp_path, config, only, message):
    out = tmp_path / "out"
    with pytest.raises(report.ReportConfigError, match=message):
        report.run_report(
            write_config(tmp_path, config),
            notebooks=only,
            notebooks_dir=toy_notebooks,
            out_dir=out,
            run_id="r",
            progress=False,
        )
    assert not out.exists()


def test_notebook_without_parameters_cell_is_named(toy_notebooks, tmp_path):
    write_notebook(toy_notebooks / "02_bare.ipynb", None, "print(1)")
    with pytest.raises(report.ReportConfigError, match=r"02_bare.ipynb has no cell tagged 'parameters'"):
        report.run_report({}, notebooks_dir=toy_notebooks, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_names_a_missing_config_and_a_used_run_id(toy_notebooks, tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert report.main(["--config", str(missing), "--notebooks-dir", str(toy_notebooks)]) == 2
    assert f"error: config file not found: {missing}" in capsys.readouterr().err
    (tmp_path / "out" / "used").mkdir(parents=True)
    (tmp_path / "out" / "used" / "index.html").write_text("earlier report")
    args = [
        "--config",
        str(write_config(tmp_path, {})),
        "--notebooks-dir",
        str(toy_notebooks),
        "--out",
        str(tmp_path / "out"),
        "--run-id",
        "used",
    ]
    assert report.main(args) == 2
    assert "already exists" in capsys.readouterr().err


def test_environment_names_the_git_revision_and_the_versions(monkeypatch):
    def git(*command):
        return "abc1234" if command == ("rev-parse", "--short", "HEAD") else None

    monkeypatch.setattr(report.provenance, "git", git)
    monkeypatch.setattr(report.provenance, "git_dirty", lambda: True)
    monkeypatch.setattr(report.provenance, "package_version", lambda name: None if name == "triton" else "1.0")
    environment = report.environment()
    assert environment["git"] == "abc1234 (uncommitted changes)"
    assert environment["triton"] == "not installed" and environment["torch"] == environment["papermill"] == "1.0"
    monkeypatch.setattr(report.provenance, "git", lambda *command: None)
    assert report.environment()["git"] == "unknown"


def test_parameters_table_shows_the_values_the_run_used():
    defaults = "\n".join(
        [
            'gpu: str = "H100-SXM"  # the GPU | its key',
            "seed: int = 0  # seeds draws",
            'output_dir: str = "."  # outputs',
        ]
    )
    injected = '# Parameters\ngpu = "H200"\noutput_dir = "/tmp/abs/path"\n'
    table = report.parameters_markdown(defaults, injected)
    assert "| `gpu` | `'H200'` (default `'H100-SXM'`) | the GPU \\| its key |" in table
    assert "| `seed` | `0` | seeds draws |" in table
    assert "output_dir" not in table and "/tmp/abs/path" not in table
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(defaults),
            nbformat.v4.new_code_cell(injected),
            nbformat.v4.new_code_cell("print(1)"),
            nbformat.v4.new_code_cell("x"),
        ]
    )
    for cell, tags in zip(notebook.cells, (["parameters"], ["injected-parameters"], [], ["remove-cell"]), strict=True):
        cell.metadata["tags"] = tags
    page = report.page_notebook(notebook)
    assert [c.cell_type for c in page.cells] == ["markdown", "code"] and page.cells[1].source == "print(1)"
    assert len(notebook.cells) == 4  # the executed notebook itself keeps every cell


# ---------------------------------------------------------------- running


def test_sweep_over_notebook_01_writes_notebooks_html_and_index(kernel_name, tmp_path):
    tiny = dict(num_tokens=3, hidden_size=8, intermediate_size=5, bf16_num_tokens=2)
    config = {
        "defaults": {"seed": 0, "routing_num_tokens": 16},  # 01 does not define routing_num_tokens
        "notebooks": {"01": {"parameters": tiny, "sweep": {"seed": [3, 4]}}},
    }
    result = report.run_report(
        write_config(tmp_path, config),
        notebooks="01",
        out_dir=tmp_path / "reports",
        run_id="sweep",
        kernel_name=kernel_name,
        progress=False,
    )
    assert result.ok and result.folder == tmp_path / "reports" / "sweep"
    assert [run.name for run in result.runs] == [f"{P1}__seed-3", f"{P1}__seed-4"]
    index = result.index.read_text()
    for run, seed in zip(result.runs, (3, 4), strict=True):
        executed = nbformat.read(result.folder / f"{run.name}.ipynb", as_version=4)
        injected = next(c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", []))
        assert f"seed = {seed}" in injected.source and "routing_num_tokens" not in injected.source
        page = (result.folder / f"{run.name}.html").read_text()
        assert "data:image/png;base64," in page  # the figure is embedded
        assert 'src="mathjax/MathJax.js?config=' in page  # LaTeX rendered by the copy beside the page
        assert (result.folder / "mathjax" / "MathJax.js").is_file()
        assert "every hand-derived step is checked against autograd here" in page  # the code is shown
        # the parameters as a table, papermill's injected cell (with its absolute output_dir) and the
        # summary.json cell (tagged remove-cell) left out
        assert "Parameters of this page" in page and f"<code>{seed}</code> (default <code>0</code>)" in page
        assert run.parameters["output_dir"] not in page and "injected-parameters" not in page
        assert "steps checked, worst relative error" not in page
        assert "steps checked, worst relative error" in json.dumps(executed.cells[-1].outputs)  # still run
        summary = json.loads((result.folder / run.name / "summary.json").read_text())
        assert summary["seed"] == seed and summary["sizes"]["hidden_size"] == tiny["hidden_size"]
        assert (result.folder / run.name / "silu_and_gates.png").is_file()
        for target in (f"{run.name}.html", f"{run.name}.ipynb", f"{run.name}/summary.json"):
            assert f'href="{target}"' in index, target
    assert index.count('class="ok">ok<') == 2
    title, description = report.notebook_info(report.NOTEBOOKS_DIR / f"{P1}.ipynb")
    assert title.startswith("01 · ") and description  # the reading order: one line per notebook
    assert "<h2>Reading order</h2>" in index and title in index and html.escape(description) in index
    assert f'<a href="{P1}__seed-3.html">seed = 3</a>' in index
    if pagecheck.find_browser():  # every formula of both pages rendered, recorded beside them
        assert report.check_math(result)
        assert "formulas rendered" in result.index.read_text()
        assert all(not page["errors"] for page in json.loads((result.folder / "math_check.json").read_text())["pages"])
    manifest = json.loads((result.folder / "report.json").read_text())
    assert [run["status"] for run in manifest["runs"]] == ["ok", "ok"]
    assert yaml.safe_load((result.folder / "config.yaml").read_text()) == config


def test_failing_notebook_does_not_stop_the_others(kernel_name, toy_notebooks, tmp_path, capsys):
    config = write_config(tmp_path, {"notebooks": {"01": {"parameters": {"value": 21}}}})
    args = [
        "--config",
        str(config),
        "--notebooks-dir",
        str(toy_notebooks),
        "--out",
        str(tmp_path / "reports"),
        "--run-id",
        "mixed",
        "--kernel",
        kernel_name,
        "--no-progress",
    ]
    assert report.main(args) == 1
    printed = capsys.readouterr().out
    assert "failed: 00_fails (ValueError: deliberate failure 42)" in printed
    folder = tmp_path / "reports" / "mixed"
    manifest = json.loads((folder / "report.json").read_text())
    assert [(run["name"], run["status"]) for run in manifest["runs"]] == [("00_fails", "failed"), ("01_doubles", "ok")]
    assert manifest["runs"][0]["error"] == "ValueError: deliberate failure 42"
    assert json.loads((folder / "01_doubles" / "summary.json").read_text()) == {"doubled": 42}
    assert (folder / "00_fails.html").is_file()  # the failed notebook is kept, with its traceback
    index = (folder / "index.html").read_text()
    assert 'class="failed">failed<' in index and "ValueError: deliberate failure 42" in index
    assert 'href="01_doubles.html"' in index and 'href="00_fails.html"' in index


def test_run_report_returns_the_failures(kernel_name, toy_notebooks, tmp_path):
    result = report.run_report(
        {},
        notebooks="00",
        notebooks_dir=toy_notebooks,
        out_dir=tmp_path,
        run_id="r",
        kernel_name=kernel_name,
        progress=False,
    )
    assert not result.ok
    assert [(run.name, run.error) for run in result.failed] == [("00_fails", "ValueError: deliberate failure 42")]
