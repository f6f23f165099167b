"""Every implementation the benchmark harness can time, under the project's labels.

A peer is a :class:`Peer`: ``prepare(inputs)`` does the untimed setup (weights concatenated once,
a function compiled, indices converted) and returns a callable that does the timed work and returns
the outputs tuple in the problem's order; ``call(*inputs)`` does both, as a harness that times every
call in full (NVIDIA's) runs it. ``capturable`` says whether that callable can be
captured in a CUDA graph (no host sync inside); ``unavailable(device)`` gives the reason it cannot
run on ``device``, or None; ``baseline`` marks the optimized PyTorch peers the score may take as its
baseline (the harness picks the fastest of them that is correct on every case).

Each op of :data:`moe_lib.problems.OPS` has one module here that registers its peers and says what
each computes (:mod:`.swiglu_down`, :mod:`.moe_experts`): adding a peer is one :func:`register` there.
Tests and experiments add theirs with :func:`register` (or the :func:`registered` context). The classes
and the registry live in :mod:`.registry`, which the op modules import; this package re-exports them.
"""

# each op's peers register themselves as their module loads
from . import moe_experts, swiglu_down
from .registry import (
    LayerPeer,
    Peer,
    available_labels,
    baseline_labels,
    calling,
    input_names,
    labels,
    layer_peers_for,
    named,
    peers_for,
    positional,
    register,
    register_layer,
    registered,
    registered_baseline_labels,
    unregister,
)

# the labels of the baseline peers registered with this package (every op's), for reading result files
BASELINE_LABELS = registered_baseline_labels()

__all__ = [
    "BASELINE_LABELS",
    "LayerPeer",
    "Peer",
    "available_labels",
    "baseline_labels",
    "calling",
    "input_names",
    "labels",
    "layer_peers_for",
    "moe_experts",
    "named",
    "peers_for",
    "positional",
    "register",
    "register_layer",
    "registered",
    "registered_baseline_labels",
    "swiglu_down",
    "unregister",
]
