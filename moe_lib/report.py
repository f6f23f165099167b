"""Run the notebooks through papermill into one report folder: executed notebooks, HTML and an index.

    python -m moe_lib.report --config report.yaml [--notebooks 01,02] [--run-id ID] [--out reports]

The YAML config (``report.yaml`` documents it) has ``defaults`` — parameters given to every notebook whose
``parameters`` cell defines them — and ``notebooks``: sections keyed by notebook file stem or number prefix,
each with ``parameters`` and an optional ``sweep`` (one run per combination of the listed values). Every run
gets its own folder, passed to the notebook as the parameter ``output_dir``, for its ``summary.json`` and
figures. The whole plan is checked (config keys, notebook filter, parameters cells, parameter names and
types) before the first notebook runs; a failing notebook does not stop the others.

Report folder ``<out>/<run-id>/``: ``<run>.ipynb`` (executed), ``<run>.html`` (the page: cells tagged
``remove-cell`` left out, the parameters as a table), ``<run>/`` (output_dir), ``index.html`` (the reading
order, then every run), ``report.json`` (the same as data), ``config.yaml`` (the config as given) and
``mathjax/`` (MathJax 2 with our font configuration, so that the pages render offline). Where a Chromium
browser is installed, the command line then opens every page headless and checks that each formula
rendered (:mod:`moe_lib.pagecheck`; ``math_check.json``); a math error fails the command like a failed run.
"""

from __future__ import annotations

import argparse
import datetime
import html
import itertools
import json
import logging
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .bench import provenance

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
REPORTS_DIR = ROOT / "reports"
KERNEL_NAME = "moe-backward-lab"
RUNNER_PARAMETERS = ("output_dir",)  # set by the runner for every run, never by the config
CONFIG_KEYS = ("defaults", "notebooks")
SECTION_KEYS = ("parameters", "sweep")


class ReportConfigError(ValueError):
    """The config, the notebook filter or a notebook's parameters cell cannot make a report."""


@dataclass
class Run:
    """One execution of one notebook with one set of parameters."""

    notebook: Path
    name: str  # the stem of the run's files: "<notebook stem>[__<param>-<value>...]"
    parameters: dict  # what papermill injects (output_dir included)
    swept: dict = field(default_factory=dict)  # this run's values of the swept parameters
    status: str = "pending"  # "pending", "ok" or "failed"
    error: str = ""  # the error's last line when failed
    duration_s: float = 0.0

    def to_json(self) -> dict:
        return dict(
            name=self.name,
            notebook=self.notebook.name,
            parameters=self.parameters,
            swept=self.swept,
            status=self.status,
            error=self.error,
            duration_s=round(self.duration_s, 3),
            ipynb=f"{self.name}.ipynb",
            html=f"{self.name}.html",
            output_dir=f"{self.name}/",
        )


@dataclass
class Report:
    """What :func:`run_report` made: the folder and every run's outcome."""

    folder: Path
    runs: list[Run]
    run_id: str
    config_source: str = ""
    started: str = ""
    environment: dict = field(default_factory=dict)
    math_check: dict | None = None  # what check_math found, once it ran

    @property
    def failed(self) -> list[Run]:
        return [run for run in self.runs if run.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def index(self) -> Path:
        return self.folder / "index.html"


# ---------------------------------------------------------------- config and notebooks


def load_config(config) -> dict:
    """The config as a dict, from a YAML file path or an already parsed mapping."""
    if isinstance(config, dict):
        return config
    import yaml

    path = Path(config)
    if not path.is_file():
        raise ReportConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ReportConfigError(f"{path}: not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ReportConfigError(f"{path}: expected a mapping with keys {CONFIG_KEYS}, got {type(loaded).__name__}")
    return loaded


def find_notebooks(notebooks_dir) -> list[Path]:
    """The notebooks in ``notebooks_dir``, sorted by name (hidden files and checkpoints left out)."""
    folder = Path(notebooks_dir)
    if not folder.is_dir():
        raise ReportConfigError(f"notebooks folder not found: {folder}")
    notebooks = sorted(path for path in folder.glob("*.ipynb") if not path.name.startswith("."))
    if not notebooks:
        raise ReportConfigError(f"no notebooks (*.ipynb) in {folder}")
    return notebooks


def number_prefix(path: Path) -> str:
    """The stem up to its first underscore: "01" for "01_swiglu_backward_derivation.ipynb"."""
    return path.stem.split("_", 1)[0]


def matches(key, path: Path) -> bool:
    """Whether a config key or filter entry names this notebook (its stem or number prefix)."""
    key_text = str(key).strip().removesuffix(".ipynb")
    if key_text in (path.stem, number_prefix(path)):
        return True
    # YAML reads an unquoted 01 as the integer 1
    return isinstance(key, int) and number_prefix(path).isdigit() and int(number_prefix(path)) == key


def resolve_notebook(key, notebooks: list[Path], what: str) -> Path:
    """The one notebook that ``key`` names; a clear error when none or several do."""
    found = [path for path in notebooks if matches(key, path)]
    available = ", ".join(path.stem for path in notebooks)
    if not found:
        raise ReportConfigError(f"{what} {key!r}: no such notebook (available: {available})")
    if len(found) > 1:
        raise ReportConfigError(f"{what} {key!r} names several notebooks: {', '.join(p.stem for p in found)}")
    return found[0]


def select_notebooks(notebooks: list[Path], only) -> list[Path]:
    """The notebooks named by ``only`` ("01,02", a list of stems or prefixes, or None for all), in order."""
    if only is None:
        return notebooks
    keys = [key for key in (only.split(",") if isinstance(only, str) else only) if str(key).strip()]
    if not keys:
        raise ReportConfigError("notebook filter: empty (give stems or number prefixes, e.g. 01,02)")
    chosen = {resolve_notebook(key, notebooks, "notebook filter") for key in keys}
    return [path for path in notebooks if path in chosen]


def parameters_cell_count(path: Path) -> int:
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    return sum("parameters" in cell.metadata.get("tags", []) for cell in notebook.cells)


def notebook_parameters(path: Path) -> dict:
    """{name: type name} of the notebook's ``parameters`` cell; an error if it has none or several."""
    import papermill

    count = parameters_cell_count(path)
    if count != 1:
        problem = "has no cell tagged 'parameters'" if count == 0 else f"has {count} cells tagged 'parameters'"
        raise ReportConfigError(f"notebook {path.name} {problem} (papermill needs exactly one)")
    return {name: spec["inferred_type_name"] for name, spec in papermill.inspect_notebook(str(path)).items()}


_TYPE_CHECKS = {
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "float": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    "str": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
    "list": lambda value: isinstance(value, list),
    "dict": lambda value: isinstance(value, dict),
}


def check_parameter(notebook: Path, declared: dict, name: str, value, where: str) -> None:
    """The parameter must be defined by the notebook and, where its annotation is a plain type, fit it."""
    if name in RUNNER_PARAMETERS:
        raise ReportConfigError(f"{where}: {name!r} is set by the report runner for every run; remove it")
    if name not in declared:
        raise ReportConfigError(
            f"{where}: notebook {notebook.stem} does not define a parameter {name!r} "
            f"(its parameters: {', '.join(declared) or 'none'})"
        )
    type_name = re.match(r"\w*", declared[name]).group().lower()
    check = _TYPE_CHECKS.get(type_name)
    if check is not None and not check(value):
        raise ReportConfigError(
            f"{where}: notebook {notebook.stem} declares {name}: {declared[name]}, "
            f"the config gives {value!r} ({type(value).__name__})"
        )


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ReportConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _slug(value) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", str(value)).strip("_") or "_"


def plan_runs(config: dict, notebooks: list[Path], selected: list[Path], folder: Path) -> list[Run]:
    """Every run the config asks for among ``selected``, after checking the whole config against ``notebooks``."""
    unknown = sorted(set(config) - set(CONFIG_KEYS), key=str)
    if unknown:
        raise ReportConfigError(f"config: unknown key(s) {unknown} (expected {', '.join(CONFIG_KEYS)})")
    defaults = _mapping(config.get("defaults"), "defaults")
    sections = _mapping(config.get("notebooks"), "notebooks")

    declared = {path: notebook_parameters(path) for path in selected}
    for path in notebooks:  # the others only to know which defaults some notebook uses
        if path not in declared and parameters_cell_count(path) == 1:
            declared[path] = notebook_parameters(path)
    for name in defaults:
        if name in RUNNER_PARAMETERS:
            raise ReportConfigError(f"defaults: {name!r} is set by the report runner for every run; remove it")
        if not any(name in parameters for parameters in declared.values()):
            raise ReportConfigError(f"defaults: no notebook defines a parameter {name!r}")

    section_of = {}
    for key, section in sections.items():
        path = resolve_notebook(key, notebooks, "notebooks section")
        if path in section_of:
            raise ReportConfigError(f"notebooks: {section_of[path][0]!r} and {key!r} both name {path.stem}")
        section_of[path] = (key, _mapping(section, f"notebooks.{key}"))

    runs = []
    for path in selected:
        key, section = section_of.get(path, (path.stem, {}))
        where = f"notebooks.{key}"
        unknown = sorted(set(section) - set(SECTION_KEYS), key=str)
        if unknown:
            raise ReportConfigError(f"{where}: unknown key(s) {unknown} (expected {', '.join(SECTION_KEYS)})")
        parameters = {name: value for name, value in defaults.items() if name in declared[path]}
        for name, value in defaults.items():
            if name in declared[path]:
                check_parameter(path, declared[path], name, value, "defaults")
        for name, value in _mapping(section.get("parameters"), f"{where}.parameters").items():
            check_parameter(path, declared[path], name, value, f"{where}.parameters")
            parameters[name] = value
        sweep = _mapping(section.get("sweep"), f"{where}.sweep")
        for name, values in sweep.items():
            if not isinstance(values, list) or not values:
                raise ReportConfigError(f"{where}.sweep.{name}: expected a non-empty list of values, got {values!r}")
            for value in values:
                check_parameter(path, declared[path], name, value, f"{where}.sweep")
        for combination in itertools.product(*sweep.values()):
            swept = dict(zip(sweep, combination, strict=True))
            name = path.stem + "".join(f"__{_slug(param)}-{_slug(value)}" for param, value in swept.items())
            run_parameters = {**parameters, **swept}
            if "output_dir" in declared[path]:
                run_parameters["output_dir"] = str((folder / name).resolve())
            runs.append(Run(notebook=path, name=name, parameters=run_parameters, swept=swept))

    names = [run.name for run in runs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ReportConfigError(f"sweep values give the same run name twice: {duplicates}")
    return runs


def check_kernel(kernel_name: str) -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel as error:
        raise ReportConfigError(
            f"Jupyter kernel {kernel_name!r} is not installed: run `make setup`, or "
            f"`.venv/bin/python -m ipykernel install --sys-prefix --name {kernel_name}`"
        ) from error


# ---------------------------------------------------------------- running


def last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def execute_run(run: Run, folder: Path, kernel_name: str) -> None:
    """Execute one run's notebook into ``folder`` and write its HTML; record status, error and duration."""
    import papermill

    (folder / run.name).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(run.notebook),
            str(folder / f"{run.name}.ipynb"),
            parameters=run.parameters,
            kernel_name=kernel_name,
            progress_bar=False,
            log_output=False,
            cwd=str(run.notebook.parent),
            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # keep the kernel's start-up warnings off the console
        )
        run.status, run.error = "ok", ""
    except papermill.PapermillExecutionError as error:
        run.status, run.error = "failed", last_line(f"{error.ename}: {error.evalue}")
    except Exception as error:  # the kernel died, could not start, or the notebook could not be read
        run.status, run.error = "failed", last_line(f"{type(error).__name__}: {error}")
    run.duration_s = time.perf_counter() - start
    executed = folder / f"{run.name}.ipynb"
    if executed.is_file():
        try:
            write_html(executed, folder / f"{run.name}.html", title=run.name)
        except Exception as error:
            run.status, run.error = "failed", last_line(f"HTML export: {type(error).__name__}: {error}")


MATHJAX_FOLDER = "mathjax"  # in each report folder, beside the HTML pages
# the combined TeX + HTML-CSS configuration, the Safe extension, and ours (MATHJAX_LOCAL_CONFIG)
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe,local/report"
# jupyter-server-mathjax ships MathJax 2 with the STIX-Web fonts only; left to its defaults HTML-CSS looks for
# the TeX fonts, and some constructs (a prime, as in silu'(z)) end in "Math Processing Error"
MATHJAX_LOCAL_CONFIG = """MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null},
  SVG: {font: "STIX-Web"}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/report.js");
"""
HIDDEN_CELL_TAG = "remove-cell"  # cells that serve the report (summary.json), kept in the notebook, not on its page


def copy_mathjax(folder: Path) -> bool:
    """Copies MathJax (from the jupyter-server-mathjax package) into the report folder, with our
    configuration, so that the pages' LaTeX renders offline too. Returns False when the package is
    missing (pages then load MathJax from nbconvert's default CDN)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        return False
    target = folder / MATHJAX_FOLDER
    shutil.copytree(Path(jupyter_server_mathjax.__file__).parent / "static", target, dirs_exist_ok=True)
    (target / "config" / "local").mkdir(parents=True, exist_ok=True)
    (target / "config" / "local" / "report.js").write_text(MATHJAX_LOCAL_CONFIG)
    return True


def _assignments(source: str) -> dict:
    """{name: value} of the literal assignments in a parameters cell (others are skipped)."""
    import ast

    values = {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        elif isinstance(statement, ast.Assign):
            targets = statement.targets
        else:
            continue
        try:
            value = ast.literal_eval(statement.value)
        except ValueError:
            value = ast.unparse(statement.value)
        values.update({target.id: value for target in targets if isinstance(target, ast.Name)})
    return values


def _comments(source: str) -> dict:
    """{name: the comment on its line} in a parameters cell."""
    found = {}
    for line in source.splitlines():
        match = re.match(r"\s*(\w+)\s*(?::[^=]*)?=.*?#\s*(.*)$", line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


def parameters_markdown(defaults_source: str, injected_source: str = "") -> str:
    """The run's parameters as a markdown table: name, value (with the default where the run set another)
    and the comment of the parameters cell. ``output_dir`` (set by the runner for every run) is left out."""
    defaults, given, comments = _assignments(defaults_source), _assignments(injected_source), _comments(defaults_source)
    rows = ["| parameter | value | what it is |", "|---|---|---|"]
    for name, default in defaults.items():
        if name in RUNNER_PARAMETERS:
            continue
        value = given.get(name, default)
        shown = f"`{value!r}`" + (f" (default `{default!r}`)" if name in given and value != default else "")
        comment = comments.get(name, "").replace("|", r"\|")
        rows.append(f"| `{name}` | {shown} | {comment} |")
    return "**Parameters of this page**\n\n" + "\n".join(rows)


def page_notebook(notebook):
    """The notebook as its HTML page shows it: the cells tagged ``remove-cell`` left out, and the parameters
    cell with papermill's injected one replaced by a table of the values the run used."""
    import nbformat

    page = nbformat.from_dict(notebook)
    tagged = {
        tag: [c for c in page.cells if tag in c.metadata.get("tags", [])]
        for tag in ("parameters", "injected-parameters")
    }
    if tagged["parameters"]:
        injected = tagged["injected-parameters"][0].source if tagged["injected-parameters"] else ""
        table = nbformat.v4.new_markdown_cell(parameters_markdown(tagged["parameters"][0].source, injected))
        page.cells[page.cells.index(tagged["parameters"][0])] = table
    hidden = ("injected-parameters", HIDDEN_CELL_TAG)
    page.cells = [c for c in page.cells if not set(c.metadata.get("tags", [])) & set(hidden)]
    return page


def write_html(ipynb: Path, html_path: Path, title: str) -> None:
    """A self-contained HTML of an executed notebook (as :func:`page_notebook` shows it): code shown,
    figures embedded as data URIs, LaTeX rendered by the MathJax copy beside it when the report folder has one."""
    import nbconvert
    import nbformat

    quiet = logging.getLogger(f"{__name__}.nbconvert")
    quiet.setLevel(logging.ERROR)  # its per-image warning about missing alt text is noise here
    options = {}
    if (html_path.parent / MATHJAX_FOLDER / "MathJax.js").is_file():
        options["mathjax_url"] = f"{MATHJAX_FOLDER}/MathJax.js?config={MATHJAX_CONFIG}"
    exporter = nbconvert.HTMLExporter(template_name="lab", embed_images=True, log=quiet, **options)
    page = page_notebook(nbformat.read(ipynb, as_version=4))
    body, _ = exporter.from_notebook_node(page, resources={"metadata": {"name": title}})
    html_path.write_text(body, encoding="utf-8")


def git_revision() -> str:
    """The short commit of the checkout, with "(uncommitted changes)" when the tree is dirty; "unknown" without git."""
    commit = provenance.git("rev-parse", "--short", "HEAD")
    if commit is None:
        return "unknown"
    return f"{commit} (uncommitted changes)" if provenance.git_dirty() else commit


def environment() -> dict:
    """What the report ran with: Python, platform, git revision and the versions of the packages that matter."""
    packages = ("torch", "triton", "papermill", "nbconvert")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git_revision(),
        **{package: provenance.package_version(package) or "not installed" for package in packages},
    }


# ---------------------------------------------------------------- index and summary

_INDEX_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 72rem;
       padding: 0 1rem; color: #1f2328; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
.meta { color: #57606a; margin: 0.2rem 0 1.2rem; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 0.45rem 0.6rem; border-bottom: 1px solid #d0d7de; vertical-align: top; }
th { background: #f6f8fa; }
td.files { white-space: nowrap; }
code { font-size: 0.85rem; }
.params code { display: inline-block; margin: 0 0.4rem 0.2rem 0; background: #f6f8fa; padding: 0 0.25rem; }
.params code.swept { background: #ddf4ff; font-weight: 600; }
.ok { color: #1a7f37; font-weight: 600; }
.failed { color: #cf222e; font-weight: 600; }
.pending { color: #9a6700; }
.error { color: #cf222e; font-family: monospace; font-size: 0.85rem; }
.env td, .env th { border: none; padding: 0.1rem 0.6rem 0.1rem 0; font-size: 0.85rem; }
ol.reading li { margin: 0 0 0.7rem; }
ol.reading .what { color: #57606a; }
.math-ok { color: #1a7f37; }
.math-failed { color: #cf222e; font-weight: 600; }
"""


def _parameters_html(run: Run) -> str:
    shown = {name: value for name, value in run.parameters.items() if name not in RUNNER_PARAMETERS}
    if not shown:
        return "<em>defaults</em>"
    return "".join(
        f'<code class="{"swept" if name in run.swept else ""}">{html.escape(f"{name}={value!r}")}</code>'
        for name, value in shown.items()
    )


def notebook_info(path: Path) -> tuple[str, str]:
    """(title, one line) of a notebook: its first heading, and its metadata's ``description`` (else the
    first sentence after the heading)."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    first = next((cell.source for cell in notebook.cells if cell.cell_type == "markdown"), "")
    lines = first.splitlines()
    title = next((line.lstrip("#").strip() for line in lines if line.startswith("# ")), path.stem)
    description = notebook.metadata.get("description", "")
    if not description:
        text = " ".join(line.strip() for line in lines if line.strip() and not line.startswith("#"))
        description = re.split(r"(?<=[.:])\s", text, maxsplit=1)[0]
    return title, description


def _reading_order_html(report: Report) -> str:
    """One item per notebook, in order: its title (linked to its first page), its one line, and its pages
    when a sweep made several."""
    items = []
    for notebook in dict.fromkeys(run.notebook for run in report.runs):
        runs = [run for run in report.runs if run.notebook == notebook]
        title, description = notebook_info(notebook)
        heading = f"<strong>{html.escape(title)}</strong>"
        if (report.folder / f"{runs[0].name}.html").exists():
            heading = f'<a href="{html.escape(runs[0].name)}.html">{heading}</a>'
        pages = ""
        if len(runs) > 1:
            links = [
                f'<a href="{html.escape(run.name)}.html">'
                f"{html.escape(', '.join(f'{k} = {v}' for k, v in run.swept.items()))}</a>"
                for run in runs
            ]
            pages = f"<br>pages: {' · '.join(links)}"
        failed = [run.name for run in runs if run.status == "failed"]
        status = f' <span class="failed">failed: {html.escape(", ".join(failed))}</span>' if failed else ""
        items.append(f'<li>{heading}{status}<br><span class="what">{html.escape(description)}</span>{pages}</li>')
    return f'<ol class="reading">\n{chr(10).join(items)}\n</ol>'


def _math_html(math_check: dict | None) -> str:
    if not math_check:
        return ""
    if math_check.get("skipped"):
        return f" · math not checked ({html.escape(math_check['skipped'])})"
    failed = [page for page in math_check["pages"] if page["errors"]]
    formulas = sum(page["formulas"] for page in math_check["pages"])
    if failed:
        return (
            f' · <span class="math-failed">math errors on {len(failed)} pages</span> '
            f'(<a href="math_check.json">math_check.json</a>)'
        )
    return f' · <span class="math-ok">{formulas} formulas rendered</span> in {html.escape(math_check["browser"])}'


def index_html(report: Report, environment_info: dict) -> str:
    rows = []
    for number, run in enumerate(report.runs, 1):
        status = f'<span class="{run.status}">{run.status}</span>'
        if run.error:
            status += f'<div class="error">{html.escape(run.error)}</div>'
        links = []
        for label, target in (
            ("HTML", f"{run.name}.html"),
            ("notebook", f"{run.name}.ipynb"),
            ("outputs", f"{run.name}/"),
            ("summary.json", f"{run.name}/summary.json"),
        ):
            if (report.folder / target).exists():
                links.append(f'<a href="{html.escape(target)}">{label}</a>')
        duration = f"{run.duration_s:.1f} s" if run.status != "pending" else ""
        rows.append(
            f"<tr><td>{number}</td><td><strong>{html.escape(run.name)}</strong><br>"
            f"<code>{html.escape(run.notebook.name)}</code></td>"
            f'<td class="params">{_parameters_html(run)}</td><td>{status}</td><td>{duration}</td>'
            f'<td class="files">{" · ".join(links)}</td></tr>'
        )
    counts = {status: sum(run.status == status for run in report.runs) for status in ("ok", "failed", "pending")}
    tally = ", ".join(f"{count} {status}" for status, count in counts.items() if count)
    env_rows = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(str(value))}</td></tr>"
        for key, value in environment_info.items()
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Report {html.escape(report.run_id)}</title>
<style>{_INDEX_STYLE}</style></head>
<body>
<h1>moe-backward-lab report {html.escape(report.run_id)}</h1>
<p class="meta">Started {html.escape(report.started)}
 · config <a href="config.yaml">{html.escape(report.config_source)}</a>
 · {len(report.runs)} runs: {tally} · <a href="report.json">report.json</a>{_math_html(report.math_check)}</p>
<h2>Reading order</h2>
{_reading_order_html(report)}
<h2>Runs</h2>
<table>
<thead><tr><th>#</th><th>run</th><th>parameters</th><th>status</th><th>time</th><th>files</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Environment</h2>
<table class="env">{env_rows}</table>
</body></html>
"""


def write_index(report: Report) -> None:
    report.index.write_text(index_html(report, report.environment), encoding="utf-8")
    manifest = dict(
        run_id=report.run_id,
        started=report.started,
        config=report.config_source,
        environment=report.environment,
        runs=[run.to_json() for run in report.runs],
        math_check=report.math_check,
    )
    (report.folder / "report.json").write_text(json.dumps(manifest, indent=2, default=str))


def check_math(report: Report, browser: str | None = None) -> bool:
    """Opens every page of the report in headless Chromium (:mod:`moe_lib.pagecheck`) and records what its
    math came to in ``math_check.json``, ``report.json`` and the index. False when a formula failed; True
    when all rendered, or when no browser is installed (the check is then recorded as skipped)."""
    from . import pagecheck

    browser = browser or pagecheck.find_browser()
    if browser is None:
        report.math_check = {"skipped": "no browser found"}
        write_index(report)
        return True
    pages = [page for run in report.runs if (page := report.folder / f"{run.name}.html").is_file()]
    results = pagecheck.check_pages(pages, browser)
    report.math_check = {"browser": pagecheck.browser_version(browser), "pages": [r.to_json() for r in results]}
    (report.folder / "math_check.json").write_text(json.dumps(report.math_check, indent=2))
    write_index(report)
    print(pagecheck.summary(results, report.math_check["browser"]))
    return all(r.ok for r in results)


def summary_table(report: Report) -> str:
    width = max([len(run.name) for run in report.runs] + [3])
    lines = [f"{'run':<{width}}  {'status':<7} {'time':>8}  error", "-" * (width + 26)]
    for run in report.runs:
        lines.append(f"{run.name:<{width}}  {run.status:<7} {run.duration_s:>6.1f} s  {run.error}")
    ok = sum(run.status == "ok" for run in report.runs)
    lines.append(f"{len(report.runs)} runs: {ok} ok, {len(report.failed)} failed")
    if report.failed:
        lines.append("failed: " + "; ".join(f"{run.name} ({run.error})" for run in report.failed))
    lines.append(f"index: {report.index}")
    return "\n".join(lines)


# ---------------------------------------------------------------- entry points


def default_run_id() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")


def run_report(
    config,
    *,
    notebooks=None,
    notebooks_dir=NOTEBOOKS_DIR,
    out_dir=REPORTS_DIR,
    run_id=None,
    kernel_name: str = KERNEL_NAME,
    progress: bool = True,
) -> Report:
    """Run the notebooks (all in ``notebooks_dir``, or those ``notebooks`` names) as ``config`` says.

    ``config``: a YAML file path or a parsed mapping. Raises :class:`ReportConfigError` before running
    anything when the config, the filter or a notebook's parameters cell is unusable. Returns the
    :class:`Report`; failed runs are in ``report.failed`` (they do not stop the others).
    """
    import yaml
    from tqdm.auto import tqdm

    config_source = "(given as a mapping)" if isinstance(config, dict) else str(config)
    config_text = Path(config).read_text() if not isinstance(config, dict) and Path(config).is_file() else None
    config = load_config(config)
    all_notebooks = find_notebooks(notebooks_dir)
    selected = select_notebooks(all_notebooks, notebooks)
    run_id = run_id or default_run_id()
    if not re.fullmatch(r"[A-Za-z0-9._-]+", run_id):
        raise ReportConfigError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-' only")
    folder = Path(out_dir) / run_id
    if folder.exists() and any(folder.iterdir()):
        raise ReportConfigError(f"{folder} already exists and is not empty: choose another --run-id")
    runs = plan_runs(config, all_notebooks, selected, folder)
    check_kernel(kernel_name)

    folder.mkdir(parents=True, exist_ok=True)
    copy_mathjax(folder)
    (folder / "config.yaml").write_text(config_text if config_text is not None else yaml.safe_dump(config))
    report = Report(
        folder=folder,
        runs=runs,
        run_id=run_id,
        config_source=config_source,
        started=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    report.environment = environment()
    write_index(report)
    with tqdm(runs, desc="notebooks", unit="run", disable=not progress, file=sys.stderr) as bar:
        for run in bar:
            bar.set_postfix_str(run.name)
            execute_run(run, folder, kernel_name)
            write_index(report)
            tqdm.write(
                f"{run.status:<6} {run.name} ({run.duration_s:.1f} s){'  ' + run.error if run.error else ''}",
                file=sys.stderr,
            )
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lib.report",
        description="Run the notebooks through papermill into reports/<run-id>/ (executed .ipynb, HTML, index.html).",
    )
    parser.add_argument("--config", required=True, help="YAML file with defaults and per-notebook parameters/sweeps")
    parser.add_argument("--notebooks", help="comma-separated stems or number prefixes to run (default: all)")
    parser.add_argument("--run-id", help="the report folder's name (default: YYYY-MM-DD-HHMMSS)")
    parser.add_argument("--out", default=str(REPORTS_DIR), help="folder that holds the report folders")
    parser.add_argument("--notebooks-dir", default=str(NOTEBOOKS_DIR), help="folder of the notebooks")
    parser.add_argument("--kernel", default=KERNEL_NAME, help="Jupyter kernel to run the notebooks with")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-math-check",
        action="store_true",
        help="skip the check of the pages' math in headless Chromium (python -m moe_lib.pagecheck)",
    )
    args = parser.parse_args(argv)
    try:
        report = run_report(
            args.config,
            notebooks=args.notebooks,
            notebooks_dir=args.notebooks_dir,
            out_dir=args.out,
            run_id=args.run_id,
            kernel_name=args.kernel,
            progress=not args.no_progress,
        )
    except ReportConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary_table(report))
    math_ok = True if args.no_math_check else check_math(report)
    if report.math_check and report.math_check.get("skipped"):
        print(f"math check skipped: {report.math_check['skipped']} (install chromium to check the pages' math)")
    return 0 if report.ok and math_ok else 1


if __name__ == "__main__":
    sys.exit(main())
