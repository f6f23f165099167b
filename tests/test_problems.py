"""The problem definitions and the seeded input generators."""

import json
import math

import pytest
import torch

from moe_lib import problems

P1_SUITE = [3089, 128, 2, 1, 8192, 1321, 8, 1571, 4, 16, 1087, 2447, 7168, 2767, 512, 4093]
P2_SUITE = [2447, 2048, 2080, 2131, 2112, 3072, 2144, 2176, 2208, 2240, 2767, 2272, 3803, 8192, 2304, 2336]


def test_definitions_follow_the_schema():
    for name in problems.PROBLEM_NAMES:
        definition = json.loads((problems.PROBLEMS_DIR / name / "definition.json").read_text())
        for key in ("name", "description", "axes", "inputs", "outputs", "reference"):
            assert key in definition, (name, key)
        assert definition["name"] == name
        for axis in definition["axes"].values():
            assert axis["type"] in ("const", "var")
            assert axis["type"] == "var" or isinstance(axis["value"], int)
        for spec in list(definition["inputs"].values()) + list(definition["outputs"].values()):
            assert set(spec["shape"]) <= set(definition["axes"])
            assert spec["dtype"] in ("bfloat16", "float32", "int64")
        lines = (problems.PROBLEMS_DIR / name / "workload.jsonl").read_text().splitlines()
        for line in lines:
            workload = json.loads(line)
            assert set(workload) >= {"uuid", "axes", "inputs"}
            assert set(workload["inputs"]) == set(definition["inputs"])
            # the benchmark harness's names: other keys would be silently ignored there
            assert set(workload.get("tolerance", {})) <= {"max_atol", "max_rtol", "required_matched_ratio"}


# the keys of SOL-ExecBench's Definition model; what the project adds lives in lab.json beside it
HARNESS_DEFINITION_KEYS = {
    "name",
    "op_type",
    "axes",
    "custom_inputs_entrypoint",
    "inputs",
    "outputs",
    "reference",
    "tags",
    "description",
    "hf_id",
}


def test_definition_holds_only_the_harness_keys_and_lab_json_the_rest():
    for name in problems.PROBLEM_NAMES:
        definition = json.loads((problems.PROBLEMS_DIR / name / "definition.json").read_text())
        assert set(definition) <= HARNESS_DEFINITION_KEYS, (name, set(definition) - HARNESS_DEFINITION_KEYS)
        problem = problems.load(name)
        assert problem.op in problems.OPS and problem.short and problem.title and problem.source
        assert problem.flops(100) > 0 and problem.small_suite and problem.small_axes
        assert problem.reference_dtype(small=True) == torch.float64


def test_element_rules_as_the_benchmark_states_them():
    p1, p2, bf16 = (problems.load(name) for name in problems.PROBLEM_NAMES)
    assert p1.element_rule == dict(atol=1e-2, rtol=1e-2, required_fraction=0.99)
    assert p2.element_rule == dict(atol=0.11, rtol=1e-5, required_fraction=0.99)
    assert bf16.element_rule is None
    assert p2.element_rule_at(torch.float32) == p2.element_rule and p2.element_rule_at(torch.bfloat16) is None
    for workload in p2.workloads:
        assert workload["tolerance"] == dict(max_atol=0.11, max_rtol=1e-5, required_matched_ratio=0.99)


def test_flop_counts():
    assert problems.load("swiglu_down_backward").flops(7) == 12 * 7 * 2048 * 768
    assert problems.load("moe_experts_backward").flops(3, top_k=2) == 16 * 3 * 2 * 4096 * 2048


def test_routing_is_refused_where_a_problem_has_none():
    with pytest.raises(ValueError, match="routing: swiglu_down_backward has no routing"):
        problems.make_inputs("swiglu_down_backward", 2, hidden_size=16, intermediate_size=8, routing="hot")
    with pytest.raises(ValueError, match="routing: expected one of"):
        problems.make_inputs(
            "moe_experts_backward", 2, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2, routing="zipf"
        )


def test_malformed_files_are_named_with_their_line(tmp_path, monkeypatch):
    source = problems.PROBLEMS_DIR / "swiglu_down_backward"
    folder = tmp_path / "swiglu_down_backward"
    folder.mkdir()
    for file in ("definition.json", "lab.json"):
        (folder / file).write_text((source / file).read_text())
    lines = (source / "workload.jsonl").read_text().splitlines()
    (folder / "workload.jsonl").write_text("\n".join([lines[0], lines[1][:-5], *lines[2:]]) + "\n")
    monkeypatch.setattr(problems, "PROBLEMS_DIR", tmp_path)
    problems.load.cache_clear()
    try:
        with pytest.raises(problems.ProblemFileError, match=r"workload.jsonl: line 2: not valid JSON"):
            problems.load("swiglu_down_backward")
        (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
        (folder / "lab.json").write_text('{\n  "op": "nonsense",\n')
        with pytest.raises(problems.ProblemFileError, match=r"lab.json: line 3: not valid JSON"):
            problems.load("swiglu_down_backward")
    finally:
        problems.load.cache_clear()


def test_suites_and_provenance():
    p1 = problems.load("swiglu_down_backward")
    assert p1.suite == P1_SUITE and p1.suite_provenance == "benchmark"
    assert p1.sizes(5) == dict(num_tokens=5, hidden_size=2048, intermediate_size=768)
    p2 = problems.load("moe_experts_backward")
    assert p2.suite == P2_SUITE and p2.suite_provenance == "assumed"
    assert p2.dtype == torch.float32
    assert p2.sizes(2048) == dict(num_tokens=2048, hidden_size=4096, intermediate_size=2048, num_experts=256, top_k=8)
    bf16 = problems.load("moe_experts_backward_bf16")
    assert bf16.dtype == torch.bfloat16 and bf16.op == "moe_experts_backward"
    assert set(bf16.suite) >= {2048, 8192, 32768}


def test_p1_generator_statistics_and_saved_forward(seed):
    H, I, T = 512, 256, 300
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, hidden_size=H, intermediate_size=I)
    assert list(inputs) == list(problems.load("swiglu_down_backward").inputs)
    std = {k: v.float().std().item() for k, v in inputs.items()}
    for name, want in (
        ("gate_weight", 1 / math.sqrt(H)),
        ("up_weight", 1 / math.sqrt(H)),
        ("down_weight", 1 / math.sqrt(I)),
        ("x", 1 / math.sqrt(H)),
        ("grad_output", 1 / math.sqrt(H)),
    ):
        assert abs(std[name] / want - 1) < 0.05, name
    f = {k: v.float() for k, v in inputs.items()}
    gate = (f["x"] @ f["gate_weight"].T).bfloat16()
    assert torch.equal(inputs["gate"], gate)
    assert torch.equal(inputs["gate_sigmoid"], torch.sigmoid(gate.float()).bfloat16())
    assert torch.equal(inputs["gate_silu"], (gate.float() * inputs["gate_sigmoid"].float()).bfloat16())
    assert torch.equal(inputs["intermediate"], (f["gate_silu"] * f["up"]).bfloat16())


def test_p2_generator_statistics(seed):
    T, E, K = 4000, 16, 4
    inputs = problems.make_inputs(
        "moe_experts_backward", T, seed=seed, hidden_size=64, intermediate_size=32, num_experts=E, top_k=K
    )
    idx = inputs["topk_indices"]
    assert idx.dtype == torch.int64 and idx.shape == (T, K)
    assert (idx.sort(dim=1).values.diff(dim=1) > 0).all(), "experts within a token must be distinct"
    counts = torch.bincount(idx.flatten(), minlength=E).double()
    expected = T * K / E
    assert ((counts - expected).abs() < 6 * math.sqrt(expected)).all(), counts
    w = inputs["topk_weights"]
    assert torch.allclose(w.sum(dim=1), torch.ones(T)) and (w > 0).all()
    for name in ("gate_weights", "up_weights", "down_weights"):
        assert abs(inputs[name].std().item() / 0.02 - 1) < 0.02, name
        assert abs(inputs[name].mean().item()) < 1e-3
    for name in ("grad_output", "hidden_states"):
        assert abs(inputs[name].std().item() - 1) < 0.05


def test_routing_variants(seed):
    kwargs = dict(seed=seed, hidden_size=8, intermediate_size=4, num_experts=32, top_k=4)
    hot = problems.make_inputs("moe_experts_backward", 500, routing="hot", **kwargs)["topk_indices"]
    assert hot.unique().numel() == 4
    skewed = problems.make_inputs("moe_experts_backward", 4000, routing="skewed", **kwargs)["topk_indices"]
    assert (skewed.sort(dim=1).values.diff(dim=1) > 0).all()
    counts = torch.bincount(skewed.flatten(), minlength=32)
    assert counts[:4].sum() > 2 * counts[-4:].sum()  # popular experts get far more tokens


def test_generator_is_seeded_and_fresh():
    kwargs = dict(hidden_size=16, intermediate_size=8)
    a = problems.make_inputs("swiglu_down_backward", 5, seed=3, **kwargs)
    b = problems.make_inputs("swiglu_down_backward", 5, seed=3, **kwargs)
    c = problems.make_inputs("swiglu_down_backward", 5, seed=4, **kwargs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["x"], c["x"])


def test_bf16_variant_dtypes():
    inputs = problems.make_inputs(
        "moe_experts_backward_bf16", 6, seed=0, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2
    )
    assert inputs["hidden_states"].dtype == torch.bfloat16
    assert inputs["topk_weights"].dtype == torch.float32


def test_bad_generator_arguments():
    with pytest.raises(ValueError, match="problem"):
        problems.load("nope")
    with pytest.raises(ValueError, match="num_tokens"):
        problems.make_inputs("swiglu_down_backward", -1)
    with pytest.raises(ValueError, match="hiden_size"):
        problems.make_inputs("swiglu_down_backward", 1, hiden_size=4)
    with pytest.raises(ValueError, match="routing"):
        problems.make_inputs("moe_experts_backward", 2, routing="zipf", hidden_size=4, intermediate_size=4)
    with pytest.raises(ValueError, match="top_k"):
        problems.make_inputs("moe_experts_backward", 2, num_experts=2, top_k=3, hidden_size=4, intermediate_size=4)
