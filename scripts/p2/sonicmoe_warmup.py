"""Compile and autotune SonicMoE's kernels at P2's bf16 shapes, so that a later benchmark run finds them cached.

    QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS=8 PYTHONPATH=<sonicmoe site>:. \
        python scripts/p2/sonicmoe_warmup.py [--tokens 2048,8192,32768] [--pack DIR]

On a fresh machine SonicMoE's first call compiles every autotuning configuration of its grouped GEMMs
(minutes); QuACK keeps the compiled kernels in its object cache (``QUACK_CACHE_DIR``, default
``$TMPDIR/$USER/quack_cache``) and the autotuning choices in ``$QUACK_HOME/.quack/cache``, where a later
process finds them. This runs one forward + backward of the ``sonicmoe`` layer peer per token count
(the benchmark's inputs and routing), printing how long each took; with ``--pack DIR`` it then writes
``DIR/quack-cache.tar.xz`` with both caches (paths relative to /), which a later machine unpacks in
their places (``tar -xJf quack-cache.tar.xz -C /``, same user and home) to skip the compilation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from getpass import getuser
from pathlib import Path

import torch

from moe_lib import problems
from moe_lib.bench import modes
from moe_lib.bench.cli import token_list

PROBLEM = "moe_experts_backward_bf16"


def cache_dirs() -> list[Path]:
    """QuACK's object cache and its autotuning cache (see the module docstring)."""
    objects = Path(os.environ.get("QUACK_CACHE_DIR") or Path(tempfile.gettempdir()) / getuser() / "quack_cache")
    autotuning = Path(os.environ.get("QUACK_HOME") or Path.home()) / ".quack" / "cache"
    return [objects, autotuning]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_list, default=[2048, 8192, 32768])
    parser.add_argument("--pack", type=Path, help="write DIR/quack-cache.tar.xz with the caches when done")
    args = parser.parse_args()
    peer = modes.mode_peers(PROBLEM, "forward_backward")["sonicmoe"]
    reason = peer.unavailable(torch.device("cuda"))
    if reason is not None:
        raise SystemExit(f"sonicmoe unavailable: {reason}")
    problem = problems.load(PROBLEM)
    for num_tokens in args.tokens:
        inputs = problem.make_inputs(num_tokens, device="cuda")
        for attempt in ("first call (compiles and autotunes)", "second call"):
            start = time.perf_counter()
            outputs = peer.prepare(inputs)()
            torch.cuda.synchronize()
            print(f"T={num_tokens}: {attempt}: {time.perf_counter() - start:.1f} s", flush=True)
            del outputs
        del inputs
        torch.cuda.empty_cache()
    if args.pack:
        args.pack.mkdir(parents=True, exist_ok=True)
        archive = args.pack / "quack-cache.tar.xz"
        found = [str(path) for path in cache_dirs() if path.is_dir()]
        subprocess.run(["tar", "-cJf", str(archive), *found], check=True)
        print(f"packed {', '.join(found)} into {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")
    print("warm-up done", flush=True)


if __name__ == "__main__":
    main()
