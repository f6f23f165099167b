"""moe_lib.lab.regimes: P1's regimes read from the chooser, and no notebook stating one the chooser contradicts."""

import json
import random
from pathlib import Path

import pytest

from moe_lib import problems
from moe_lib.lab import regimes

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SIZES = problems.load("swiglu_down_backward").sizes(0)
H, I = SIZES["hidden_size"], SIZES["intermediate_size"]


@pytest.fixture(scope="module")
def table():
    return regimes.regime_table(H, I)


def test_the_bands_cover_every_token_count_once_and_are_the_choosers(table, seed):
    for path, bands in table.groupby("path"):
        assert bands["first"].iloc[0] == 1 and bands["last"].iloc[-1] == regimes.MAX_TOKENS, path
        assert (bands["first"].iloc[1:].to_numpy() == bands["last"].iloc[:-1].to_numpy() + 1).all(), path
        assert (bands["design"].iloc[1:].to_numpy() != bands["design"].iloc[:-1].to_numpy()).all(), path
    rng = random.Random(seed)
    for T in [1, 64, 65, 8192, *rng.sample(range(1, regimes.MAX_TOKENS + 1), 40)]:
        for path in ("fast", "faithful"):
            band = table[(table["path"] == path) & (table["first"] <= T) & (table["last"] >= T)]
            assert len(band) == 1 and band["design"].iloc[0] == regimes.chosen_design(T, H, I, path).name, (T, path)


# the statements issue 51 found in notebooks 03 and 04, and correct ones
STALE = [
    "The fast path runs cuBLAS GEMMs from 960 tokens.",
    "The fast path takes the cuBLAS GEMMs at 960–3299 tokens.",
    "The faithful path runs the few-token launch up to 128 tokens.",
]
TRUE = [
    "The fast path runs cuBLAS GEMMs from 4300 tokens.",
    "The faithful path runs the Gluon launches at 65–8192 tokens.",
    "The fast path runs the few-token launch up to 64 tokens.",
]


@pytest.mark.parametrize("sentence", STALE)
def test_a_statement_the_chooser_contradicts_is_found(sentence):
    claims = regimes.stated_regimes(sentence)
    assert len(claims) == 1 and regimes.disagreements(claims, H, I), sentence


@pytest.mark.parametrize("sentence", TRUE)
def test_a_statement_the_chooser_agrees_with_passes(sentence):
    claims = regimes.stated_regimes(sentence)
    assert len(claims) == 1 and regimes.disagreements(claims, H, I) == [], sentence


def test_sentences_about_both_paths_or_off_hopper_are_left_alone():
    assert regimes.stated_regimes("The fast and the faithful path run Gluon at 65–959 tokens.") == []
    assert regimes.stated_regimes("Off Hopper, the fast path runs cuBLAS from 65 tokens.") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_no_notebook_states_a_regime_the_chooser_contradicts(path):
    cells = json.loads(path.read_text())["cells"]
    text = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    assert regimes.disagreements(regimes.stated_regimes(text), H, I) == []


def test_a_bad_token_range_is_named():
    with pytest.raises(ValueError, match="max_tokens"):
        regimes.regime_table(H, I, max_tokens=0)
