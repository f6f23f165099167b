"""P2's choices of tiles and designs, against those the code made before they moved into one chooser.

``data/p2_choices_before.json`` holds what the code of commit 1051632 chose (its ``about`` says how it was
recorded): the launch config per (T·K, E, input bytes, interpreter), and the launch plan per shape. Every
choice must stay as it was on the GPU and under the interpreter.
"""

import dataclasses
import json
from pathlib import Path

BEFORE = json.loads((Path(__file__).parent / "data" / "p2_choices_before.json").read_text())


def as_json(value):
    """A dataclass or dict as the JSON file holds it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value))


def test_launch_configs_are_those_of_before():
    from moe_lib.moe_experts.launch import launch_config

    for row in BEFORE["configs"]:
        config = launch_config(row["num_slots"], row["num_experts"], input_bytes=row["input_bytes"],
                               interpreter=row["interpreter"])  # fmt: skip
        assert as_json(config) == row["config"], {k: v for k, v in row.items() if k != "config"}


def test_launch_plans_are_those_of_before():
    from moe_lib.moe_experts.launch import launch_config, launch_plan

    for row in BEFORE["plans"]:
        T, E, K, H, I = (row[k] for k in ("num_tokens", "num_experts", "top_k", "hidden_size", "intermediate_size"))
        config = launch_config(T * K, E, input_bytes=row["weight_bytes"], interpreter=row["interpreter"])
        plan = launch_plan(T, H, I, E, K, config, num_programs=132, weight_bytes=row["weight_bytes"])
        got = {step: dict(grid=k.grid, tiles=k.tiles, programs=k.programs) for step, k in plan.items()}
        assert as_json(got) == row["plan"], {k: v for k, v in row.items() if k != "plan"}
