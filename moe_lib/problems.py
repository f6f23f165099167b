"""The problems, defined once as data in ``data/problems/<name>/``, and the code each one runs.

Each problem folder holds
- ``definition.json`` and ``workload.jsonl`` in SOL-ExecBench's schema (name, description, axes,
  inputs, outputs, reference source; one workload per line with its tolerance), so that the
  benchmark's own harness reads them as they are;
- ``lab.json``: what this project adds: which op computes it, its short name and title, where it
  comes from, its element rule, its FLOP count, the scaled-down shapes of CPU runs and the precision of
  the reference the harness checks against.

Everything problem-specific that the bench, roofline, reports and notebooks need is a field or method
of :class:`Problem`; they loop over problems and never branch on a name. An op (the function a problem
runs) is a package of ``moe_lib`` listed once in :data:`OPS`.

>>> problem = load("swiglu_down_backward")
>>> inputs = problem.make_inputs(num_tokens=4, seed=0, hidden_size=64, intermediate_size=32)
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import moe_experts, swiglu_down
from .validation import fits_in_memory

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PROBLEMS_DIR = DATA_DIR / "problems"
PROBLEM_NAMES = ("swiglu_down_backward", "moe_experts_backward", "moe_experts_backward_bf16")

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Op:
    """The code of one op: its public function, its readable reference and its input generator."""

    name: str
    function: Callable  # the public backward: (*inputs, impl=..., validate=...) -> outputs tuple
    reference: Callable  # the readable PyTorch: (*inputs) -> outputs tuple
    make_inputs: Callable  # (sizes, dtype, device, generator, **options) -> dict name -> tensor
    input_options: tuple = ()  # keyword options of make_inputs beyond the sizes ("routing" for P2)


OPS = {
    "swiglu_down_backward": Op(
        "swiglu_down_backward",
        swiglu_down.swiglu_down_backward,
        swiglu_down.swiglu_down_backward_reference,
        swiglu_down.make_inputs,
        ("distribution",),
    ),
    "moe_experts_backward": Op(
        "moe_experts_backward",
        moe_experts.moe_experts_backward,
        moe_experts.moe_experts_backward_reference,
        moe_experts.make_inputs,
        ("routing",),
    ),
}


class ProblemFileError(ValueError):
    """A problem's data file is missing, malformed or inconsistent (the message names the file)."""


@dataclass(frozen=True)
class Problem:
    """One problem as its definition, workloads and lab metadata describe it."""

    name: str
    op: str  # the moe_lib function that computes it (a key of OPS)
    description: str
    axes: dict
    inputs: dict
    outputs: dict
    reference_source: str
    workloads: list = field(repr=False)
    short: str = ""  # "P1", "P2 fp32", ...
    title: str = ""  # "P1 · swiglu_down_backward (bf16)"
    source: str = ""  # where the problem comes from
    suite_provenance: str = "benchmark"  # "benchmark" or "assumed"
    suite_note: str = ""
    element_rule: dict | None = None  # dict(atol, rtol, required_fraction), or None: judged by relative error
    flops_coefficient: int = 0  # FLOPs of one call = coefficient · Π flops_axes
    flops_axes: tuple = ()
    small_axes: dict = field(default_factory=dict)  # scaled-down shapes for CPU runs
    small_suite: tuple = ()
    reference_precision: dict = field(default_factory=dict)  # {"full": dtype name, "small": dtype name}
    targets: tuple = ()  # the speeds the project must reach on this problem (lab/targets.py judges them)
    # FLOPs of a training step of the problem's layer, per mode, in units of Π flops_axes (bench/modes.py)
    layer_flops: dict = field(default_factory=dict)

    @property
    def spec(self) -> Op:
        """The op's code: public function, reference, input generator."""
        return OPS[self.op]

    @property
    def suite(self) -> list[int]:
        """The workload suite's token counts, in the file's order."""
        return [w["axes"]["num_tokens"] for w in self.workloads]

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the problem's main inputs."""
        return DTYPES[next(iter(self.inputs.values()))["dtype"]]

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)

    def sizes(self, num_tokens: int, **overrides) -> dict:
        """Every axis's value: the constants, ``num_tokens``, and any overrides (for small shapes)."""
        unknown = set(overrides) - set(self.axes)
        if unknown:
            raise ValueError(f"{sorted(unknown)}: not axes of {self.name} (axes: {sorted(self.axes)})")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected an integer >= 0, got {num_tokens!r}")
        sizes = {name: axis["value"] for name, axis in self.axes.items() if axis["type"] == "const"}
        sizes["num_tokens"] = num_tokens
        for name, value in overrides.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        sizes.update(overrides)
        return sizes

    def input_bytes(self, sizes: dict, dtype: torch.dtype) -> int:
        """Bytes of the inputs at ``sizes`` (from :meth:`sizes`), float inputs in ``dtype``."""
        total = 0
        for spec in self.inputs.values():
            declared = DTYPES[spec["dtype"]]
            itemsize = (dtype if declared.is_floating_point else declared).itemsize
            total += itemsize * math.prod(sizes[axis] for axis in spec["shape"])
        return total

    def element_rule_at(self, dtype: torch.dtype) -> dict | None:
        """The element rule at ``dtype``: the problem's own at its own dtype, None otherwise (an overridden
        dtype, or a problem judged by relative error alone)."""
        return self.element_rule if dtype == self.dtype else None

    def flops(self, num_tokens: int, **axes) -> int:
        """GEMM FLOPs of one call (``lab.json``'s count: coefficient × the product of its axes)."""
        sizes = self.sizes(num_tokens, **axes)
        return self.flops_coefficient * math.prod(sizes[name] for name in self.flops_axes)

    def reference_dtype(self, small: bool) -> torch.dtype:
        """The precision of the reference outputs the harness checks against (float64 where it fits)."""
        return DTYPES[self.reference_precision["small" if small else "full"]]

    def make_inputs(
        self,
        num_tokens: int,
        *,
        seed: int = 0,
        device="cpu",
        dtype=None,
        routing: str | None = None,
        distribution: str | None = None,
        **axes,
    ) -> dict:
        """Seeded inputs with the benchmark's distributions, as an ordered dict name -> tensor.

        ``dtype`` overrides the floating dtype (e.g. float64 for exact checks); ``axes`` overrides
        the constant axes (e.g. ``hidden_size=64``) to draw small cases. Problems with routing take
        ``routing``: "uniform" (the benchmark's, the default), "skewed" (Zipf-like expert popularity)
        or "hot" (every token on the same K experts). P1 takes ``distribution``: "forward" (the default:
        activations at a real layer's scale, saved tensors from the forward) or "harness" (what
        SOL-ExecBench's harness draws: std-1 activations and saved tensors, independent).
        """
        sizes = self.sizes(num_tokens, **axes)
        dtype = self.dtype if dtype is None else _draw_dtype(dtype)
        device = _draw_device(device)
        _check_seed(seed)
        fits_in_memory("num_tokens", self.input_bytes(sizes, dtype), device, f"the inputs of {num_tokens} tokens")
        options = {}
        for option, value in (("routing", routing), ("distribution", distribution)):
            if value is None:
                continue
            if option not in self.spec.input_options:
                raise ValueError(f"{option}: {self.name} has no {option} (got {option}={value!r})")
            options[option] = value
        generator = torch.Generator(device=device).manual_seed(seed)
        return self.spec.make_inputs(sizes, dtype, device, generator, **options)


DRAW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _draw_dtype(dtype) -> torch.dtype:
    if dtype not in DRAW_DTYPES:
        raise TypeError(f"dtype: expected one of {DRAW_DTYPES} (or None: the problem's), got {dtype!r}")
    return dtype


def _draw_device(device) -> torch.device:
    """``device`` as a torch.device on which inputs can be drawn (the CPU or an available CUDA device)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:<n>' or a torch.device, got {device!r}") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asks for CUDA, which is not available here")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but there are {torch.cuda.device_count()} CUDA devices")
    elif parsed.type != "cpu":
        raise ValueError(f"device: expected a CPU or CUDA device, got {device!r}")
    return parsed


def _check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: expected an integer, got {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [-2**63, 2**64), got {seed}")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ProblemFileError(f"{path}: file not found") from exc
    except json.JSONDecodeError as exc:
        raise ProblemFileError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from exc


def _read_workloads(path: Path) -> list[dict]:
    workloads = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError as exc:
        raise ProblemFileError(f"{path}: file not found") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            workload = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ProblemFileError(f"{path}: line {number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(workload.get("axes"), dict) or not isinstance(workload["axes"].get("num_tokens"), int):
            raise ProblemFileError(f"{path}: line {number}: expected axes.num_tokens, an integer")
        workloads.append(workload)
    return workloads


def _field(document: dict, key: str, path: Path):
    if key not in document:
        raise ProblemFileError(f"{path}: missing key {key!r}")
    return document[key]


@functools.cache
def load(name: str) -> Problem:
    """The problem ``name`` (one of :data:`PROBLEM_NAMES`) read from ``data/problems``."""
    if name not in PROBLEM_NAMES:
        raise ValueError(f"problem: expected one of {PROBLEM_NAMES}, got {name!r}")
    folder = PROBLEMS_DIR / name
    definition_path, lab_path = folder / "definition.json", folder / "lab.json"
    definition = _read_json(definition_path)
    lab = _read_json(lab_path)
    workloads = _read_workloads(folder / "workload.jsonl")
    op = _field(lab, "op", lab_path)
    if op not in OPS:
        raise ProblemFileError(f"{lab_path}: op {op!r} is not one of {sorted(OPS)}")
    rule = lab.get("element_rule")
    element_rule = (
        None
        if rule is None
        else dict(atol=rule["max_atol"], rtol=rule["max_rtol"], required_fraction=rule["required_matched_ratio"])
    )
    flops = _field(lab, "flops", lab_path)
    small = _field(lab, "small", lab_path)
    return Problem(
        name=_field(definition, "name", definition_path),
        op=op,
        description=definition.get("description", ""),
        axes=_field(definition, "axes", definition_path),
        inputs=_field(definition, "inputs", definition_path),
        outputs=_field(definition, "outputs", definition_path),
        reference_source=_field(definition, "reference", definition_path),
        workloads=workloads,
        short=lab.get("short", name),
        title=lab.get("title", name),
        source=lab.get("source", ""),
        suite_provenance=lab.get("suite_provenance", "benchmark"),
        suite_note=lab.get("suite_note", ""),
        element_rule=element_rule,
        flops_coefficient=int(flops["coefficient"]),
        flops_axes=tuple(flops["times"]),
        small_axes=dict(small["axes"]),
        small_suite=tuple(small["suite"]),
        reference_precision=dict(_field(lab, "reference_precision", lab_path)),
        targets=tuple(lab.get("targets", ())),
        layer_flops=dict(lab.get("layer_flops", {})),
    )


def make_inputs(name: str, num_tokens: int, **kwargs) -> dict:
    """Shorthand for ``load(name).make_inputs(num_tokens, **kwargs)``."""
    return load(name).make_inputs(num_tokens, **kwargs)
