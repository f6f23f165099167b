"""The command line of the benchmark: ``python -m moe_lib.bench --problem P [--impl a,b] [--tokens n,m | --suite] ...``,
and of its model suite: ``python -m moe_lib.bench --models [--model A,B] [--problem P] [--mode M] [--tokens n,m] ...``.

:func:`parse_args` checks every option (errors name it) and fills in the defaults that depend on
the machine; :func:`main` runs :func:`moe_lib.bench.harness.run` (with ``--models``,
:func:`moe_lib.bench.models.run`) and prints its table. The option
types (:func:`token_list`, :func:`non_negative`, :func:`positive`), :func:`resolve_device` and
:func:`problems_by_dtype` serve the expert-parallel benchmark's and the scripts' command lines too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from .. import problems
from . import harness, models, modes, official_timing
from .results import DEFAULT_OUT

DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def problems_by_dtype(op: str) -> dict[str, problems.Problem]:
    """The problems that run ``op``, by the dtype name of their inputs (P2's: "float32" and "bfloat16")."""
    return {
        problems.dtype_name(problem.dtype): problem
        for problem in map(problems.load, problems.PROBLEM_NAMES)
        if problem.op == op
    }


def token_list(text: str) -> list[int]:
    """Comma-separated non-negative token counts, e.g. "1,128,8192"."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    counts = []
    for part in parts:
        if not re.fullmatch(r"\d+", part):
            raise argparse.ArgumentTypeError(f"expected non-negative integers separated by commas, got {part!r}")
        counts.append(int(part))
    return counts


def non_negative(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def positive(text: str) -> int:
    value = non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def tag(text: str) -> str:
    """A suffix of file names: letters, digits, '_', '.', '-'."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(f"expected letters, digits, '_', '.', '-' only, got {text!r}")
    return text


def model_list(text: str) -> list[str]:
    """Comma-separated names of :data:`moe_lib.bench.models.MODEL_NAMES`, e.g. "DeepSeek-V3,Mixtral-8x7B"."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated model names, got {text!r}")
    for name in names:
        if name not in models.MODEL_NAMES:
            raise argparse.ArgumentTypeError(f"unknown model {name!r} (known: {', '.join(models.MODEL_NAMES)})")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a model is repeated in {text!r}")
    return names


def resolve_device(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    """The ``--device`` option as a torch device: cuda when available and none is given, else cpu. A bad
    name, or CUDA on a machine without it, is a parser error naming ``--device``."""
    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device: CUDA is not available on this machine")
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lib.bench",
        description="Check and time the implementations of one problem against its reference; "
        "write a long-form CSV and a JSON summary under <out>/<gpu key>/.",
    )
    parser.add_argument(
        "--problem",
        choices=problems.PROBLEM_NAMES,
        help="the problem (default: swiglu_down_backward; with --models: every problem)",
    )
    parser.add_argument(
        "--models",
        action="store_true",
        help="the model suite: the problems at the expert shapes of public MoE models, each with its "
        "own token counts (moe_lib/bench/models.py); one file per problem and dtype, tagged models",
    )
    parser.add_argument(
        "--model",
        type=model_list,
        help="with --models: only these models, comma-separated (the files' names get them as a "
        "suffix unless --tag gives one)",
    )
    parser.add_argument(
        "--mode",
        default="op",
        choices=modes.MODES,
        help="op: the problem's function (default); forward, forward_backward: a training step of its layer "
        "(with --models too, at each model's shape)",
    )
    parser.add_argument("--impl", help="comma-separated implementation labels (default: every one available)")
    cases = parser.add_mutually_exclusive_group()
    cases.add_argument("--tokens", type=token_list, help="comma-separated token counts, e.g. 1,128,8192")
    cases.add_argument(
        "--suite", action="store_true", help="the problem's workload suite (default; with --small, a three-case suite)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), help="override the problem's floating dtype")
    parser.add_argument("--seed", type=non_negative, default=0)
    parser.add_argument("--warmup", type=non_negative, help="warm-up runs per case (default 10 on CUDA, 1 on CPU)")
    parser.add_argument("--reps", type=positive, help="timed runs per case (default 50 on CUDA, 3 on CPU)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    parser.add_argument("--tag", type=tag, help="suffix of the result file names (with --models: after 'models')")
    parser.add_argument("--small", action="store_true", help="scaled-down shapes (automatic without CUDA)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument(
        "--official-timing",
        choices=("auto", "on", "off"),
        default="auto",
        help="also time every case the way NVIDIA's SOL-ExecBench harness does (eager calls on "
        "fresh input addresses, CUPTI span from first kernel start to last kernel end): auto = "
        "where CUDA and cupti-python are present (default), except with --models",
    )
    return parser


def _implementations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The labels ``--impl`` names (checked against the problem's peers), or every available one."""
    registry = modes.mode_peers(args.problem, args.mode)
    if args.impl is None:
        available = [label for label, peer in registry.items() if peer.unavailable(args.device) is None]
        if not available:
            parser.error(f"--impl: no implementation of {args.problem} ({args.mode}) is available on {args.device}")
        return available
    known = list(registry)
    chosen = [label.strip() for label in args.impl.split(",") if label.strip()]
    if not chosen:
        parser.error(f"--impl: expected comma-separated labels among {known}, got {args.impl!r}")
    for label in chosen:
        if label not in known:
            parser.error(
                f"--impl: unknown implementation {label!r} for {args.problem} in mode {args.mode} "
                f"(known: {', '.join(known)})"
            )
    if len(set(chosen)) != len(chosen):
        parser.error(f"--impl: a label is repeated in {args.impl!r}")
    return chosen


def _model_suite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks the options of ``--models`` and sets ``args.problems`` (those with a shape among the chosen
    models) and ``args.model_impls`` ({problem: labels}: ``--impl``'s, each known to every one of them in
    ``--mode``, or the suite's implementations of that mode available on the device)."""
    for option, given, why in (
        ("--suite", args.suite, "the model suite has token counts of its own (--tokens overrides them)"),
        (
            "--dtype",
            args.dtype is not None,
            "each problem runs in its own dtype (P2 in fp32: --problem "
            "moe_experts_backward, in bf16: moe_experts_backward_bf16)",
        ),
    ):
        if given:
            parser.error(f"{option}: not with --models: {why}")
    chosen = [args.problem] if args.problem else list(problems.PROBLEM_NAMES)
    if args.mode != "op":
        for name in chosen:
            if not modes.has_layer(name):
                parser.error(f"--mode {args.mode}: {name} has no layer to run a training step of")
    args.problems = [name for name in chosen if models.models_of(problems.load(name), args.model)]
    if not args.problems:
        parser.error(
            f"--model: {', '.join(args.model)} has no shape that {args.problem} runs (a P1-only shape has no experts)"
        )
    args.model_impls = {}
    for name in args.problems:
        problem = problems.load(name)
        if args.impl is None:
            available = models.default_impls(problem, args.device, args.mode)
            if not available:
                wanted = (models.IMPLS if args.mode == "op" else models.LAYER_IMPLS)[problem.op]
                parser.error(f"--impl: none of {', '.join(wanted)} can run {name} ({args.mode}) on {args.device}")
            args.model_impls[name] = available
            continue
        known = list(models.suite_peers(problem, mode=args.mode))
        chosen_impls = [label.strip() for label in args.impl.split(",") if label.strip()]
        if not chosen_impls or len(set(chosen_impls)) != len(chosen_impls):
            parser.error(f"--impl: expected distinct comma-separated labels among {known}, got {args.impl!r}")
        for label in chosen_impls:
            if label not in known:
                what = "a layer peer" if args.mode != "op" else "an implementation"
                parser.error(
                    f"--impl: {label!r} is not {what} of {name} in --mode {args.mode} (known: {', '.join(known)}); "
                    "--problem picks one problem"
                )
        args.model_impls[name] = chosen_impls


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks the command line; errors name the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = resolve_device(parser, args.device)
    on_cuda = args.device.type == "cuda"
    if on_cuda and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    if not on_cuda:
        args.small = True
    if args.models:
        _model_suite(parser, args)
    else:
        if args.model is not None:
            parser.error("--model: only with --models (the model suite)")
        args.problem = args.problem or "swiglu_down_backward"
        if args.mode != "op" and not modes.has_layer(args.problem):
            parser.error(f"--mode {args.mode}: {args.problem} has no layer to run a training step of")
        args.impls = _implementations(parser, args)
    if args.tokens is not None and len(set(args.tokens)) != len(args.tokens):
        parser.error(f"--tokens: a token count is repeated in {args.tokens}")
    if args.dtype is not None:
        args.dtype = DTYPE_ALIASES[args.dtype]
    reason = official_timing.unavailable(args.device)
    if args.official_timing == "on" and reason is not None:
        parser.error(f"--official-timing: {reason}")
    wanted = args.official_timing == "on" or (args.official_timing == "auto" and not args.models)
    args.official = wanted and reason is None
    if args.warmup is None:
        args.warmup = 10 if on_cuda else 1
    if args.reps is None:
        args.reps = 50 if on_cuda else 3
    return args


def main(argv=None) -> dict:
    """Parses ``argv`` (default: the command line), runs the benchmark, prints its table and the files written.
    With ``--models``, returns dict(runs=[one dict per problem, as :func:`moe_lib.bench.models.run` gives])."""
    args = parse_args(argv)
    if args.models:
        runs = models.run(args)
        for run in runs:
            print(f"{run['table']}\n\nwrote {run['csv']}\n      {run['json']}\n")
        return dict(runs=runs)
    result = harness.run(args)
    print(result["table"])
    print(f"\nwrote {result['csv']}\n      {result['json']}")
    return result
