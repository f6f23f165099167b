"""Compile and autotune SonicMoE's kernels at P2's bf16 shapes, so that a later benchmark run finds them cached.

    QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=8 PYTHONPATH=<sonicmoe site>:. \
        python scripts/p2/sonicmoe_warmup.py [--tokens 2048,8192,32768] [--models A,B] [--pack DIR]

On a fresh machine SonicMoE's first call compiles every autotuning configuration of its grouped GEMMs
(minutes); QuACK keeps the compiled kernels in its object cache (``QUACK_CACHE_DIR``, default
``$TMPDIR/$USER/quack_cache``) and the autotuning choices in ``$QUACK_HOME/.quack/cache``, where a later
process finds them. This runs one forward + backward of the ``sonicmoe`` layer peer per token count
(the benchmark's inputs and routing), printing how long each took: at P2's own shape, or with ``--models``
at the expert shapes of those models (moe_lib/bench/models.py; ``--models`` of the model suite's
training-step run, ``python -m moe_lib.bench --models --mode forward_backward``), which SonicMoE compiles
afresh (its kernels are specialised to H, I and E); with ``--pack DIR`` it then writes
``DIR/quack-cache.tar.xz`` with QuACK's caches and Triton's (paths relative to /), which a later machine
unpacks in their places (``tar -xJf quack-cache.tar.xz -C /``, same user and home) to skip the compilation.
Most of the first call's minutes are SonicMoE's Triton kernels compiled one autotuning configuration at a
time, as Triton's autotuner times them: here each autotuner compiles all its candidate configurations at once first,
in ``--compile-threads`` threads (Triton's ``AsyncCompileMode``; the timing that follows finds them compiled). With
``TRITON_CACHE_AUTOTUNING=1`` (set here and by ``scripts/gpu_bench.sh``) Triton's cache keeps the autotuning choices
beside the compiled kernels, so the unpacked cache skips both.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import subprocess
import sys
import tempfile
import time
from getpass import getuser
from pathlib import Path

import torch

from moe_lib import problems
from moe_lib.bench import models, modes
from moe_lib.bench.cli import model_list, token_list

PROBLEM = "moe_experts_backward_bf16"


def cache_dirs() -> list[Path]:
    """QuACK's object cache, its autotuning cache and Triton's cache (see the module docstring)."""
    objects = Path(os.environ.get("QUACK_CACHE_DIR") or Path(tempfile.gettempdir()) / getuser() / "quack_cache")
    autotuning = Path(os.environ.get("QUACK_HOME") or Path.home()) / ".quack" / "cache"
    triton = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return [objects, autotuning, triton]


def warmup_shapes(names: list[str] | None) -> list[tuple[str, dict]]:
    """(label, axes) of each shape to compile at: P2's own (no axes overridden) without ``names``, else each
    model's expert shape (:data:`moe_lib.bench.models.MODEL_SHAPES`). A ValueError naming ``--models`` for a
    shape without experts, before any work."""
    if names is None:
        return [(PROBLEM, {})]
    shapes = []
    for model in models.MODEL_SHAPES:
        if model.name in names:
            if model.num_experts is None:
                raise ValueError(f"--models: {model.name} has no experts (a shape of P1 only)")
            shapes.append((model.name, model.axes("moe_experts_backward")))
    return shapes


@contextlib.contextmanager
def compiles_in_parallel(threads: int):
    """Within it, a Triton autotuner meeting a new key compiles all its pruned configurations at once in ``threads``
    threads (the compiler's ptxas runs outside the GIL), where it would compile each as it times it; where Triton's
    disk cache already holds the choice, the compiled kernels are loaded from its cache all the same (the hook runs
    at pruning, before that cache is read). A compile that fails here is left to the timing, which reports it."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime import autotuner
    from triton.runtime._async_compile import AsyncCompileMode

    prune = autotuner.Autotuner.prune_configs

    def prune_then_compile(self, kwargs):
        configs = prune(self, kwargs)
        if threads > 1 and len(configs) > 1:
            with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool, ignore_errors=True):
                for config in configs:
                    self.fn.run(**self.nargs, **dict(kwargs, warmup=True), **config.all_kwargs())
        return configs

    autotuner.Autotuner.prune_configs = prune_then_compile
    try:
        yield
    finally:
        autotuner.Autotuner.prune_configs = prune


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_list, default=[2048, 8192, 32768])
    parser.add_argument(
        "--models",
        type=model_list,
        help="comma-separated model names of moe_lib/bench/models.py: their expert shapes instead of P2's",
    )
    parser.add_argument("--pack", type=Path, help="write DIR/quack-cache.tar.xz with the caches when done")
    parser.add_argument(
        "--compile-threads", type=int, default=os.cpu_count() or 1, help="threads compiling Triton's configurations"
    )
    parser.add_argument(
        "--stacks-every",
        type=float,
        metavar="SECONDS",
        help="print every thread's Python stack to stderr every SECONDS (where a long first call spends its time)",
    )
    args = parser.parse_args(argv)
    if args.stacks_every is not None and args.stacks_every <= 0:
        parser.error(f"--stacks-every must be positive, got {args.stacks_every}")
    try:
        args.shapes = warmup_shapes(args.models)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def warm_up(peer, problem, shapes: list[tuple[str, dict]], tokens: list[int]) -> None:
    """Two forward + backward calls of SonicMoE at each shape and token count, each call's time printed."""
    for label, axes in shapes:
        for num_tokens in tokens:
            inputs = problem.make_inputs(num_tokens, device="cuda", **axes)
            for attempt in ("first call (compiles and autotunes)", "second call"):
                start = time.perf_counter()
                outputs = peer.prepare(inputs)()
                torch.cuda.synchronize()
                print(f"{label} T={num_tokens}: {attempt}: {time.perf_counter() - start:.1f} s", flush=True)
                del outputs
            del inputs
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # read when SonicMoE's autotuners are made, below
    peer = modes.mode_peers(PROBLEM, "forward_backward")["sonicmoe"]
    reason = peer.unavailable(torch.device("cuda"))
    if reason is not None:
        raise SystemExit(f"sonicmoe unavailable: {reason}")
    problem = problems.load(PROBLEM)
    if args.stacks_every:
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=sys.stderr)
    with compiles_in_parallel(args.compile_threads):
        warm_up(peer, problem, args.shapes, args.tokens)
    faulthandler.cancel_dump_traceback_later()
    if args.pack:
        args.pack.mkdir(parents=True, exist_ok=True)
        archive = args.pack / "quack-cache.tar.xz"
        found = [str(path) for path in cache_dirs() if path.is_dir()]
        subprocess.run(["tar", "-cJf", str(archive), *found], check=True)
        print(f"packed {', '.join(found)} into {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")
    print("warm-up done", flush=True)


if __name__ == "__main__":
    main()
