"""The README's Python examples run as written (on the CPU here: impl="auto" takes the reference there)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_examples_run_as_written():
    blocks = python_blocks()
    assert blocks, "the README has no Python example"
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # the README's own code, as a reader runs it
    p1, p2 = namespace["p1"], namespace["p2"]
    assert namespace["grad_x"].shape == p1["x"].shape and namespace["grad_down_w"].shape == p1["down_weight"].shape
    assert namespace["grad_topk_w"].shape == p2["topk_weights"].shape
    assert namespace["x"].grad is not None and namespace["x"].grad.shape == p1["x"].shape
    assert namespace["y"].shape == p2["hidden_states"].shape
    assert namespace["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_readme_examples_name_no_device_they_may_not_have():
    for block in python_blocks():
        assert 'device="cuda")' not in block


def _status_row(text: str, case: str) -> str:
    row = re.search(rf"^\| {re.escape(case)} \|(.*)\|$", text, re.M)
    assert row, case
    return row.group(1)


def test_the_readme_status_table_is_that_of_the_files_it_cites():
    """The status table's measured numbers, rounded as printed, are those of the committed runs it names: updating
    those files means updating the table."""
    import json

    import pandas as pd

    from moe_lib.bench.results import geomean

    text = README.read_text()
    results = README.parent / "data" / "results" / "H200"
    files = re.search(r"The runs behind it, row by row \(`data/results/H200/`\): (.*?);", text, re.S).group(1)
    named = re.findall(r"`([^`]+)`", files)
    assert len(named) == 7 and all((results / name).is_file() for name in named), named

    def times(name: str, unit: float) -> pd.DataFrame:
        return pd.read_csv(results / name).pivot_table(index="num_tokens", columns="impl", values="median_ms") * unit

    p1 = times(named[0], 1000)
    want = [geomean(p1[impl]) for impl in ("triton", "triton_fast", "torch_compile")]
    row = _status_row(text, "P1, the 16 benchmark cases, geomean")
    assert len(p1) == 16 and [float(v) for v in re.findall(r"([\d.]+) µs", row)] == [round(w, 1) for w in want], row

    official = json.loads((results / named[1]).read_text())["workloads"]
    row = _status_row(text, "P1 in NVIDIA's harness")
    passed = sum(w["status"] == "PASSED" for w in official)
    geo = geomean(w["latency_ms"] * 1000 for w in official)
    assert f"{passed} of {len(official)} pass, {round(geo, 1)} µs geomean" in row, row

    def by_model(name: str) -> pd.DataFrame:
        frame = pd.read_csv(results / name)
        return frame[frame["status"] == "ok"].pivot_table(
            index=["model", "num_tokens"], columns="impl", values="median_ms"
        )

    models = by_model(named[2])
    row = _status_row(text, "P1 at 8 public models' expert shapes, 1–16384 tokens")
    ahead = (models["triton_fast"] < models["torch_eager"]).sum()
    assert f"fast path ahead of eager in {ahead} of {len(models)} cases" in row, row
    per_shape = (models["torch_compile"] / models["triton_fast"]).groupby(level="model").agg(geomean)
    assert f"{per_shape.min():.2f}–{per_shape.max():.2f}× `torch.compile`" in row, row

    models = by_model(named[4])  # the grouped engine's structure, the default since this run
    row = _status_row(text, "P2 bf16 at 7 models' expert shapes, 512–32768 tokens")
    ahead = (models["triton_engine"] < models["grouped_mm"]).sum()
    assert f"ahead of `grouped_mm` in {ahead} of {len(models)} cases" in row, row
    lead = models["grouped_mm"] / models["triton_engine"]
    assert f"by {lead.min():.2f}–{lead.max():.2f}×" in row, row

    p2 = times(named[3], 1)
    row = _status_row(text, "P2 bf16, 2048 / 8192 / 32768 tokens")
    for impl in ("triton", "grouped_mm"):
        assert " / ".join(f"{p2.loc[T, impl]:.1f}" for T in (2048, 8192, 32768)) in row, (impl, row)

    layer = times(named[5], 1).loc[32768]
    row = _status_row(text, "P2 layer forward + backward on kernels A-W-D-C, 32768 tokens")
    assert f"{layer['triton_saved']:.1f} ms" in row and f"SonicMoE {layer['sonicmoe']:.1f} ms" in row, row

    values = ["median_ms", "peak_mem_gb"]
    engine = pd.read_csv(results / named[6]).pivot_table(index="num_tokens", columns="impl", values=values)
    row = _status_row(text, "P2 layer on the grouped engine, 2048 / 8192 / 32768 tokens")
    for impl in ("triton_saved", "grouped_mm"):
        assert " / ".join(f"{engine.loc[T, ('median_ms', impl)]:.1f}" for T in (2048, 8192, 32768)) in row, row
        assert f"{engine.loc[32768, ('peak_mem_gb', impl)]:.1f} GB" in row, (impl, row)


def test_the_readme_layout_names_every_part_of_the_tree():
    """Every top-level folder of the repository and every module and subpackage of moe_lib has its line in the
    README's layout: a new part of the tree means a line there."""
    text = README.read_text()
    layout = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S).group(1)
    root = README.parent
    package = root / "moe_lib"
    parts = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    )
    missing = [name for name in parts if not re.search(rf"(?<![\w.]){re.escape(name)}(\.py|/)?(?!\w)", layout)]
    assert not missing, missing
    folders = [
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith((".", "__")) and not p.name.endswith(".egg-info")
    ]
    assert all(re.search(rf"^{name}/", layout, re.M) for name in folders), folders


def test_the_readme_sonicmoe_table_is_that_of_the_files_it_cites():
    """The same-run table beside SonicMoE: each time and each peak, rounded as printed, is the file's value for that
    case."""
    import pandas as pd

    text = README.read_text()
    results = README.parent / "data" / "results" / "H100-SXM"
    paragraph = re.search(r"SonicMoE in the same run, on one H100 .*?\n\n(.*?)\n\n", text, re.S)
    files = re.findall(r"`(2026-[^`]+\.csv)`", text[paragraph.start() : paragraph.start(1)])
    assert len(files) == 2 and all((results / name).is_file() for name in files), files
    frames = [pd.read_csv(results / name) for name in files]
    frames[0]["model"] = "P2"
    frame = pd.concat(frames)
    frame = frame[frame["impl"].isin(["triton_saved", "triton_engine_saved", "sonicmoe"])]
    frame["who"] = frame["impl"].map(lambda impl: "SonicMoE" if impl == "sonicmoe" else "ours")
    pair = r"([\d. /]+) ms, ([\d. /]+) GB"
    rows = re.findall(rf"^\| (P2|Qwen3-30B-A3B|DeepSeek-V2-Lite) \| ([\d /]+) \| {pair} \| {pair} \|$",
                      paragraph.group(1), re.M)  # fmt: skip
    assert len(rows) == 3, rows
    for model, tokens, *printed in rows:
        for who, times, peaks in (("ours", *printed[:2]), ("SonicMoE", *printed[2:])):
            for t, ms, gb in zip(tokens.split(" / "), times.split(" / "), peaks.split(" / "), strict=True):
                case = frame[(frame["model"] == model) & (frame["num_tokens"] == int(t)) & (frame["who"] == who)]
                assert f"{case['median_ms'].item():.2f}" == ms, (model, t, who)
                assert f"{case['peak_mem_gb'].item():.2f}" == gb, (model, t, who)
