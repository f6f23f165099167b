"""What every P1 design shares on the host: the allocation hook, the device's limits, workspaces and dot flags.

No design is imported here, and this module imports none: the designs (:mod:`.designs`), the chooser
(:mod:`.choose`) and the call (:mod:`.backward`) all build on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..dispatch import interpreter_enabled
from .checks import check_precision

# Every output and workspace is allocated through this function, looked up at each call as ``runtime.allocate``
# (tests replace it with one that fills the memory with NaN, to prove that every element the kernels read or
# return was written).
allocate = torch.empty


def carries_low_halves(dtype: torch.dtype, precision: str) -> bool:
    """Whether dGate and dUp travel as hi/lo pairs: the faithful path with 16-bit inputs."""
    check_precision(precision)
    return precision == "faithful" and dtype != torch.float32


@dataclass(frozen=True)
class Device:
    """What a design's ``supports`` and the chooser read of the device a call runs on (hashable: the chooser's
    choices are cached by it)."""

    kind: str  # "cuda", or "interpreter" (CPU tensors under TRITON_INTERPRET), or "cpu"
    sms: int  # streaming multiprocessors: programs surely resident at once, one per SM (a grid wait needs it)
    shared_memory: int  # bytes of shared memory one program may use (the opt-in limit per block)
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability; (9, 0) is Hopper
    name: str = ""

    @property
    def hopper(self) -> bool:
        """A Hopper GPU (sm_90): TMA, wgmma and the Gluon kernels written for them."""
        return self.kind == "cuda" and self.capability[0] == 9


# a stand-in for the interpreter: any number of programs runs (one after another), shared memory is host memory
INTERPRETER_DEVICE = Device("interpreter", sms=1 << 30, shared_memory=1 << 30)


@functools.cache
def _cuda_device(index: int) -> Device:
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 232448  # Hopper's opt-in limit where unreported
    return Device("cuda", props.multi_processor_count, shared, (props.major, props.minor), props.name)


def device_of(tensor: torch.Tensor) -> Device:
    """The :class:`Device` a call on ``tensor`` runs on."""
    if tensor.device.type == "cuda" and not interpreter_enabled():
        return _cuda_device(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())
    if interpreter_enabled():
        return INTERPRETER_DEVICE
    return Device("cpu", sms=1, shared_memory=0)


def resident_programs(device: torch.device) -> int:
    """Programs surely resident at once for a grid wait: one per SM (any count under the interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitWorkspace:
    """fp32 partials (uninitialised, per call) and int32 arrival counters (zeroed once, kept) of one tile kind."""

    # (device, stream, tile kind, SPLIT) -> int32 counters; each call adds SPLIT to every counter of the
    # tiles it splits, so a counter is a multiple of its SPLIT whenever no call is running
    _counters: dict = {}

    @classmethod
    def for_tiles(cls, slot: str, num_tiles: int, split: int, block_m: int, block_n: int, device: torch.device):
        """(partials, counters) of ``num_tiles`` tiles of [block_m, block_n], each split over ``split`` programs
        (one-element placeholders, which no kernel reads or writes, where nothing is split)."""
        if split == 1 or num_tiles == 0:
            return cls.placeholders(device)
        if split & (split - 1):
            raise ValueError(f"config: SPLIT must be a power of two, got {split}")
        partials = allocate((num_tiles * split * block_m * block_n,), dtype=torch.float32, device=device)
        return partials, cls.counters(slot, split, num_tiles, device)

    _placeholders: dict = {}  # str(device) -> (one fp32 element, the same as int32), kept

    @classmethod
    def placeholders(cls, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The workspace arguments of a tile kind that is not split: one element, allocated once per device (not
        every call: an unsplit kind's kernel arguments are never dereferenced)."""
        pair = cls._placeholders.get(str(device))
        if pair is None:
            empty = allocate((1,), dtype=torch.float32, device=device)
            pair = (empty, empty.view(torch.int32))
            if not capturing(device):  # memory of a graph's private pool must not outlive the graph
                cls._placeholders[str(device)] = pair
        return pair

    # (device, slot, split) -> zeroed int32 counters no launch has used yet, made by an eager call for the next CUDA
    # graph captured with that slot (a capture cannot zero memory outside the graph, and zeros made inside it are a
    # memset node that every replay runs first: 0.8-1.3 us of a 15-25 us call at 1-128 tokens on the H200)
    _spares: dict = {}
    _graph_owned: list = []  # the spares captures took: graphs keep no references, so they live as long as the process

    @classmethod
    def counters(cls, slot: str, split: int, size: int, device: torch.device) -> torch.Tensor:
        """int32 counters (at least ``size``) for the calls of one slot on the current stream: zeroed once, then
        kept, each call adding to them. A CUDA graph's capture takes a spare set an eager call made ready (the graph's
        own from then on, so that no launch outside it moves its counts), else zeros made inside the graph."""
        spare_key = (str(device), slot, split)
        if capturing(device):
            spare = cls._spares.pop(spare_key, None)
            if spare is not None and spare.numel() >= size:
                cls._graph_owned.append(spare)
                return spare
            return torch.zeros(max(size, 1024), dtype=torch.int32, device=device)  # in the graph's private pool
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream, slot, split)
        buffer = cls._counters.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = cls._counters[key] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        spare = cls._spares.get(spare_key)
        if spare is None or spare.numel() < size:
            cls._spares[spare_key] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        return buffer


def dot_flags(x: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, PRECISION): fp32 dots under the interpreter (its bf16 dot is wrong); exact fp32 products
    for fp32 inputs."""
    return interpreter_enabled(), ("ieee" if x.dtype == torch.float32 else "tf32")
