"""Notebooks 03 and 04: P1's regimes — which design runs at which token count — read from the chooser, never typed.

:func:`regime_table` evaluates :func:`moe_lib.swiglu_down.choose.choose_design` at every token count for a shape and a
device and folds the answer into bands (first and last token count of each design, per path). :func:`stated_regimes`
finds the regime statements a page of prose makes ("the fast path runs cuBLAS's GEMMs from 4300 tokens") and
:func:`disagreements` checks each against the bands: ``tests/test_notebooks.py`` runs it over every notebook, so a
sentence that contradicts the chooser fails a test instead of misleading a reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from .kernels import H200, PATHS, chosen_design, design_runs

# the designs of the registry (moe_lib.swiglu_down.designs.DESIGNS) by the name prose gives them
FAMILIES = {
    "few_tokens": "few-token launch",
    "gluon_launches": "Gluon launches",
    "library_gemms": "cuBLAS GEMMs",
    "chained": "chained launch",
    "triton_launches": "Triton launches",
}
# the words that name a family in a sentence (case-sensitive, as the notebooks write them)
FAMILY_WORDS = {"few_tokens": ("few-token",), "gluon_launches": ("Gluon",), "library_gemms": ("cuBLAS",),
                "chained": ("chained",), "triton_launches": ("Triton launches",)}  # fmt: skip
PATH_WORDS = {"fast": "fast path", "faithful": "faithful path"}
MAX_TOKENS = 8192  # the benchmark's largest case: the bands are drawn to here


def design_by_tokens(hidden_size: int, intermediate_size: int, precision: str, *, device=H200,
                     max_tokens: int = MAX_TOKENS) -> list[str]:  # fmt: skip
    """The registry name of the design the chooser picks for 1 .. ``max_tokens`` tokens (bf16 inputs)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    return [chosen_design(T, hidden_size, intermediate_size, precision, device=device).name
            for T in range(1, max_tokens + 1)]  # fmt: skip


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
    found = [key for key, spelled in words.items()
             if any(w in sentence for w in ((spelled,) if isinstance(spelled, str) else spelled))]  # fmt: skip
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


def disagreements(claims: list[Claim], hidden_size: int, intermediate_size: int, *, device=H200,
                  max_tokens: int = MAX_TOKENS) -> list[str]:  # fmt: skip
    """Each claim the chooser contradicts, in words: a range ("N–M", "up to M") must run the design at every token
    count in it; "from N" must start the design at N (it runs at N and not at N − 1)."""
    chosen = {path: design_by_tokens(hidden_size, intermediate_size, path, device=device, max_tokens=max_tokens)
              for path in PATHS}  # fmt: skip
    wrong = []
    for claim in claims:
        names = chosen[claim.path]
        if claim.high is None:
            starts = claim.low <= max_tokens and names[claim.low - 1] == claim.design
            starts = starts and (claim.low == 1 or names[claim.low - 2] != claim.design)
            if not starts:
                wrong.append(f"{claim.path} path: {FAMILIES[claim.design]} do not start at {claim.low} tokens "
                             f"(the chooser: {names[claim.low - 2]} at {claim.low - 1}, "
                             f"{names[min(claim.low, max_tokens) - 1]} at {claim.low}): {claim.sentence!r}")
            continue
        others = sorted({names[t - 1] for t in range(claim.low, min(claim.high, max_tokens) + 1)} - {claim.design})
        if others:
            wrong.append(f"{claim.path} path: not {FAMILIES[claim.design]} at every count in {claim.low}–{claim.high} "
                         f"(the chooser also picks {', '.join(others)}): {claim.sentence!r}")
    return wrong
