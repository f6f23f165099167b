"""Which structure runs P2's Triton path, where a caller asks for one: kernels A, W, D and C (:mod:`.kernels`) or
the grouped engine's launches (:mod:`.engine_layer`). A leaf without triton: the API and the bench's peers set it.

The chooser (:func:`.engine_layer.structure`) reads :func:`preferred_now`; the layer's backward runs under the
preference its forward ran under (:mod:`.api` keeps it in the autograd context).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

STRUCTURES = ("kernels", "engine")
_preferred: ContextVar[str | None] = ContextVar("moe_experts_structure", default=None)


@contextmanager
def preferred(structure: str | None) -> Iterator[None]:
    """Calls inside run ``structure`` (one of :data:`STRUCTURES`; None: the chooser's) where it supports them: for
    measuring one structure against the other and for tests."""
    if structure is not None and structure not in STRUCTURES:
        raise ValueError(f"structure: expected one of {STRUCTURES} or None, got {structure!r}")
    token = _preferred.set(structure)
    try:
        yield
    finally:
        _preferred.reset(token)


def preferred_now() -> str | None:
    """The structure asked for around this call (None: none)."""
    return _preferred.get()
