"""The problem files in the schema of SOL-ExecBench's harness, exactly, so that it reads them unchanged.

Checked here against the schema as its documentation (docs/definition.md, docs/workload.md of the
public repository NVIDIA/SOL-ExecBench) states it, and, where its package is importable (a copy of its
src/ on PYTHONPATH), against its own pydantic models. P2's routing inputs come from the definition's
``custom_inputs_entrypoint`` (random integers would not be valid routing): it must draw what
``moe_lib.problems.make_inputs`` draws.
"""

import json
import math

import pytest
import torch

from moe_lib import problems

DEFINITION_KEYS = {
    "name",
    "op_type",
    "axes",
    "custom_inputs_entrypoint",
    "inputs",
    "outputs",
    "reference",
    "description",
    "hf_id",
}
WORKLOAD_KEYS = {"uuid", "axes", "inputs", "tolerance"}
TOLERANCE_KEYS = {"max_atol", "max_rtol", "required_matched_ratio", "max_error_cap", "allow_negative_inf"}
INPUT_TYPES = {"random", "scalar", "safetensors", "custom"}
DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def files(name: str):
    folder = problems.PROBLEMS_DIR / name
    definition = json.loads((folder / "definition.json").read_text())
    workloads = [json.loads(line) for line in (folder / "workload.jsonl").read_text().splitlines() if line.strip()]
    return definition, workloads


@pytest.mark.parametrize("name", problems.PROBLEM_NAMES)
def test_files_follow_the_documented_schema(name):
    definition, workloads = files(name)
    assert set(definition) <= DEFINITION_KEYS and definition["name"] == name
    for axis in definition["axes"].values():
        assert axis["type"] in ("const", "var") and (axis["type"] == "var" or isinstance(axis["value"], int))
    for spec in [*definition["inputs"].values(), *definition["outputs"].values()]:
        assert spec["dtype"] in DTYPES and set(spec["shape"]) <= set(definition["axes"])
    namespace = {}
    exec(compile(definition["reference"], f"{name}/definition.json", "exec"), namespace)
    assert callable(namespace["run"])
    entrypoint = definition.get("custom_inputs_entrypoint")
    assert entrypoint is None or callable(namespace[entrypoint])
    uuids = set()
    for workload in workloads:
        assert set(workload) <= WORKLOAD_KEYS and workload["uuid"] not in uuids
        uuids.add(workload["uuid"])
        assert set(workload["axes"]) == {n for n, a in definition["axes"].items() if a["type"] == "var"}
        assert set(workload["inputs"]) == set(definition["inputs"])
        kinds = {spec["type"] for spec in workload["inputs"].values()}
        assert kinds <= INPUT_TYPES and (kinds == {"custom"}) == (entrypoint is not None), kinds
        assert set(workload.get("tolerance", {})) <= TOLERANCE_KEYS


def test_tolerances_match_the_element_rules():
    for name in problems.PROBLEM_NAMES:
        rule = problems.load(name).element_rule
        for workload in files(name)[1]:
            if rule is None:
                assert "tolerance" not in workload
            else:
                assert workload["tolerance"] == dict(
                    max_atol=rule["atol"], max_rtol=rule["rtol"], required_matched_ratio=rule["required_fraction"]
                )


@pytest.mark.parametrize("name", ["moe_experts_backward", "moe_experts_backward_bf16"])
def test_p2_custom_inputs_draw_valid_routing_with_our_distributions(name):
    definition, _ = files(name)
    namespace = {}
    exec(compile(definition["reference"], f"{name}/definition.json", "exec"), namespace)
    sizes = dict(num_tokens=300, hidden_size=64, intermediate_size=32, num_experts=16, top_k=4)
    got = namespace[definition["custom_inputs_entrypoint"]](sizes, torch.device("cpu"))
    ours = problems.make_inputs(name, 300, hidden_size=64, intermediate_size=32, num_experts=16, top_k=4)
    assert list(got) == list(definition["inputs"]) == list(ours)
    for key, spec in definition["inputs"].items():
        assert problems.dtype_name(got[key].dtype) == spec["dtype"] == problems.dtype_name(ours[key].dtype), key
        assert got[key].shape == ours[key].shape, key
        if got[key].is_floating_point():
            assert math.isclose(got[key].float().std().item(), ours[key].float().std().item(), rel_tol=0.15), key
    indices = got["topk_indices"]
    assert int(indices.min()) >= 0 and int(indices.max()) < 16
    assert (indices.sort(dim=1).values.diff(dim=1) > 0).all()  # K distinct experts per token
    torch.testing.assert_close(got["topk_weights"].sum(dim=1), torch.ones(300))
    outputs = namespace["run"](*got.values())  # the reference runs on them
    want = problems.load(name).spec.reference(*ours.values())
    assert [tuple(o.shape) for o in outputs] == [tuple(w.shape) for w in want]


def test_files_load_in_the_harness_models():
    definition_module = pytest.importorskip("sol_execbench.core.data.definition")
    workload_module = pytest.importorskip("sol_execbench.core.data.workload")
    for name in problems.PROBLEM_NAMES:
        folder = problems.PROBLEMS_DIR / name
        parsed = definition_module.Definition.model_validate_json((folder / "definition.json").read_text())
        assert parsed.name == name
        for line in (folder / "workload.jsonl").read_text().splitlines():
            workload = workload_module.Workload.model_validate_json(line)
            rule = problems.load(name).element_rule
            if rule is not None:  # the names are the harness's: its defaults (1e-2, 1e-2) would replace ours
                assert (workload.tolerance.max_atol, workload.tolerance.max_rtol) == (rule["atol"], rule["rtol"])
