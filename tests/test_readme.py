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
