"""moe_lib.lab.design_log: notes/index.md read as tables, every note it names present, its statuses known."""

import pytest

from moe_lib.lab import design_log


@pytest.fixture(scope="module")
def log():
    return design_log.read_index()


def test_every_row_names_notes_that_exist_and_a_known_status(log):
    assert len(log) > 40
    for _, row in log.iterrows():
        assert row["notes"], row["design"]
        assert all((design_log.NOTES_DIR / note).is_file() for note in row["notes"]), row["notes"]
        assert row["kind"] in design_log.STATUSES, row["status"]
    assert set(log["section"]) >= {"P1 · swiglu_down_backward (moe_lib/swiglu_down/)"}


@pytest.mark.parametrize(
    "status, kind",
    [
        ("removed@1051632", "removed"),
        ("default (`few_tokens`)", "default"),
        ("negative (`sorted_rows_from_a` removed@eaf7526)", "negative"),
        ("fallback (`chained`, faithful off Hopper)", "fallback"),
        ("whatever", "other"),
    ],
)
def test_status_kind(status, kind):
    assert design_log.status_kind(status) == kind


def test_counts_and_tables(log, tmp_path):
    counts = design_log.status_counts(log)
    assert int(counts.to_numpy().sum()) == len(log)
    html = design_log.styled_log(log, log["section"].iloc[0], link_from=tmp_path).to_html()
    first = log["notes"].iloc[0][0]
    assert f">{first}</a>" in html and "notes/" + first in html
    fig = design_log.status_figure(counts)
    assert fig.axes
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_malformed_row_names_its_line(tmp_path):
    index = tmp_path / "index.md"
    index.write_text("## P1\n| note | design | status | verdict |\n|---|---|---|---|\n| `p1/a.md` | a | default |\n")
    with pytest.raises(ValueError, match=r"index.md: line 4: expected 4 columns"):
        design_log.read_index(index)
