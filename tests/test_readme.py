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


def test_the_readme_p1_case_table_is_that_of_the_files_it_cites():
    """The README's P1 table, case by case, holds the committed runs it names (rounded to 0.1 µs; bold exactly where
    the fast path is ahead of torch.compile): updating those files means updating the table."""
    import json

    import numpy as np
    import pandas as pd

    text = README.read_text()
    graph_file = re.search(r"P1 case by case, µs \(graph replay: `([^`]+)`", text).group(1)
    official_file = re.search(r"NVIDIA's\nharness: `([^`]+)`", text).group(1)
    root = README.parent
    runs = pd.read_csv(root / graph_file)
    graph = runs.pivot_table(index="num_tokens", columns="impl", values="median_ms") * 1000
    official = {w["num_tokens"]: w["latency_ms"] * 1000
                for w in json.loads((root / official_file).read_text())["workloads"]}  # fmt: skip
    rows = re.findall(r"^\| (\d+|geomean) \| ([\d.]+) \| (\**)([\d.]+)\** \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [row[0] for row in rows[:-1]] == [str(T) for T in graph.index] and rows[-1][0] == "geomean"

    def geomean(values):
        return float(np.exp(np.log(np.asarray(list(values))).mean()))

    for label, faithful, bold, fast, compiled, harness in rows:
        if label == "geomean":
            want = (geomean(graph["triton"]), geomean(graph["triton_fast"]), geomean(graph["torch_compile"]),
                    geomean(official.values()))  # fmt: skip
        else:
            T = int(label)
            want = (graph.loc[T, "triton"], graph.loc[T, "triton_fast"], graph.loc[T, "torch_compile"], official[T])
            assert bool(bold) == (want[1] < want[2]), T
        assert [float(v) for v in (faithful, fast, compiled, harness)] == [round(float(w), 1) for w in want], label
