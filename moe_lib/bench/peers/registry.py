"""The registry of the benchmark's implementations: :class:`Peer` and :class:`LayerPeer`, what registers
them and what reads them back, and the helpers that turn a problem's inputs dict into positional arguments.

The peers themselves are registered by one module per op (:mod:`.swiglu_down`, :mod:`.moe_experts`), which
import this module; the package (:mod:`moe_lib.bench.peers`) imports those and re-exports these names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from ... import problems


@dataclasses.dataclass(frozen=True)
class Peer:
    """One implementation of one problem op, as the harness runs it."""

    label: str
    op: str  # a key of moe_lib.problems.OPS
    prepare: Callable[[dict], Callable[[], tuple]]
    capturable: bool
    description: str
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    baseline: bool = False  # an optimized PyTorch implementation the score may use as its baseline
    # the whole call on the op's positional inputs, setup included, for callers that time every call in
    # full (NVIDIA's harness, moe_lib.bench.official); None: prepare(inputs)() each time
    run: Callable[..., tuple] | None = None

    def call(self, *args) -> tuple:
        """One call on the op's inputs (positional, in the definition's order), setup included."""
        if self.run is not None:
            return self.run(*args)
        return self.prepare(named(self.op, args))()


@dataclasses.dataclass(frozen=True)
class LayerPeer:
    """One implementation of one op's differentiable layer, as the training-step modes run it
    (:mod:`moe_lib.bench.modes`): ``forward(inputs, leaves)`` returns the layer's output ``y`` from the
    problem's inputs (a dict) and its leaves (the tensors it differentiates, requiring grad), recording
    what its backward needs. A layer that keeps its weights in a layout of its own (gate and up
    interleaved, say) builds its leaves from the inputs with ``parameters(inputs)`` (untimed, as a
    model holds its parameters) and maps their gradients back to the layer's leaves in
    ``gradients(grads, inputs)`` (views, or the gradient itself)."""

    label: str
    op: str  # a key of moe_lib.problems.OPS
    forward: Callable[[dict, dict], torch.Tensor]
    capturable: bool
    description: str
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    baseline: bool = False
    parameters: Callable[[dict], dict] | None = None  # inputs -> its leaves (default: the layer's leaves)
    gradients: Callable[[dict, dict], tuple] | None = None  # (its leaves' grads, inputs) -> grads of the layer's


_REGISTRY: dict[str, dict[str, Peer]] = {op: {} for op in problems.OPS}
_LAYER_REGISTRY: dict[str, dict[str, LayerPeer]] = {op: {} for op in problems.OPS}


def register_layer(peer: LayerPeer) -> LayerPeer:
    """Adds (or replaces) the layer implementation ``peer`` under its op and label."""
    if peer.op not in _LAYER_REGISTRY:
        raise ValueError(f"op: expected one of {tuple(_LAYER_REGISTRY)}, got {peer.op!r}")
    _LAYER_REGISTRY[peer.op][peer.label] = peer
    return peer


def layer_peers_for(problem: str) -> dict[str, LayerPeer]:
    """Every registered implementation of ``problem``'s layer, by label, in registration order."""
    return dict(_LAYER_REGISTRY[problems.load(problem).op])


def register(peer: Peer) -> Peer:
    """Adds (or replaces) ``peer`` under its op and label."""
    if peer.op not in _REGISTRY:
        raise ValueError(f"op: expected one of {tuple(_REGISTRY)}, got {peer.op!r}")
    _REGISTRY[peer.op][peer.label] = peer
    return peer


def unregister(op: str, label: str) -> None:
    """Removes the peer ``label`` of ``op`` (nothing happens when there is none)."""
    _REGISTRY[op].pop(label, None)


@contextlib.contextmanager
def registered(peer: Peer):
    """Registers ``peer`` for the duration of the block; afterwards the op's peers are as before, in their
    order (a peer it replaced back in its place)."""
    before = dict(_REGISTRY.get(peer.op, {}))
    register(peer)
    try:
        yield peer
    finally:
        _REGISTRY[peer.op].clear()
        _REGISTRY[peer.op].update(before)


def peers_for(problem: str) -> dict[str, Peer]:
    """Every registered peer of ``problem`` (a problem name: its op's peers), by label, in registration order."""
    return dict(_REGISTRY[problems.load(problem).op])


def labels(problem: str) -> list[str]:
    return list(peers_for(problem))


def available_labels(problem: str, device) -> list[str]:
    """Labels of the peers of ``problem`` that can run on ``device``."""
    device = torch.device(device)
    return [label for label, peer in peers_for(problem).items() if peer.unavailable(device) is None]


def baseline_labels(problem: str) -> list[str]:
    """Labels of the peers of ``problem`` that are score baselines."""
    return [label for label, peer in peers_for(problem).items() if peer.baseline]


@functools.cache
def input_names(op: str) -> tuple[str, ...]:
    """The input names of ``op``, in the order of its definition (that of the function's arguments)."""
    return next(
        tuple(problem.input_names) for problem in map(problems.load, problems.PROBLEM_NAMES) if problem.op == op
    )


def positional(op: str, inputs: dict) -> tuple:
    """``inputs`` (name -> tensor) as the positional arguments of ``op``'s functions."""
    return tuple(inputs[name] for name in input_names(op))


def named(op: str, args: tuple) -> dict:
    """``op``'s positional arguments as its inputs dict (name -> tensor): :func:`positional` undone."""
    return dict(zip(input_names(op), args, strict=True))


def calling(op: str, function: Callable, **keywords) -> Callable[[dict], Callable[[], tuple]]:
    """A ``prepare`` whose timed callable is ``function(*inputs in op's order, **keywords)``."""

    def prepare(inputs: dict):
        arguments = positional(op, inputs)
        return lambda: function(*arguments, **keywords)

    return prepare


def registered_baseline_labels() -> tuple[str, ...]:
    """The labels of the baseline peers registered now, every op's, in registration order."""
    return tuple(dict.fromkeys(label for peers in _REGISTRY.values() for label, peer in peers.items() if peer.baseline))
