"""moe_lib.lab.regimes: P1's design choice named, tabled and mapped, each read from the chooser on a stated device."""

import matplotlib
import pytest
import torch

from moe_lib.lab import regimes
from moe_lib.swiglu_down.choose import MEASURED, choose_design
from moe_lib.swiglu_down.designs.gluon import FORMS, GluonLaunches, grad_down_in_second_launch, with_second
from moe_lib.swiglu_down.designs.triton_launches import tiles_for
from moe_lib.swiglu_down.runtime import Device

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

A100 = Device("cuda", sms=108, shared_memory=166912, capability=(8, 0))  # no Gluon launches there


def chosen(num_tokens, precision, hidden_size=2048, intermediate_size=768):
    """What the chooser runs on the H200 at the benchmark's shape (bf16)."""
    return regimes.chosen_design(num_tokens, hidden_size, intermediate_size, precision)


def test_p1_design_by_tokens_follows_choose_design():
    """The designs by token count on the H200 at the benchmark's shape (what choose.MEASURED holds), and off Hopper."""
    table = regimes.p1_design_by_tokens([1, 16, 17, 64, 65, 128, 129, 1087, 3300, 8192], 2048, 768)
    assert list(table.columns) == ["fast", "faithful"]
    assert (table.loc[[1, 16, 17, 64]] == "few_tokens").all().all()
    assert table.loc[65, "fast"] == table.loc[129, "faithful"] == "gluon_launches: narrow, dWd in launch 2"
    assert table.loc[65, "faithful"] == table.loc[128, "faithful"] == "gluon_launches: narrow"
    assert table.loc[1087].tolist() == ["gluon_launches: tall_dx_first, dWd in launch 2"] * 2
    assert table.loc[3300].tolist() == ["library_gemms", "gluon_launches: wide_tall"]
    assert table.loc[8192].tolist() == ["library_gemms", "gluon_launches: wide"]
    for T in table.index:
        for path in table.columns:
            design = choose_design(T, 2048, 768, dtype=torch.bfloat16, precision=path, device=regimes.H200)
            assert table.loc[T, path] == regimes.design_label(design), (T, path)
    elsewhere = regimes.p1_design_by_tokens([129, 512, 8192], 2048, 768, device=A100)
    assert elsewhere["fast"].tolist() == ["library_gemms"] * 3
    assert elsewhere["faithful"].tolist() == ["chained", "chained", "triton_launches"]  # the few-token launch to 128
    shapes = [(2048, 768), (4096, 1536), (7168, 2048)]
    side_by_side = regimes.p1_design_table([1, 512, 8192], shapes)
    assert list(side_by_side.columns) == [(f"H {H}, I {I}", path) for H, I in shapes for path in ("fast", "faithful")]
    assert side_by_side["H 2048, I 768"].equals(regimes.p1_design_by_tokens([1, 512, 8192], 2048, 768))


def test_p1_registry_table_lists_every_design_of_the_registry():
    from moe_lib.swiglu_down.designs import DESIGNS

    table = regimes.p1_registry_table()
    assert list(table.index) == list(DESIGNS) and table.loc["gluon_launches", "config"] == "GluonLaunches"
    assert table.loc["chained", "module"] == "swiglu_down.designs.chained"
    assert table.loc["triton_launches", "what it is"].startswith("P1's portable design: two Triton launches")
    assert not table["what it is"].str.contains(":mod:|``").any()  # Sphinx roles read as plain names


def test_gluon_form_of_names_every_form_the_chooser_can_make():
    """Each form of FORMS, with dWd's tiles moved, dx split or the persistent programs dropped, is named back; every
    Gluon design the chooser picks at three model shapes has a name; a configuration no form has is refused."""
    for name, form in FORMS.items():
        for moved in (False, True):
            for splits in (1, 2, 4):
                design = with_second(grad_down_in_second_launch(form) if moved else form, grad_x_splits=splits)
                assert regimes.gluon_form_of(design) == (name, moved, splits)
        assert regimes.gluon_form_of(with_second(form, weight_grad_programs=0))[0] == name
    assert len({regimes.design_label(form) for form in FORMS.values()}) == len(FORMS)
    named = set()
    for H, I in ((2048, 768), (4096, 1536), (7168, 2048)):
        for T in (65, 100, 129, 300, 513, 1100, 1500, 2300, 3000, 3600, 5200, 8192):
            for path in ("fast", "faithful"):
                design = chosen(T, path, H, I)
                if design.name == GluonLaunches.name:
                    named.add(regimes.gluon_form_of(design)[0])
    assert {"narrow", "tall", "wide"} <= named
    assert regimes.design_label(tiles_for(16, with_lo=False)) == "triton_launches"
    with pytest.raises(ValueError, match="not a form"):
        regimes.gluon_form_of(with_second(FORMS["wide"], block_n=128))


def test_p1_design_map_draws_every_run_of_the_design_choice():
    """The design map: per path, runs of equal designs that cover 1..max_tokens without gaps, each the name of what
    choose_design returns at its first and last token count."""
    assert regimes.design_runs(["a", "a", "b", "a"]) == [(1, 3, "a"), (3, 4, "b"), (4, 5, "a")]
    fig = regimes.p1_design_map_figure(2048, 768, max_tokens=4096, marks=(128, 1087))
    assert list(fig.paths) == ["fast", "faithful"] and len(fig.axes) == 2
    for path, runs in fig.paths.items():
        assert runs[0][0] == 1 and runs[-1][1] == 4097
        assert all(a[1] == b[0] and a[2] != b[2] for a, b in zip(runs, runs[1:], strict=False))
        table = regimes.p1_design_by_tokens(
            [start for start, _, _ in runs] + [stop - 1 for _, stop, _ in runs], 2048, 768
        )
        for start, stop, name in runs:
            assert table.loc[start, path] == table.loc[stop - 1, path] == name, (path, start)
    fast = {name for _, _, name in fig.paths["fast"]}
    assert {"few_tokens", "library_gemms"} <= fast
    plt.close(fig)


def test_gluon_forms_table_follows_the_bands():
    table = regimes.gluon_forms_table([64, 128, 129, 1099, 1100, 1400, 2300, 3300, 8192], 2048, 768)
    assert list(table.index) == [128, 129, 1099, 1100, 1400, 2300, 3300, 8192]  # the few-token launch's left out
    assert table.loc[129].to_dict() == {
        "form": "narrow",
        "launch 1 rows": 64,
        "launch 1 ring": 8,
        "dA tiles first": True,
        "launch 2 rows": 64,
        "launch 2 ring": 6,
        "dx tiles first": True,
        "launch 2 early": True,
        "saved tiles early": True,
        "dWd in launch 2": True,
        "dx splits": 2,
    }
    assert table["form"].tolist() == [
        "narrow",
        "narrow",
        "tall_dx_first",
        "wide_da_first",
        "wide_da_first_tall",
        "wide",
        "wide_tall",
        "wide",
    ]
    fast = regimes.gluon_forms_table([64, 128, 3300, 8192], 2048, 768, precision="fast")
    assert list(fast.index) == [128] and fast.loc[128, "dWd in launch 2"]  # cuBLAS's GEMMs at 3300 and 8192
    assert table.loc[1100, "launch 1 rows"] == 128 and table.loc[1100, "dA tiles first"]
    assert table.loc[1100, "dx tiles first"] and not table.loc[1400, "dx tiles first"]
    assert table.loc[3300, "launch 2 rows"] == 64 and table.loc[8192, "launch 2 rows"] == 128
    assert not table.loc[8192, ["dA tiles first", "dx tiles first"]].any()
    assert table["saved tiles early"].all()
    assert table.loc[128, "dx splits"] == 4 and (table.loc[[1099, 1100, 8192], "dx splits"] == 1).all()


def test_gluon_form_of_names_each_band_as_the_choosers_table_does():
    """At the H200's measured shape the chooser's own table (choose.MEASURED) names each band's form, where dWd's tiles
    go and dx's splits: gluon_form_of reads the same back from the design the chooser returns, first and last count."""
    table = MEASURED[(2048, 768, regimes.H200.sms)]
    for path, bands in table.items():
        for (start, name, moved, splits), stop in zip(bands, [band[0] for band in bands[1:]] + [8193], strict=True):
            for T in (start, stop - 1):
                design = chosen(T, path)
                if name == "library_gemms":
                    assert design.name == "library_gemms", (path, T)
                else:
                    assert regimes.gluon_form_of(design) == (name, moved, splits), (path, T)
