"""The environment of a test's child process that compiles kernels for sm_90."""

import os
from pathlib import Path


def compile_env(root: Path) -> dict[str, str]:
    """This process's environment with ``root`` as PYTHONPATH and without TRITON_INTERPRET: under the interpreter
    every ``@triton.jit`` function runs as Python, and nothing is compiled for the GPU."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    return env
