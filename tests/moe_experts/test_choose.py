"""P2's chooser (``moe_lib.moe_experts.choose``) and the designs of kernels W and D (``moe_experts.designs``).

- The tiles and designs it picks are those the code picked before they moved into one chooser:
  ``data/p2_choices_before.json`` holds what the code of commit 1051632 chose (its ``about`` says how it was
  recorded): the launch config per (T·K, E, input bytes, interpreter), which form of kernels W and D the
  backward and the forward launched per (H, I, dtype, interpreter), and launch plans.
- A table of shapes with the designs written out, unaligned H and I, fp32, zero slots and older GPUs among them;
  each design's reasons; no import cycle in the package.
- Under the interpreter (or on the GPU), shapes whose rows TMA cannot take run the pointer-based designs and
  match float64 autograd of the dense forward (``tests/oracles.py``).
"""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_forward_dense, moe_experts_grads

from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.moe_experts.choose import choose, launch_config
from moe_lib.moe_experts.designs import SLOT_PROJECTION, WEIGHT_GRAD, SlotProjectionDesign, WeightGradDesign
from moe_lib.moe_experts.runtime import Target

BEFORE = json.loads((Path(__file__).parents[1] / "data" / "p2_choices_before.json").read_text())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HOPPER, INTERPRETER = Target(), Target(interpreter=True)
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)


def as_json(value):
    """A dataclass or dict as the JSON file holds it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value))


def designs_of(choice) -> tuple[str, str, str]:
    return choice.weight_grad.name, choice.slot_projection.name, choice.slot_projection_forward.name


# --------------------------------------------------------------------------------------------------
# the same choices as before


def test_choices_are_those_of_before_at_every_shape():
    """Every (T·K, E, H, I, dtype, interpreter) of the recorded grid: the same tiles of every kernel, and the
    same form of kernel W and of kernel D in the backward and the forward. The record predates kernel W's bf16×3
    products, so it is compared with plain ones (where the rule splits: tests/moe_experts/test_precision_rule.py)."""
    configs = {
        (r["num_slots"], r["num_experts"], r["input_bytes"], r["interpreter"]): r["config"] for r in BEFORE["configs"]
    }
    checked = 0
    for row in BEFORE["designs"]:
        H, I, interpreter = row["hidden_size"], row["intermediate_size"], row["interpreter"]
        dtype = DTYPES[row["dtype"]]
        launched = [step.split(":")[1] for step in row["backward"] if step.startswith(("W:", "D:"))]
        launched.append(next(step.split(":")[1] for step in row["forward"] if step.startswith("D:")))
        for (num_slots, E, nbytes, on_interpreter), config in configs.items():
            if (nbytes, on_interpreter) != (dtype.itemsize, interpreter):
                continue
            choice = choose(num_slots, E, H, I, dtype, Target(interpreter=interpreter), products="plain")
            where = dict(
                num_slots=num_slots,
                num_experts=E,
                **{k: v for k, v in row.items() if k in ("hidden_size", "intermediate_size", "dtype", "interpreter")},
            )
            assert as_json(choice.config) == config, where
            assert list(designs_of(choice)) == launched, where
            checked += 1
    assert checked == 6 * 3 * 7 * 3 * 2  # T·K × E × (H, I) × dtypes × interpreter or GPU


def test_launch_configs_are_those_of_before():
    for row in BEFORE["configs"]:
        config = launch_config(
            row["num_slots"], row["num_experts"], input_bytes=row["input_bytes"], interpreter=row["interpreter"]
        )
        assert as_json(config) == row["config"], {k: v for k, v in row.items() if k != "config"}


def test_launch_plans_are_those_of_before():
    from moe_lib.moe_experts.launch import launch_plan

    for row in BEFORE["plans"]:
        T, E, K, H, I = (row[k] for k in ("num_tokens", "num_experts", "top_k", "hidden_size", "intermediate_size"))
        config = launch_config(T * K, E, input_bytes=row["weight_bytes"], interpreter=row["interpreter"])
        plan = launch_plan(T, H, I, E, K, config, num_programs=132, weight_bytes=row["weight_bytes"])
        got = {step: dict(grid=k.grid, tiles=k.tiles, programs=k.programs) for step, k in plan.items()}
        assert as_json(got) == row["plan"], {k: v for k, v in row.items() if k != "plan"}


# --------------------------------------------------------------------------------------------------
# the chooser's table

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (T·K, E, H, I, dtype, target) -> designs of kernel W, kernel D in the backward, kernel D in the forward
TABLE = [
    ((16384, 256, 4096, 2048, BF16, HOPPER), ("tma", "tma", "tma")),  # the benchmark's shape, 2048 tokens
    ((16384, 256, 4096, 2048, F32, HOPPER), ("tma", "tma", "tma")),  # fp32: W's operands are bf16 workspaces
    ((262144, 256, 4096, 2048, F16, HOPPER), ("tma", "tma", "tma")),
    ((0, 4, 4096, 2048, BF16, HOPPER), ("tma", "tma", "tma")),  # zero slots: W still writes the zeros
    ((26, 3, 40, 24, F32, INTERPRETER), ("tma", "tma", "tma")),  # 80- and 48-byte rows: whole 16-byte multiples
    ((16384, 256, 1000, 2048, BF16, HOPPER), ("tma", "tma", "tma")),  # H = 1000 in bf16: 2000 bytes, 125 × 16
    ((16384, 256, 1004, 2048, BF16, HOPPER), ("pointer", "pointer", "tma")),  # 2008 bytes; the forward reads I
    ((16384, 256, 1004, 2048, F32, HOPPER), ("pointer", "tma", "tma")),  # fp32 weights: 4016 bytes; x, dy: 2008
    ((0, 3, 1004, 2048, F32, INTERPRETER), ("pointer", "tma", "tma")),
    ((16384, 256, 4096, 300, BF16, HOPPER), ("pointer", "pointer", "pointer")),  # I = 300: 600 bytes
    ((16384, 256, 4096, 300, F32, INTERPRETER), ("pointer", "pointer", "pointer")),
    ((26, 3, 36, 20, F16, INTERPRETER), ("pointer", "pointer", "pointer")),
    ((26, 3, 36, 24, F32, INTERPRETER), ("pointer", "tma", "tma")),  # fp32 weights of H = 36: 144 bytes
    ((26, 3, 36, 24, BF16, INTERPRETER), ("pointer", "pointer", "tma")),
    ((16384, 256, 4096, 2048, BF16, Target(capability=(8, 0))), ("pointer", "pointer", "pointer")),  # no TMA
    ((16384, 256, 4096, 2048, BF16, Target(capability=(10, 0))), ("tma", "tma", "tma")),
]


@pytest.mark.parametrize("arguments, designs", TABLE, ids=lambda v: "-".join(map(str, v)).replace("torch.", ""))
def test_chooser_picks_the_designs_of_the_table(arguments, designs):
    assert designs_of(choose(*arguments)) == designs


def test_a_config_without_tma_tiles_asks_for_the_pointer_designs():
    config = dataclasses.replace(launch_config(16384, 256, input_bytes=2), tma_weight_grad=None)
    assert designs_of(choose(16384, 256, 4096, 2048, BF16, HOPPER, config=config)) == ("pointer", "tma", "tma")
    config = dataclasses.replace(config, tma_slot_projection=None)
    choice = choose(16384, 256, 4096, 2048, BF16, HOPPER, config=config)
    assert designs_of(choice) == ("pointer", "pointer", "pointer") and choice.config is config


def test_weights_at_an_unaligned_address_get_the_pointer_based_kernel_d():
    choice = choose(16384, 256, 4096, 2048, BF16, HOPPER, weights_aligned=False)
    assert designs_of(choice) == ("tma", "pointer", "pointer")


def test_a_dtype_no_design_takes_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^dtype torch.float64: the kernels take float32, bfloat16 or float16$"):
        choose(16, 4, 64, 32, torch.float64, HOPPER)


def test_a_config_of_another_type_is_refused_before_any_work(monkeypatch):
    from moe_lib.moe_experts import launch, runtime

    inputs = problems.make_inputs(
        "moe_experts_backward", 3, hidden_size=16, intermediate_size=8, num_experts=2, top_k=1
    )
    monkeypatch.setattr(runtime, "allocate", None)  # allocating anything would fail with another error
    with pytest.raises(TypeError, match=r"^config: expected a LaunchConfig or None, got dict$"):
        launch.moe_experts_backward_triton(*inputs.values(), config={"block_m": 16})


def test_each_design_answers_why_it_cannot_run():
    tma_w, tma_d = WEIGHT_GRAD["tma"], SLOT_PROJECTION["tma"]
    assert tma_w.supports(4096, 2048, F32, HOPPER) is None and tma_d.supports(4096, 2048, F32, HOPPER) is None
    assert tma_w.supports(1004, 2048, BF16, HOPPER) == (
        "rows of H = 1004 bfloat16 elements (2008 bytes) are no multiple of 16 bytes, as TMA needs"
    )
    assert tma_w.supports(4096, 300, F32, INTERPRETER) == (
        "rows of I = 300 bfloat16 elements (600 bytes) are no multiple of 16 bytes, as TMA needs"
    )
    assert tma_d.supports(1002, 2048, F32, HOPPER) == (
        "weight rows of H = 1002 float32 elements (4008 bytes) are no multiple of 16 bytes, as TMA needs"
    )
    assert tma_d.supports(1002, 2048, F32, HOPPER, transposed_weights=False) is None  # the forward reads Wd's I
    assert tma_d.supports(4096, 300, F16, HOPPER, transposed_weights=False) == (
        "rows of I = 300 float16 elements (600 bytes) are no multiple of 16 bytes, as TMA needs"
    )
    assert tma_d.supports(4096, 2048, BF16, HOPPER, weights_aligned=False) == (
        "the weights' base address is not 16-byte aligned, as TMA needs"
    )
    for design in (tma_w, tma_d):
        assert design.supports(4096, 2048, BF16, Target(capability=(8, 9))) == (
            "TMA needs a GPU of compute capability 9.0 (Hopper) or later, got 8.9"
        )
        assert design.supports(4096, 2048, torch.float64, HOPPER) == (
            "dtype torch.float64: the kernels take float32, bfloat16 or float16"
        )
    for design in (WEIGHT_GRAD["pointer"], SLOT_PROJECTION["pointer"]):  # any shape, any GPU
        assert design.supports(1002, 300, F16, Target(capability=(7, 0))) is None
        assert design.supports(1002, 300, torch.float64, HOPPER) is not None


def test_the_registries_hold_designs_of_their_kernel_interface():
    assert list(WEIGHT_GRAD) == list(SLOT_PROJECTION) == ["tma", "pointer"]  # the preferred first
    assert all(isinstance(d, WeightGradDesign) and d.needs for d in WEIGHT_GRAD.values())
    assert all(isinstance(d, SlotProjectionDesign) and d.needs for d in SLOT_PROJECTION.values())


def test_the_package_has_no_import_cycle():
    """Every import between modules of ``moe_lib.moe_experts``, those inside functions included."""
    root = Path(__file__).resolve().parents[2] / "moe_lib"
    modules = {}  # dotted name -> path, for the modules of moe_lib.moe_experts
    for path in (root / "moe_experts").rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:  # from .x import y, from .. import z
                stem = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets |= {f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):  # absolute: import moe_lib.x, from moe_lib.x import y
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                targets |= set(names)
        edges[name] = targets & set(modules)
    assert edges["moe_lib.moe_experts.designs"] >= {"moe_lib.moe_experts.designs.w_tma", "moe_lib.moe_experts.config"}
    assert "moe_lib.moe_experts.launch" in edges["moe_lib.moe_experts.api"]  # an import inside a function

    done = set()

    def visit(name, path):  # depth first; a module met again on its own path closes a cycle
        assert name not in path, f"import cycle: {' -> '.join([*path[path.index(name) :], name])}"
        if name not in done:
            for target in edges[name]:
                visit(target, [*path, name])
            done.add(name)

    for name in modules:
        visit(name, [])


# --------------------------------------------------------------------------------------------------
# shapes TMA cannot take run the pointer-based designs, against float64

FP32_TOLERANCE = dict(grad_hidden_states=5e-3, grad_topk_weights=1e-4, grad_gate=5e-3, grad_up=5e-3, grad_down=5e-3)
BF16_TOLERANCE = dict.fromkeys(FP32_TOLERANCE, 2e-2)


@needs_triton
@pytest.mark.parametrize(
    "dtype, hidden_size, intermediate_size, designs",
    [
        (F32, 36, 20, ("pointer", "pointer", "pointer")),
        (BF16, 36, 20, ("pointer", "pointer", "pointer")),
        (F32, 36, 24, ("pointer", "tma", "tma")),
        (BF16, 36, 24, ("pointer", "pointer", "tma")),
    ],
)
def test_unaligned_shapes_run_the_pointer_designs_against_float64(
    dtype, hidden_size, intermediate_size, designs, seed, monkeypatch
):
    """E 3, K 2, 13 tokens, H and I whose rows are no multiple of 16 bytes: every output written (NaN-filled
    allocations) and within the tolerance of float64 autograd of the dense forward, the forward too."""
    import moe_lib
    from moe_lib.moe_experts import launch, runtime

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs(
        "moe_experts_backward",
        13,
        seed=seed,
        device=device,
        dtype=dtype,
        routing="skewed",
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_experts=3,
        top_k=2,
    )
    target = Target.of(torch.device(device))
    assert designs_of(choose(13 * 2, 3, hidden_size, intermediate_size, dtype, target)) == designs
    monkeypatch.setattr(runtime, "allocate", lambda *a, **k: torch.full(*a, float("nan"), **k))
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    want = moe_experts_grads(*inputs.values())
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    for (name, limit), g, w in zip(tolerance.items(), got, want, strict=True):
        assert g.dtype == inputs["hidden_states"].dtype or name == "grad_topk_weights", name
        assert rel_error(g, w) <= limit, (name, rel_error(g, w))
    forward_inputs = [
        inputs[n]
        for n in ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")
    ]
    y = launch.moe_experts_forward_triton(*forward_inputs)
    y_want = moe_experts_forward_dense(*[t.double() if t.is_floating_point() else t for t in forward_inputs])
    assert rel_error(y, y_want) <= tolerance["grad_hidden_states"]
