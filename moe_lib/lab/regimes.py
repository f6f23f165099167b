"""Notebooks 03 and 04: P1's regimes — which design runs at which token count — read from the chooser, never typed.

Every design named here is what :func:`moe_lib.swiglu_down.choose.choose_design` returns on a stated
:class:`~moe_lib.swiglu_down.runtime.Device` (:func:`chosen_design`), named as the registry names it (``design.name``,
:data:`~moe_lib.swiglu_down.designs.DESIGNS`) and, for the Gluon launches, by the form of ``designs.gluon.FORMS`` the
library's own helpers make it from (:func:`gluon_form_of`): nothing here re-derives a choice by type checks or copied
token counts. Notebook 04's registry table and design map come from here (:func:`p1_registry_table`,
:func:`p1_design_map_figure`; also :func:`p1_design_by_tokens`, :func:`gluon_forms_table`). :func:`regime_table` folds
the choice into bands (first and last token count of each design, per path). :func:`stated_regimes` finds the regime
statements a page of prose makes ("the fast path runs cuBLAS's GEMMs from 4300 tokens") and :func:`disagreements` checks
each against the bands: ``tests/test_notebooks.py`` runs it over every notebook, so a sentence that contradicts the
chooser fails a test instead of misleading a reader.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
import torch

from ..swiglu_down.choose import choose_design
from ..swiglu_down.designs import DESIGNS
from ..swiglu_down.designs.gluon import FORMS, GluonLaunches, grad_down_in_second_launch, with_second
from ..swiglu_down.runtime import Device

# the GPU the tuning ran on as P1's chooser sees it (what runtime.device_of reads off an H200): the tables and figures
# of its choice are drawn for it, on any machine
H200 = Device("cuda", sms=132, shared_memory=232448, capability=(9, 0), name="NVIDIA H200")
PATHS = ("fast", "faithful")  # P1's paths, by the precision argument that picks them

# the designs of the registry (moe_lib.swiglu_down.designs.DESIGNS) by the name prose gives them
FAMILIES = {
    "few_tokens": "few-token launch",
    "gluon_launches": "Gluon launches",
    "library_gemms": "cuBLAS GEMMs",
    "chained": "chained launch",
    "triton_launches": "Triton launches",
}
# the words that name a family in a sentence (case-sensitive, as the notebooks write them)
FAMILY_WORDS = {
    "few_tokens": ("few-token",),
    "gluon_launches": ("Gluon",),
    "library_gemms": ("cuBLAS",),
    "chained": ("chained",),
    "triton_launches": ("Triton launches",),
}
PATH_WORDS = {"fast": "fast path", "faithful": "faithful path"}
MAX_TOKENS = 8192  # the benchmark's largest case: the bands are drawn to here


# ================================================================ the design the chooser picks, by name


def chosen_design(num_tokens: int, hidden_size: int, intermediate_size: int, precision: str, *, device: Device = H200):
    """The design ``swiglu_down_backward(..., precision=precision)`` runs on bf16 inputs of this shape on ``device``
    (:func:`~moe_lib.swiglu_down.choose.choose_design`, every operand aligned as the benchmark's are)."""
    return choose_design(
        num_tokens, hidden_size, intermediate_size, dtype=torch.bfloat16, precision=precision, device=device
    )


@functools.lru_cache(maxsize=1024)  # the chooser hands out few distinct designs; a design map asks for each many times
def gluon_form_of(design: GluonLaunches) -> tuple[str, bool, int]:
    """(its form's name in :data:`~moe_lib.swiglu_down.designs.gluon.FORMS`, dWd's tiles in launch 2, dx's splits) of
    a configured Gluon design: the first form that gives it under the changes the chooser makes to a form
    (``choose.measured_form``, ``choose.fit_persistent_programs``), made by the library's own helpers: dWd's tiles
    moved to launch 2 (``grad_down_in_second_launch``), dx split (``with_second(grad_x_splits=)``), launch 2's
    persistent weight-gradient programs dropped (``with_second(weight_grad_programs=0)``)."""
    splits = design.second.grad_x_splits
    for name, form in FORMS.items():
        for moved in (False, True):
            base = grad_down_in_second_launch(form) if moved else form
            for programs in dict.fromkeys((base.second.weight_grad_programs, 0)):
                if with_second(base, grad_x_splits=splits, weight_grad_programs=programs) == design:
                    return name, moved, splits
    raise ValueError(
        f"design: not a form of designs.gluon.FORMS, even with dWd's tiles, dx's splits and the "
        f"persistent programs set back: {design}"
    )


def design_label(design) -> str:
    """A configured P1 design as its registry name (``DESIGNS``), a Gluon design with its form's name and whether
    dWd's tiles moved to launch 2 (dx's splits left to :func:`gluon_forms_table`)."""
    if design.name != GluonLaunches.name:
        return design.name
    form, grad_down_second, _ = gluon_form_of(design)
    return f"{design.name}: {form}" + (", dWd in launch 2" if grad_down_second else "")


def p1_registry_table() -> pd.DataFrame:
    """P1's designs as the registry has them (:data:`~moe_lib.swiglu_down.designs.DESIGNS`): per name its config
    class, its module and the first line of the module's docstring (what the design is; Sphinx roles as plain
    names, a module as its file)."""

    def what(design) -> str:
        line = sys.modules[design.__module__].__doc__.strip().splitlines()[0]
        line = re.sub(r":mod:`~?\.*([^`]+)`", r"\1.py", line)  # a module by its file
        return re.sub(r":\w+:`~?\.*([^`]+)`", r"\1", line).replace("``", "")

    rows = {
        name: {
            "config": design.__name__,
            "module": design.__module__.removeprefix("moe_lib."),
            "what it is": what(design),
        }
        for name, design in DESIGNS.items()
    }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("design")


def p1_design_by_tokens(token_counts, hidden_size: int, intermediate_size: int, *, device: Device = H200):
    """Which design ``swiglu_down_backward`` runs on bf16 inputs on ``device``, per token count (rows) and path
    (columns), as :func:`design_label` names it."""
    rows = {
        T: {path: design_label(chosen_design(T, hidden_size, intermediate_size, path, device=device)) for path in PATHS}
        for T in token_counts
    }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("num_tokens")


def p1_design_table(token_counts, shapes, *, device: Device = H200) -> pd.DataFrame:
    """:func:`p1_design_by_tokens` for each (H, I) of ``shapes`` side by side: columns (shape, path)."""
    return pd.concat(
        {f"H {H}, I {I}": p1_design_by_tokens(token_counts, H, I, device=device) for H, I in shapes},
        axis=1,
        names=["shape", "path"],
    )


def design_runs(names: list[str], first: int = 1) -> list[tuple[int, int, str]]:
    """Runs of equal names in a list indexed from ``first``: (start, stop, name), stop excluded."""
    runs = []
    for index, name in enumerate(names, start=first):
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], index + 1, name)
        else:
            runs.append((index, index + 1, name))
    return runs


def p1_design_map_figure(
    hidden_size: int,
    intermediate_size: int,
    *,
    max_tokens: int = 12288,
    device: Device = H200,
    marks=(),
    marks_label: str = "the benchmark's token counts",
):
    """Which design ``swiglu_down_backward`` runs at every token count from 1 to ``max_tokens`` on ``device``
    (:func:`chosen_design`, named by :func:`design_label`), one bar per path (to 1024 tokens on a log axis, beyond on
    a linear one), a colour per design; ``marks``: token counts drawn as dotted lines."""
    paths = {
        path: design_runs(
            [
                design_label(chosen_design(T, hidden_size, intermediate_size, path, device=device))
                for T in range(1, max_tokens + 1)
            ]
        )
        for path in PATHS
    }
    designs = list(dict.fromkeys(name for runs in paths.values() for _, _, name in runs))
    colors = dict(zip(designs, plt.get_cmap("tab10" if len(designs) <= 10 else "tab20").colors, strict=False))
    # few tokens on a log axis, the rest on a linear one, where the bands are
    split = min(1024, max_tokens)
    fig, axes = plt.subplots(
        1, 2, figsize=(11, 1.9 + 0.2 * len(designs)), sharey=True, gridspec_kw=dict(width_ratios=(1, 2))
    )
    for ax, (low, high, scale) in zip(axes, ((1, split, "log"), (split, max_tokens + 1, "linear")), strict=True):
        for row, runs in enumerate(paths.values()):
            for start, stop, name in runs:
                ax.broken_barh(
                    [(start, stop - start)], (row - 0.35, 0.7), color=colors[name], edgecolor="black", lw=0.3
                )
        for T in marks:
            ax.axvline(T, color="black", lw=0.6, ls=":")
        ax.set(xscale=scale, xlim=(low, high), xlabel="tokens")
    axes[0].set(yticks=range(len(paths)), yticklabels=list(paths))
    dotted = f"; dotted: {marks_label}" if marks else ""
    fig.suptitle(
        f"P1: the design swiglu_down_backward runs by token count (H = {hidden_size}, "
        f"I = {intermediate_size}, {device.name or device.kind}, {device.sms} SMs{dotted})",
        fontsize=9,
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[name]) for name in designs]
    fig.legend(handles, designs, fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * len(designs) / 2, 1, 1))
    fig.paths = paths  # the runs drawn, per path: (first token count, last + 1, design)
    return fig


def gluon_forms_table(
    token_counts, hidden_size: int, intermediate_size: int, *, precision: str = "faithful", device: Device = H200
) -> pd.DataFrame:
    """The Gluon launches as the chooser configures them on ``device`` per token count where it takes them
    (:func:`chosen_design`; other designs' token counts are left out): the form's name in
    :data:`~moe_lib.swiglu_down.designs.gluon.FORMS`, each launch's tile height, ring depth, and whether its tiles of
    fixed length (dA's, dx's) take the first program ids, whether launch 2 is issued by programmatic dependent launch
    (its programs started on the SMs launch 1's last wave frees, waiting there for launch 1's end), whether launch 1's
    saved tiles are asked for early, whether dWd's tiles are in launch 2, and over how many programs a dx tile's
    reduction is split."""
    rows = {}
    for T in token_counts:
        design = chosen_design(T, hidden_size, intermediate_size, precision, device=device)
        if design.name != GluonLaunches.name:
            continue
        first, second = design.first, design.second
        rows[T] = {
            "form": gluon_form_of(design)[0],
            "launch 1 rows": first.block_m,
            "launch 1 ring": first.buffers,
            "dA tiles first": first.d_a_first,
            "launch 2 rows": second.block_m,
            "launch 2 ring": second.buffers,
            "dx tiles first": second.grad_x_first,
            "launch 2 early": second.programmatic,
            "saved tiles early": first.saved_tiles_early,
            "dWd in launch 2": second.grad_down_tiles,
            "dx splits": second.grad_x_splits,
        }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("num_tokens")


# ================================================================ regimes: the choice as bands, and prose checked


def design_by_tokens(
    hidden_size: int, intermediate_size: int, precision: str, *, device=H200, max_tokens: int = MAX_TOKENS
) -> list[str]:
    """The registry name of the design the chooser picks for 1 .. ``max_tokens`` tokens (bf16 inputs)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    return [
        chosen_design(T, hidden_size, intermediate_size, precision, device=device).name
        for T in range(1, max_tokens + 1)
    ]


def regime_table(hidden_size: int, intermediate_size: int, *, device=H200, max_tokens: int = MAX_TOKENS):
    """Per path, the bands of token counts one design runs (columns path, first, last, design, family), from the
    chooser itself: what a notebook shows instead of typing the boundaries."""
    rows = []
    for path in PATHS:
        names = design_by_tokens(hidden_size, intermediate_size, path, device=device, max_tokens=max_tokens)
        for start, stop, name in design_runs(names):
            rows.append(dict(path=path, first=start, last=stop - 1, design=name, family=FAMILIES[name]))
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Claim:
    """One regime statement of a page: ``path`` runs ``design`` on tokens ``low`` .. ``high`` (``high`` None: "from
    ``low`` on"), as written in ``sentence``."""

    path: str
    design: str
    low: int
    high: int | None
    sentence: str


_NUMBER = r"(\d[\d,]*)"
_RANGE = re.compile(_NUMBER + r"\s*[–-]\s*" + _NUMBER + r"\s*tokens")
_FROM = re.compile(r"\bfrom " + _NUMBER + r"(?: tokens)?\b(?!\s*[–-])")
_UP_TO = re.compile(r"\bup to " + _NUMBER + r"\s*tokens")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _only(sentence: str, words: dict) -> str | None:
    """The one key of ``words`` whose words ``sentence`` mentions, None when it mentions none or several."""
    found = [
        key
        for key, spelled in words.items()
        if any(w in sentence for w in ((spelled,) if isinstance(spelled, str) else spelled))
    ]
    return found[0] if len(found) == 1 else None


def stated_regimes(text: str) -> list[Claim]:
    """The regime statements of ``text`` (markdown): sentences naming exactly one path and one design, with token
    ranges in one of the forms "N–M tokens", "from N (tokens)" or "up to N tokens". Sentences that name both paths
    or several designs are left alone (they say too much for one reading), and so are those about GPUs off Hopper."""
    claims = []
    for sentence in re.split(r"(?<=[.;:!?])\s+|\n\s*\n|\n[-*] ", text):
        path, design = _only(sentence, PATH_WORDS), _only(sentence, FAMILY_WORDS)
        both_paths = re.search(r"\bfast\b", sentence) and re.search(r"\bfaithful\b", sentence)
        off_hopper = "off hopper" in sentence.lower()  # the bands are a Hopper GPU's
        if path is None or design is None or both_paths or off_hopper:
            continue
        for low, high in _RANGE.findall(sentence):
            claims.append(Claim(path, design, _int(low), _int(high), sentence.strip()))
        for low in _FROM.findall(sentence):
            claims.append(Claim(path, design, _int(low), None, sentence.strip()))
        for high in _UP_TO.findall(sentence):
            claims.append(Claim(path, design, 1, _int(high), sentence.strip()))
    return claims


def disagreements(
    claims: list[Claim], hidden_size: int, intermediate_size: int, *, device=H200, max_tokens: int = MAX_TOKENS
) -> list[str]:
    """Each claim the chooser contradicts, in words: a range ("N–M", "up to M") must run the design at every token
    count in it; "from N" must start the design at N (it runs at N and not at N − 1)."""
    chosen = {
        path: design_by_tokens(hidden_size, intermediate_size, path, device=device, max_tokens=max_tokens)
        for path in PATHS
    }
    wrong = []
    for claim in claims:
        names = chosen[claim.path]
        if claim.high is None:
            starts = claim.low <= max_tokens and names[claim.low - 1] == claim.design
            starts = starts and (claim.low == 1 or names[claim.low - 2] != claim.design)
            if not starts:
                wrong.append(
                    f"{claim.path} path: {FAMILIES[claim.design]} do not start at {claim.low} tokens "
                    f"(the chooser: {names[claim.low - 2]} at {claim.low - 1}, "
                    f"{names[min(claim.low, max_tokens) - 1]} at {claim.low}): {claim.sentence!r}"
                )
            continue
        others = sorted({names[t - 1] for t in range(claim.low, min(claim.high, max_tokens) + 1)} - {claim.design})
        if others:
            wrong.append(
                f"{claim.path} path: not {FAMILIES[claim.design]} at every count in {claim.low}–{claim.high} "
                f"(the chooser also picks {', '.join(others)}): {claim.sentence!r}"
            )
    return wrong
