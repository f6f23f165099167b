"""What a benchmark run times: the problem's function, or a training step of its layer (``--mode``).

- ``op`` (the default): the benchmark's function, e.g. ``moe_experts_backward`` — the peers of
  :mod:`.peers`.
- ``forward``: a differentiable layer's forward, with autograd recording what its backward needs, as
  in training: ``y = layer(...)``.
- ``forward_backward``: that forward, then ``torch.autograd.grad`` of every input and weight the
  layer differentiates (:attr:`.layer_step.Layer.leaves`) for the problem's ``grad_output`` — one
  training step of the layer. The outputs checked are ``y`` and those gradients.

Each op has one :class:`~.layer_step.Layer` in :data:`~.layer_step.LAYERS`: the inputs it differentiates
(:mod:`.layer_step` builds the step itself). The implementations of a layer are
:class:`~.peers.LayerPeer`\\ s registered beside the op's peers, its reference among them (the one
labelled ``reference``: readable PyTorch, the same references as the functions'); :func:`mode_peer`
turns one into a :class:`~.peers.Peer` that the harness checks and times like any other. FLOPs of a
step count the layer's GEMMs as ``lab.json``'s ``layer_flops`` says (forward 6, forward + backward 18
per T·H·I for P1, per T·K·H·I for P2: a backward that recomputes the forward does more than it is
credited for).
"""

from __future__ import annotations

import math

import torch

from .. import problems
from . import peers
from .layer_step import LAYERS, step

MODES = ("op", "forward", "forward_backward")


def output_names(problem: problems.Problem, mode: str) -> list[str]:
    """The outputs a run in ``mode`` checks: the problem's, ``output``, or ``output`` and a gradient per leaf."""
    check_mode(mode)
    if mode == "op":
        return problem.output_names
    names = ["output"]
    if mode == "forward_backward":
        names += [f"grad_{leaf}" for leaf in LAYERS[problem.op].leaves]
    return names


def has_layer(problem: str) -> bool:
    """Whether ``problem``'s op has a differentiable layer with its reference (what the training-step modes run)."""
    op = problems.load(problem).op
    return op in LAYERS and "reference" in peers.layer_peers_for(problem)


def check_mode(mode) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def mode_peer(layer_peer: peers.LayerPeer, mode: str) -> peers.Peer:
    """``layer_peer`` as a :class:`~.peers.Peer` of ``mode`` (``forward`` or ``forward_backward``)."""
    layer = LAYERS[layer_peer.op]

    def prepare(inputs):
        return step(layer_peer.forward, layer, mode, inputs, layer_peer.parameters, layer_peer.gradients)

    return peers.Peer(
        layer_peer.label,
        layer_peer.op,
        prepare,
        capturable=layer_peer.capturable,
        description=layer_peer.description,
        unavailable=layer_peer.unavailable,
        baseline=layer_peer.baseline,
    )


def mode_peers(problem: str, mode: str) -> dict[str, peers.Peer]:
    """Every implementation of ``problem`` in ``mode``, by label: its peers (``op``) or its layers' peers."""
    check_mode(mode)
    if mode == "op":
        return peers.peers_for(problem)
    return {label: mode_peer(layer, mode) for label, layer in peers.layer_peers_for(problem).items()}


def reference_outputs(problem: problems.Problem, inputs: dict, mode: str, precision: torch.dtype) -> tuple:
    """The reference layer's outputs of one step in ``mode`` (the layer peer ``reference``: readable
    PyTorch), computed in ``precision`` (TF32 off)."""
    from ..precision import tf32_disabled

    upcast = {name: t.to(precision) if t.is_floating_point() else t for name, t in inputs.items()}
    reference = peers.layer_peers_for(problem.name)["reference"].forward
    with tf32_disabled():
        return tuple(t.detach() for t in step(reference, LAYERS[problem.op], mode, upcast)())


def cost(problem: problems.Problem, mode: str, inputs: dict, references: tuple, **axes) -> tuple[int, int]:
    """(FLOPs, bytes) of one step: ``layer_flops`` of the problem's ``lab.json``, and every tensor the
    step reads (the leaves, routing, and for the backward grad_output) or writes (y, the gradients) once."""
    num_tokens = next(iter(inputs.values())).shape[0]
    flops = problem.layer_flops[mode] * math.prod(problem.sizes(num_tokens, **axes)[a] for a in problem.flops_axes)
    layer = LAYERS[problem.op]
    read = [t for name, t in inputs.items() if name in layer.leaves or not t.is_floating_point()]
    if mode == "forward_backward":
        read.append(inputs["grad_output"])
    # what the step writes, in the dtypes of the tensors it answers to (the references are upcast)
    written = [(references[0].numel(), inputs["grad_output"].dtype)]
    written += [(r.numel(), inputs[name].dtype) for name, r in zip(layer.leaves, references[1:], strict=False)]
    return flops, sum(t.numel() * t.element_size() for t in read) + sum(
        numel * torch.empty((), dtype=dtype).element_size() for numel, dtype in written
    )
