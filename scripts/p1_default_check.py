"""P1's own choice of design (``swiglu_down_backward(..., precision=...)``) checked on a GPU at chosen token counts.

    PYTHONPATH=.:tests python scripts/p1_default_check.py --precision fast --tokens 193,256,1100

For each token count: at our generator's scale and at the harness's, from poisoned memory, against float64 under the
precision's rule (the GPU tests' ``check_against_float64``), two calls bitwise equal; at the first and last token count
also captured in a CUDA graph and replayed on new inputs, the outputs those of an eager call. What the GPU tests do at
the suite's sizes, for the token counts where a change of the defaults moved a band edge. Prints one line per failure
and a count; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_lib import problems
from moe_lib.bench.timing import capture, poison_allocator
from moe_lib.swiglu_down import swiglu_down_backward


def checked(num_tokens: int, precision: str, distribution: str) -> None:
    from swiglu_down.helpers import check_against_float64  # tests/ on the path

    inputs = problems.make_inputs("swiglu_down_backward", num_tokens, seed=num_tokens, device="cuda",
                                  distribution=distribution)  # fmt: skip
    poison_allocator("cuda", 256 * 2**20)
    first = swiglu_down_backward(*inputs.values(), precision=precision)
    second = swiglu_down_backward(*inputs.values(), precision=precision)
    check_against_float64(inputs, first, precision)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), "two calls differ"


def replayed(num_tokens: int, precision: str) -> None:
    static = problems.make_inputs("swiglu_down_backward", num_tokens, seed=1, device="cuda")
    graph, outputs = capture(lambda: swiglu_down_backward(*static.values(), precision=precision))
    fresh = problems.make_inputs("swiglu_down_backward", num_tokens, seed=2, device="cuda")
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    eager = swiglu_down_backward(*fresh.values(), precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(outputs, eager, strict=True)), "replay differs from an eager call"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("faithful", "fast"), required=True)
    parser.add_argument("--tokens", required=True, help="comma list of token counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    passed = failed = 0
    checks = [(f"T={T} {d}", lambda T=T, d=d: checked(T, args.precision, d))
              for T in tokens for d in ("forward", "harness")]  # fmt: skip
    ends = dict.fromkeys([tokens[0], tokens[-1]])
    checks += [(f"T={T} graph replay", lambda T=T: replayed(T, args.precision)) for T in ends]
    for label, check in checks:
        try:
            check()
            passed += 1
        except Exception as exc:  # report and go on
            failed += 1
            print(f"FAIL {args.precision} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"{args.precision}: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
