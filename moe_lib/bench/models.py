"""The model suite: both problems at the expert shapes of public MoE models (``python -m moe_lib.bench --models``).

The benchmark's problems have one shape each; a user's model has its own. :data:`MODEL_SHAPES` lists the
expert shapes of public MoE models (and one shape whose rows are not 16-byte multiples), each once, as data.
:func:`run` checks and times, for every selected problem, each model's shape at the problem's token counts
(:data:`TOKENS`) with the implementations of :data:`IMPLS`, through the benchmark's own harness
(:func:`moe_lib.bench.harness.run_shape`: the same high-precision reference, NaN-poisoned allocation,
CUDA-graph replays after an L2 flush, cases that do not fit the device skipped with a row that says so).

One file per problem, dtype and mode (:func:`model_stem`):
``<out>/<gpu key>/<date>-<problem>-<dtype>[-<mode>][-small]-models[-<suffix>].csv`` and the JSON beside it, with
``suite: "models"`` in the JSON and the columns ``model``, ``hidden_size``, ``intermediate_size`` (and for
P2 ``num_experts``, ``top_k``) in every row. A run split by ``--model`` or ``--problem`` (each command of the
GPU machine has a time limit) writes one file per part; :func:`moe_lib.lab.models.load_model_runs` reads
them all back, the newest row of each (model, token count, implementation).

P1's ``torch_compile`` here is :class:`TokenDynamicCompile`: compiled once per shape with the token
dimension dynamic, not afresh for every case as the benchmark's peer does (8 shapes × 7 token counts of
static compilations would not fit the GPU machine's time limit).

With ``--mode forward`` or ``forward_backward`` the suite times a training step of each problem's layer
instead of its function (:mod:`.modes`: the layer peers, checked against the reference layer, their peak
memory and the step's FLOPs recorded as the single-shape layer runs do), with the token counts of
:data:`LAYER_TOKENS` and the implementations of :data:`LAYER_IMPLS` by default. The mode is part of the
files' names (``...-<dtype>-forward_backward-models...``, :func:`model_stem`) and of every row and JSON, so
that its files stand beside the function's and :func:`moe_lib.lab.models.load_model_runs` reads one mode
at a time.

Without CUDA (``small``), every shape is scaled down (:func:`small_axes`) and the token counts are
:data:`SMALL_TOKENS`, so that the suite runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys

import pandas as pd
import torch
from tqdm import tqdm

from .. import problems
from . import harness, modes, results
from .peers import Peer, peers_for
from .peers.swiglu_down import eager_arguments, swiglu_down_backward_eager
from .provenance import gpu_key

P1 = "swiglu_down_backward"
SHAPE_AXES = {  # the axes of a problem of each op that a model's shape sets
    "swiglu_down_backward": ("hidden_size", "intermediate_size"),
    "moe_experts_backward": ("hidden_size", "intermediate_size", "num_experts", "top_k"),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The routed experts of one model: every expert is a SwiGLU of ``hidden_size`` → ``intermediate_size``
    → ``hidden_size``; each token goes to ``top_k`` of ``num_experts`` experts (None for a P1-only shape)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int | None
    top_k: int | None
    source: str  # where the numbers come from

    def axes(self, op: str) -> dict:
        """The axes of this shape that override the constant ones of a problem of ``op``."""
        return {name: getattr(self, name) for name in SHAPE_AXES[op]}


MODEL_SHAPES = (
    ModelShape(
        "Qwen3-30B-A3B",
        2048,
        768,
        128,
        8,
        "Qwen/Qwen3-30B-A3B config.json: hidden_size, moe_intermediate_size, num_experts, num_experts_per_tok",
    ),
    ModelShape(
        "Qwen3-235B-A22B",
        4096,
        1536,
        128,
        8,
        "Qwen/Qwen3-235B-A22B config.json: hidden_size, moe_intermediate_size, num_experts, num_experts_per_tok",
    ),
    ModelShape(
        "DeepSeek-V3",
        7168,
        2048,
        256,
        8,
        "deepseek-ai/DeepSeek-V3 config.json: hidden_size, moe_intermediate_size, n_routed_experts, "
        "num_experts_per_tok (its shared expert left out)",
    ),
    ModelShape(
        "Mixtral-8x7B",
        4096,
        14336,
        8,
        2,
        "mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size, intermediate_size, num_local_experts, "
        "num_experts_per_tok",
    ),
    ModelShape(
        "gpt-oss-20b",
        2880,
        2880,
        32,
        4,
        "openai/gpt-oss-20b config.json: hidden_size, intermediate_size, num_local_experts, "
        "num_experts_per_tok (gpt-oss-120b: the same expert, 128 experts); its clamped SwiGLU and "
        "biases are not modelled",
    ),
    ModelShape(
        "OLMoE-1B-7B",
        2048,
        1024,
        64,
        8,
        "allenai/OLMoE-1B-7B-0924 config.json: hidden_size, intermediate_size, num_experts, num_experts_per_tok",
    ),
    ModelShape(
        "DeepSeek-V2-Lite",
        2048,
        1408,
        64,
        6,
        "deepseek-ai/DeepSeek-V2-Lite config.json: hidden_size, moe_intermediate_size, n_routed_experts, "
        "num_experts_per_tok (its shared experts left out)",
    ),
    ModelShape(
        "unaligned-1000x300",
        1000,
        300,
        None,
        None,
        "no model: rows of 300 bf16 values (600 bytes) are not 16-byte multiples, so that kernels "
        "relying on aligned rows are tried where they must not be",
    ),
)
MODEL_NAMES = tuple(model.name for model in MODEL_SHAPES)

TOKENS = {  # the token counts of each problem in the suite
    "swiglu_down_backward": (1, 7, 64, 256, 1024, 4096, 16384),
    "moe_experts_backward_bf16": (512, 4096, 32768),
    "moe_experts_backward": (4096,),
}
SMALL_TOKENS = {  # without CUDA: a few small ones, odd among them
    "swiglu_down_backward": (1, 7, 33),
    "moe_experts_backward_bf16": (5, 64),
    "moe_experts_backward": (24,),
}
IMPLS = {  # the implementations timed, per op: ours and the PyTorch peers they must beat
    "swiglu_down_backward": ("triton", "triton_fast", "torch_eager", "torch_compile"),
    "moe_experts_backward": ("triton", "grouped_mm"),
}
LAYER_TOKENS = {  # the token counts of a training step of each problem's layer (--mode forward, forward_backward)
    "swiglu_down_backward": (1024, 4096, 16384),
    "moe_experts_backward_bf16": (2048, 8192, 32768),
    "moe_experts_backward": (4096,),
}
LAYER_IMPLS = {  # the layer peers timed in a training step, per op: ours, PyTorch's and SonicMoE's
    "swiglu_down_backward": ("triton", "torch_eager"),  # torch_compile's layer compiles afresh for every case
    "moe_experts_backward": ("triton_engine_saved", "triton_saved", "grouped_mm", "sonicmoe"),
}

SMALL_DIVISOR = 32  # small shapes: every size divided by this ...
SMALL_MAX_EXPERTS = 16  # ... and at most this many experts
ALIGNMENT = 8  # bf16 values in 16 bytes: an aligned size stays a multiple of this when scaled down


def models_of(problem: problems.Problem, names=None) -> list[ModelShape]:
    """The shapes among ``names`` (default: all) that ``problem`` runs: P2 needs experts and routing."""
    chosen = [model for model in MODEL_SHAPES if names is None or model.name in names]
    return [model for model in chosen if problem.op == P1 or model.num_experts is not None]


def scale_down(size: int) -> int:
    """``size`` divided by :data:`SMALL_DIVISOR`, staying a multiple of :data:`ALIGNMENT` (at least one) where it
    is one, and staying off multiples of it where it is not (an unaligned shape stays unaligned)."""
    if size % ALIGNMENT == 0:
        return ALIGNMENT * max(1, round(size / (ALIGNMENT * SMALL_DIVISOR)))
    small = max(1, size // SMALL_DIVISOR)
    return small + 1 if small % ALIGNMENT == 0 else small


def small_axes(model: ModelShape, op: str) -> dict:
    """The scaled-down axes of ``model`` for CPU runs: sizes by :func:`scale_down`, at most
    :data:`SMALL_MAX_EXPERTS` experts (top_k unchanged)."""
    axes = {name: scale_down(value) for name, value in model.axes(P1).items()}  # H and I
    if op == "moe_experts_backward":
        axes.update(num_experts=min(model.num_experts, SMALL_MAX_EXPERTS), top_k=model.top_k)
    return axes


def shape_axes(model: ModelShape, op: str, small: bool) -> dict:
    """The axes a run of ``model`` uses: its own, or scaled down when ``small``."""
    return small_axes(model, op) if small else model.axes(op)


def shape_columns(op: str) -> list[str]:
    """The columns every row of a model-suite file of ``op`` carries: the model and its shape's axes."""
    return ["model", *SHAPE_AXES[op]]


# ---------------------------------------------------------------------------------------------
# torch.compile with the token dimension dynamic


class TokenDynamicCompile:
    """P1's ``torch_compile`` in the model suite: ``torch.compile`` (default mode) of torch_eager's function,
    compiled once per shape (H, I) with the token dimension dynamic (``torch._dynamo.maybe_mark_dynamic`` on
    dim 0 of the [T, ·] inputs), dynamo reset when the shape changes. Dynamo specialises a dimension of size
    1, so T = 1 gets a graph of its own. ``backend`` is torch.compile's (a test passes a counting one)."""

    TOKEN_ARGUMENTS = (0, 1, 4, 5, 6, 7, 8)  # dy, x, gate, gate_sigmoid, gate_silu, up, intermediate

    def __init__(self, backend="inductor"):
        self.backend = backend
        self.shape = None
        self.compiled = None

    def prepare(self, inputs: dict):
        """The timed callable on ``inputs`` (``[Wg; Wu]`` concatenated here, untimed)."""
        arguments = eager_arguments(inputs)
        shape = tuple(inputs["gate_weight"].shape)  # (I, H)
        if shape != self.shape:
            torch._dynamo.reset()  # a fresh cache per shape: never dynamo's recompile limit
            self.compiled = torch.compile(swiglu_down_backward_eager, backend=self.backend)
            self.shape = shape
        for index in self.TOKEN_ARGUMENTS:
            torch._dynamo.maybe_mark_dynamic(arguments[index], 0)
        compiled = self.compiled
        return lambda: compiled(*arguments)

    def peer(self) -> Peer:
        return Peer(
            "torch_compile",
            P1,
            self.prepare,
            capturable=True,
            baseline=True,
            description="torch.compile (default mode) of torch_eager, compiled once per shape with the "
            "token dimension dynamic (dynamic T)",
            unavailable=lambda device: None if hasattr(torch, "compile") else "torch has no torch.compile",
        )


def suite_peers(
    problem: problems.Problem, compiler: TokenDynamicCompile | None = None, mode: str = "op"
) -> dict[str, Peer]:
    """The peers of ``problem`` in the model suite: in mode ``op`` the registered ones, P1's ``torch_compile``
    replaced by ``compiler``'s (a fresh :class:`TokenDynamicCompile` by default); in a training-step mode its
    layer's peers (:func:`.modes.mode_peers`), as the single-shape layer runs take them."""
    if mode != "op":
        return modes.mode_peers(problem.name, mode)
    registry = peers_for(problem.name)
    if problem.op == P1:
        registry["torch_compile"] = (compiler or TokenDynamicCompile()).peer()
    return registry


def default_impls(problem: problems.Problem, device: torch.device, mode: str = "op") -> list[str]:
    """The labels of :data:`IMPLS` (in a training-step mode: :data:`LAYER_IMPLS`) for ``problem`` that can run
    on ``device``."""
    registry = suite_peers(problem, mode=mode)
    wanted = IMPLS[problem.op] if mode == "op" else LAYER_IMPLS[problem.op]
    return [label for label in wanted if registry[label].unavailable(device) is None]


def default_tokens(problem: str, mode: str, small: bool) -> tuple[int, ...]:
    """The token counts of ``problem`` in ``mode``: :data:`SMALL_TOKENS` when ``small``, else :data:`TOKENS`
    (mode ``op``) or :data:`LAYER_TOKENS` (a training step)."""
    if small:
        return SMALL_TOKENS[problem]
    return TOKENS[problem] if mode == "op" else LAYER_TOKENS[problem]


# ---------------------------------------------------------------------------------------------
# files and tables


def model_stem(problem: str, dtype_name: str, *, small: bool, date: str, suffix: str | None, mode: str = "op") -> str:
    """``<date>-<problem>-<dtype>[-<mode>][-small]-models[-<suffix>]``: the model suite's tag is ``models``, a
    part of a split run adds its suffix, and a training-step run names its mode (as the benchmark's own
    files do: :func:`.results.result_stem`), so that it never overwrites the function's files."""
    tag = results.MODEL_SUITE + (f"-{suffix}" if suffix else "")
    return results.result_stem(problem, dtype_name, small=small, tag=tag, date=date, mode=mode)


def file_suffix(args: argparse.Namespace) -> str | None:
    """The suffix of this run's files: ``--tag``, else the models chosen with ``--model`` joined by '+',
    else none (every model)."""
    if args.tag:
        return args.tag
    return "+".join(args.model) if args.model else None


def _cell(row) -> str:
    if row["status"] == "ok":
        return results.format_ms(row["median_ms"]) + ("" if row["correct"] else " ✗")
    return row["status"].split(":")[0].upper()


def summary_table(frame: pd.DataFrame, title: str) -> str:
    """The run as text: per (model, token count), each implementation's median or why there is none."""
    cells = frame.assign(cell=frame.apply(_cell, axis=1))
    table = cells.pivot_table(index=["model", "num_tokens"], columns="impl", values="cell", aggfunc="first", sort=False)
    table = table.reindex(columns=list(dict.fromkeys(frame["impl"])))
    lines = [title, "", table.to_string()]
    for _, row in frame[frame["status"] != "ok"].iterrows():
        lines.append(f"  {row['model']} @ {row['num_tokens']} {row['impl']}: {row['status']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# a run


def run_problem(name: str, args: argparse.Namespace, bench: harness.Setup, log, started) -> dict:
    """The model suite of one problem (every shape of ``args.model``, or all): writes its CSV after every row
    and its JSON after every model, so that a run cut short (the GPU machine's time limit) leaves files that
    read back (``complete`` false in the JSON until the last model is done); returns dict(csv=path,
    json=path, frame=DataFrame, table=str)."""
    problem = problems.load(name)
    mode = getattr(args, "mode", "op")
    dtype = problem.dtype
    dtype_label = problems.dtype_name(dtype)
    shapes = models_of(problem, args.model)
    tokens = list(args.tokens) if args.tokens is not None else list(default_tokens(name, mode, args.small))
    impls = args.model_impls[name]
    registry = suite_peers(problem, mode=mode)
    baselines = [label for label, peer in registry.items() if peer.baseline]
    names, columns = modes.output_names(problem, mode), shape_columns(problem.op)
    date = started.strftime("%Y-%m-%d")
    stem = model_stem(name, dtype_label, small=args.small, date=date, suffix=file_suffix(args), mode=mode)
    csv_path, json_path = results.result_paths(args.out, bench.device, stem)
    run_args = argparse.Namespace(**{**vars(args), "problem": name, "impls": impls})
    suite = dict(source="--tokens" if args.tokens is not None else "model suite", provenance="custom", tokens=tokens)

    def save(rows):
        results.write_csv(csv_path, results.results_frame(rows, names, columns))

    def write_json(frame, done: list[dict], reference_dtype, complete: bool):
        per_model = {}
        for entry in done:
            summary, baseline = results.summarize_impls(frame[frame["model"] == entry["model"]], impls, baselines)
            per_model[entry["model"]] = dict(summary=summary, baseline=baseline)
        document = dict(
            problem=name,
            mode=mode,
            suite=results.MODEL_SUITE,
            dtype=dtype_label,
            complete=complete,
            models=done,
            impls=impls,
            implementations={label: registry[label].description for label in impls},
            element_rule=problem.element_rule_at(dtype) if mode == "op" else None,  # the rule is the function's
            provenance=results.run_provenance(run_args, bench.device, bench.ceilings, suite, reference_dtype, started),
            summary=per_model,
        )
        results.write_json(json_path, document)

    json_path.unlink(missing_ok=True)  # an earlier run's, which this run's rows replace
    rows, done, reference_dtype = [], [], None
    progress = tqdm(total=len(shapes) * len(tokens) * len(impls), desc=f"{name} models", unit="run", file=sys.stderr)
    for model in shapes:
        progress.set_description(f"{name} · {model.name}")
        axes = shape_axes(model, problem.op, args.small)
        precision = harness.run_shape(
            problem,
            run_args,
            bench,
            dtype=dtype,
            tokens=tokens,
            axes=axes,
            registry=registry,
            rows=rows,
            progress=progress,
            log=log,
            columns=dict(model=model.name, **axes),
            save=save,
        )
        reference_dtype = precision or reference_dtype
        done.append(dict(model=model.name, axes=axes, model_axes=model.axes(problem.op), source=model.source))
        write_json(results.results_frame(rows, names, columns), done, reference_dtype, complete=model is shapes[-1])
    progress.close()

    frame = results.results_frame(rows, names, columns)
    results.write_csv(csv_path, frame)
    clock = "wall clock" if bench.device.type != "cuda" else "cold L2; graph replays or events"
    shapes_note = " · small shapes" if args.small else ""
    what = "" if mode == "op" else f" · layer {mode}"
    title = (
        f"{name}{what} at the models' shapes · {dtype_label} · {gpu_key(bench.device)}{shapes_note} · median ({clock})"
    )
    return dict(csv=csv_path, json=json_path, frame=frame, table=summary_table(frame, title))


def run(args: argparse.Namespace, log=None) -> list[dict]:
    """Runs the model suite the parsed ``args`` describe (:func:`moe_lib.bench.cli.parse_args` with
    ``--models``): every problem of ``args.problems`` in turn, the device's ceilings measured once. Returns
    :func:`run_problem`'s dict per problem."""
    log = log or (lambda message: tqdm.write(message, file=sys.stderr))
    started = datetime.datetime.now(datetime.timezone.utc)
    bench = harness.setup(args.device, log)
    return [run_problem(name, args, bench, log, started) for name in args.problems]
