"""Open report pages in headless Chromium and check that MathJax rendered every formula.

    python -m moe_lib.pagecheck reports/<run-id>        (or one or more .html pages)

Each page is loaded from disk by the browser, its scripts run (MathJax included) and the resulting DOM is
read back. A formula fails when MathJax could not lay it out ("[Math Processing Error]"), when its TeX does
not parse, or when it uses a macro MathJax does not know (drawn in red); a page fails when TeX is left
unrendered in its text (MathJax did not run) or the browser could not load it. Exit status: 0 when every
formula rendered (or when no browser is installed: the check is skipped, and says so), 1 otherwise.

The browser: ``$MOE_BROWSER`` when set, else the first of :data:`BROWSERS` on the PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BROWSERS = (
    "chromium",
    "chromium-browser",
    "chromium-headless-shell",
    "headless_shell",
    "google-chrome",
    "google-chrome-stable",
    "chrome",
)
# where Playwright keeps the browsers it downloads (PLAYWRIGHT_BROWSERS_PATH, else its cache): the headless shell first
PLAYWRIGHT_BUILDS = ("chromium_headless_shell-*/chrome-*/headless_shell", "chromium-*/chrome-*/chrome")
# headless, and safe as root and in containers: no sandbox, no GPU, nothing fetched in the background
BROWSER_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
VIRTUAL_TIME_MS = 30_000  # the page's own clock: time for MathJax to load its files and typeset
LEFTOVER_TEX = re.compile(r"\$\$|\\begin\{|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$")  # TeX that MathJax should have consumed
SKIPPED_TAGS = ("script", "style", "pre", "code", "textarea")  # text MathJax leaves alone, as it should


@dataclass
class PageMath:
    """What one page's math came to in the browser."""

    page: Path
    formulas: int = 0  # formulas MathJax found
    errors: list[str] = field(default_factory=list)  # one line per failed formula or page-level problem

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        return dict(page=self.page.name, formulas=self.formulas, errors=self.errors)


def find_browser() -> str | None:
    """The Chromium-family browser to use, or None when none is installed."""
    chosen = os.environ.get("MOE_BROWSER")
    if chosen:
        return shutil.which(chosen) or (chosen if Path(chosen).is_file() else None)
    on_path = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if on_path:
        return on_path
    cache = Path(os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or Path.home() / ".cache" / "ms-playwright")
    builds = (path for pattern in PLAYWRIGHT_BUILDS for path in sorted(cache.glob(pattern), reverse=True))
    return next((str(path) for path in builds if os.access(path, os.X_OK)), None)


def browser_version(browser: str) -> str:
    try:
        out = subprocess.run([browser, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def rendered_dom(page: Path, browser: str, timeout_s: float = 120) -> str:
    """The page's DOM after its scripts ran, from a fresh browser profile."""
    with tempfile.TemporaryDirectory(prefix="moe-pagecheck-") as profile:
        command = [
            browser,
            *BROWSER_FLAGS,
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            "--dump-dom",
            page.resolve().as_uri(),
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0 or "<body" not in out.stdout:
        raise RuntimeError(f"{browser} could not load {page.name} (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return out.stdout


def _short(tex: str, width: int = 70) -> str:
    tex = " ".join(tex.split())
    return tex if len(tex) <= width else tex[: width - 1] + "…"


def math_problems(dom: str) -> tuple[int, list[str]]:
    """(formulas found, one line per problem) in a DOM that MathJax 2 has processed."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(dom, "html.parser")
    scripts = soup.find_all("script", type=lambda kind: bool(kind) and kind.startswith("math/tex"))
    problems = []
    for number, script in enumerate(scripts, 1):
        tex = script.string or ""
        frame = soup.find(id=f"{script.get('id')}-Frame") if script.get("id") else None
        if frame is None:
            problems.append(f"formula {number} `{_short(tex)}`: not rendered")
        elif "Math Processing Error" in frame.get_text():
            problems.append(f"formula {number} `{_short(tex)}`: Math Processing Error")
        elif frame.find(class_="noError") is not None:
            problems.append(f"formula {number} `{_short(tex)}`: TeX does not parse")
        elif undefined := re.findall(r'<mtext mathcolor="red">([^<]*)<', frame.get("data-mathml", "")):
            problems.append(f"formula {number} `{_short(tex)}`: unknown macro {', '.join(sorted(set(undefined)))}")
    for tag in soup.find_all(SKIPPED_TAGS):
        tag.decompose()
    leftover = LEFTOVER_TEX.search(soup.get_text(" "))
    if leftover:
        problems.append(f"TeX left unrendered in the text (did MathJax run?): `{_short(leftover.group())}`")
    return len(scripts), problems


def check_page(page: Path, browser: str) -> PageMath:
    """Open ``page`` in ``browser`` and check its math."""
    result = PageMath(Path(page))
    try:
        result.formulas, result.errors = math_problems(rendered_dom(Path(page), browser))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        result.errors = [f"{type(error).__name__}: {error}"]
    return result


def report_pages(paths) -> list[Path]:
    """The pages to check: each .html given, and the .html pages (index.html aside) of each folder given."""
    pages = []
    for path in map(Path, paths):
        if path.is_dir():
            pages += sorted(p for p in path.glob("*.html") if p.name != "index.html")
        elif path.suffix == ".html" and path.is_file():
            pages.append(path)
        else:
            raise FileNotFoundError(f"not an HTML page or a folder of pages: {path}")
    return pages


def check_pages(pages, browser: str) -> list[PageMath]:
    return [check_page(page, browser) for page in pages]


def summary(results: list[PageMath], browser: str = "") -> str:
    """One line per page, then the failures, then the verdict."""
    width = max([len(r.page.name) for r in results] + [4])
    lines = [
        f"{r.page.name:<{width}}  {r.formulas:>4} formulas  {'ok' if r.ok else f'{len(r.errors)} FAILED'}"
        for r in results
    ]
    for r in results:
        lines += [f"  {r.page.name}: {error}" for error in r.errors]
    formulas, failed = sum(r.formulas for r in results), sum(not r.ok for r in results)
    verdict = "every formula rendered" if not failed else f"{failed} of {len(results)} pages have math errors"
    lines.append(f"{formulas} formulas on {len(results)} pages{f' in {browser}' if browser else ''}: {verdict}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_lib.pagecheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="report folders or HTML pages")
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"no browser found ({', '.join(BROWSERS)}, or $MOE_BROWSER): math check skipped")
        return 0
    try:
        pages = report_pages(args.paths)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = check_pages(pages, browser)
    print(summary(results, browser_version(browser)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
