"""The report's math: the constructs the notebooks use, checked on the CPU against the MathJax copy the report
ships; and, where a Chromium browser is installed, every formula of the notebooks rendered by it."""

import re
from pathlib import Path

import pytest

from moe_lib import pagecheck, report

nbformat = pytest.importorskip("nbformat")
mathjax = pytest.importorskip("jupyter_server_mathjax")
pytest.importorskip("bs4")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MATHJAX = Path(mathjax.__file__).parent / "static"
DISPLAY, INLINE = re.compile(r"\$\$(.+?)\$\$", re.DOTALL), re.compile(r"(?<![\\$])\$([^$]+?)\$")
CODE_SPAN = re.compile(r"`[^`]*`")


def markdown_sources() -> dict[str, str]:
    """{notebook stem · cell number: source} of every markdown cell of the notebooks."""
    sources = {}
    for path in NOTEBOOKS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "markdown":
                sources[f"{path.stem} · cell {i}"] = cell.source
    return sources


def formulas(source: str) -> list[str]:
    text = CODE_SPAN.sub("", source)
    display = DISPLAY.findall(text)
    return display + INLINE.findall(DISPLAY.sub("", text))


def known_macros() -> set[str]:
    """The macros the shipped MathJax 2 TeX input defines: its macro tables (core and extensions) list each as
    a key, ``name:`` or ``"name":``, and its delimiters as ``"\\name":``."""
    sources = [MATHJAX / "jax" / "input" / "TeX" / "jax.js", *(MATHJAX / "extensions" / "TeX").glob("*.js")]
    text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in sources)
    return set(re.findall(r'[{,]"?([A-Za-z]+)"?:', text)) | set(re.findall(r'"\\\\([A-Za-z]+)":', text))


def test_every_formula_uses_only_macros_and_environments_mathjax_knows():
    known = known_macros()
    assert {"operatorname", "mathbb", "xrightarrow", "bigl", "tfrac", "aligned", "bmatrix"} <= known
    unknown = {}
    for where, source in markdown_sources().items():
        for formula in formulas(source):
            names = set(re.findall(r"\\([A-Za-z]+)", formula)) | set(re.findall(r"\\begin\{(\w+)\}", formula))
            if missing := names - known:
                unknown[where] = sorted(missing)
    assert not unknown, unknown


def test_math_delimiters_pair_up():
    for where, source in markdown_sources().items():
        text = CODE_SPAN.sub("", DISPLAY.sub("", CODE_SPAN.sub("", source)))
        assert len(re.findall(r"(?<!\\)\$", text)) % 2 == 0, where
        assert source.count("\\begin{") == source.count("\\end{"), where


def test_the_notebooks_use_the_constructs_the_font_fix_is_for():
    """Primes (silu'(z)) failed with MathJax's default fonts: the report's copy must select the fonts it ships."""
    assert any("'" in f for source in markdown_sources().values() for f in formulas(source))
    assert [p.name for p in (MATHJAX / "fonts" / "HTML-CSS").iterdir()] == ["STIX-Web"]


def test_the_report_configures_the_fonts_mathjax_ships(tmp_path):
    assert report.copy_mathjax(tmp_path)
    config = (tmp_path / report.MATHJAX_FOLDER / "config" / "local" / "report.js").read_text()
    assert 'webFont: "STIX-Web"' in config and "availableFonts: []" in config and "imageFont: null" in config
    assert 'loadComplete("[MathJax]/config/local/report.js")' in config
    assert report.MATHJAX_CONFIG.split(",")[-1] == "local/report"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("$\\sigma'(z)$")])
    nbformat.write(notebook, tmp_path / "page.ipynb")
    report.write_html(tmp_path / "page.ipynb", tmp_path / "page.html", title="page")
    assert f'src="mathjax/MathJax.js?config={report.MATHJAX_CONFIG}"' in (tmp_path / "page.html").read_text()


# ---------------------------------------------------------------- reading a rendered DOM (no browser)

FRAME = '<span class="MathJax" id="MathJax-Element-{n}-Frame" data-mathml=\'{mathml}\'>{text}</span>'
SCRIPT = '<script type="math/tex" id="MathJax-Element-{n}">{tex}</script>'


def dom(*formulas_and_frames, text: str = "") -> str:
    parts = []
    for n, (tex, frame) in enumerate(formulas_and_frames, 1):
        if frame is not None:
            parts.append(FRAME.format(n=n, mathml=frame.get("mathml", "<math></math>"), text=frame.get("text", "x")))
        parts.append(SCRIPT.format(n=n, tex=tex))
    return f"<html><body><p>{text}</p>{''.join(parts)}</body></html>"


def test_math_problems_reads_each_failure():
    count, problems = pagecheck.math_problems(
        dom(
            ("x^2", {}),
            ("\\sigma'(z)", {"text": "[Math Processing Error]"}),
            ("\\frac{a", {"text": '<span class="noError">\\frac{a</span>'}),
            ("\\nosuch x", {"mathml": '<math><mtext mathcolor="red">\\nosuch</mtext></math>'}),
            ("y", None),
        )
    )
    assert count == 5
    assert problems == [
        "formula 2 `\\sigma'(z)`: Math Processing Error",
        "formula 3 `\\frac{a`: TeX does not parse",
        "formula 4 `\\nosuch x`: unknown macro \\nosuch",
        "formula 5 `y`: not rendered",
    ]
    assert pagecheck.math_problems(dom(("x", {}))) == (1, [])
    count, problems = pagecheck.math_problems(dom(text="raw $\\alpha + 1$ left <code>$\\beta$ in code</code>"))
    assert count == 0 and problems == ["TeX left unrendered in the text (did MathJax run?): `$\\alpha + 1$`"]


def _executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_finds_the_headless_shell_on_the_path_and_in_playwrights_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_BROWSER", raising=False)
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path / "playwright"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert pagecheck.find_browser() is None
    shell = _executable(tmp_path / "playwright" / "chromium_headless_shell-1187" / "chrome-linux" / "headless_shell")
    _executable(tmp_path / "playwright" / "chromium_headless_shell-1169" / "chrome-linux" / "headless_shell")
    assert pagecheck.find_browser() == shell  # the newest build
    on_path = _executable(tmp_path / "bin" / "chromium-headless-shell")
    assert pagecheck.find_browser() == on_path  # the PATH first


def test_cli_without_a_browser_skips(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path / "none"))
    monkeypatch.delenv("MOE_BROWSER", raising=False)
    assert pagecheck.find_browser() is None
    assert pagecheck.main([str(tmp_path)]) == 0
    assert "math check skipped" in capsys.readouterr().out


# ---------------------------------------------------------------- in a real browser

needs_browser = pytest.mark.skipif(pagecheck.find_browser() is None, reason="no Chromium browser installed")


def _page(folder: Path, cells, name="page") -> Path:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": report.KERNEL_NAME, "display_name": "Python", "language": "python"}
    nbformat.write(notebook, folder / f"{name}.ipynb")
    report.write_html(folder / f"{name}.ipynb", folder / f"{name}.html", title=name)
    return folder / f"{name}.html"


@needs_browser
def test_every_formula_of_the_notebooks_renders_in_chromium(tmp_path):
    report.copy_mathjax(tmp_path)
    sources = list(markdown_sources().values()) + [(ROOT / "docs" / "methodology.md").read_text()]
    result = pagecheck.check_page(_page(tmp_path, sources), pagecheck.find_browser())
    assert result.ok, result.errors
    assert result.formulas == sum(len(formulas(source)) for source in sources) > 300


@needs_browser
def test_the_check_catches_what_mathjax_could_not_render(tmp_path, monkeypatch):
    report.copy_mathjax(tmp_path)
    monkeypatch.setattr(report, "MATHJAX_CONFIG", "TeX-AMS-MML_HTMLorMML-full,Safe")  # without the font fix
    result = pagecheck.check_page(_page(tmp_path, ["$\\sigma'(z) = 1$ and $x^2$"]), pagecheck.find_browser())
    assert result.formulas == 2 and result.errors == ["formula 1 `\\sigma'(z) = 1`: Math Processing Error"]
