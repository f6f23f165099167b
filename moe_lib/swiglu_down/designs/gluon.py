"""P1's Hopper design: the two launches of :mod:`.triton_launches` in Gluon, TMA-fed and warp-specialised.

    launch 1 (:mod:`..gluon_launch1`)   dA = dy · Wd with the dSwiGLU epilogue → dGate, dUp (hi, and lo with
                                        WITH_LO); dWd = dyᵀ · intermediate (here, or in launch 2)
    launch 2 (:mod:`..gluon_launch2`)   dx = dGate · Wg + dUp · Wu;  dWg = dGateᵀ · x, dWu = dUpᵀ · x  (and dWd)

In each program one warp issues TMA copies into a ring of shared-memory buffers guarded by mbarriers and two
warpgroups issue wgmma on them. Both launches are made ready before the first is issued, and in eager calls
submitted as one CUDA graph (``as_one_graph``), so that no host work stands between them; launch 2 is issued by
programmatic dependent launch where its config says so. A form is the pair of launch configs; :data:`FORMS` names
the ones the chooser (:mod:`..choose`) takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...encoded_launch import can_launch_as_one_graph, launch_as_one_graph
from ...tma import rows_fit
from .. import runtime
from ..gluon_launch1 import GluonFirstLaunchConfig, prepare_first_launch_gluon
from ..gluon_launch2 import TRACE_FIELDS, GluonSecondLaunchConfig, prepare_second_launch_gluon
from ..runtime import Device, SplitWorkspace
from .base import SIXTEEN_BIT, Inputs, Outputs


@dataclass(frozen=True)
class GluonLaunches:
    """The two Gluon launches' configs (a form)."""

    name: ClassVar[str] = "gluon_launches"

    first: GluonFirstLaunchConfig
    second: GluonSecondLaunchConfig
    # the two launches submitted as one CUDA graph in eager calls (:func:`~moe_lib.encoded_launch.launch_as_one_graph`):
    # both reach the GPU before the first starts, whatever the host's time between them
    as_one_graph: bool = True

    def __post_init__(self):
        if self.first.grad_down_tiles == self.second.grad_down_tiles:
            raise ValueError(
                "config: dWd's tiles go in exactly one launch: first.grad_down_tiles and "
                "second.grad_down_tiles must differ"
            )

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        if not device.hopper:
            return "the Gluon kernels need a Hopper GPU (sm_90)"
        if dtype not in SIXTEEN_BIT:
            return f"the Gluon kernels take 16-bit operands, got {dtype}"
        if not rows_fit(hidden_size, intermediate_size, element_bytes=2):
            return f"TMA needs rows of 16-byte multiples: H = {hidden_size}, I = {intermediate_size} elements of 2 B"
        if not aligned:
            return "TMA needs every operand to start on a 16-byte boundary"
        if num_tokens == 0:
            return "a TMA descriptor needs at least one token row"
        return None

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None:
        x, I = inputs.x, inputs.gate_weight.shape[0]
        T, H = x.shape
        first, second = self.first, self.second
        d_gate = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        d_up = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        traces = {}  # with traced_programs(): a row per program of each launch
        if _PROGRAM_TRACES is not None:
            traces = {
                name: torch.zeros((launch.programs(T, H, I), len(TRACE_FIELDS)), dtype=torch.int64, device=x.device)
                for name, launch in (("launch 1", first), ("launch 2", second))
            }
            _PROGRAM_TRACES.append(traces)
        # everything both launches need is made ready before the first: between them only the launch
        grad_x_workspace = SplitWorkspace.for_tiles(
            "gluon dx", second.grad_x_tiles(T, H), second.grad_x_splits, second.block_m, second.block_n, x.device
        )
        launch2 = prepare_second_launch_gluon(
            second,
            x,
            inputs.gate_weight,
            inputs.up_weight,
            d_gate,
            d_up,
            out.grad_x,
            out.grad_gate_weight,
            out.grad_up_weight,
            grad_x_workspace,
            with_lo=with_lo,
            grad_down_operands=(inputs.grad_output, inputs.intermediate, out.grad_down_weight),
            trace=traces.get("launch 2"),
        )
        launch1 = prepare_first_launch_gluon(
            first,
            inputs.grad_output,
            inputs.down_weight,
            inputs.gate,
            inputs.gate_sigmoid,
            inputs.gate_silu,
            inputs.up,
            inputs.intermediate,
            d_gate,
            d_up,
            out.grad_down_weight,
            with_lo=with_lo,
            trace=traces.get("launch 1"),
        )
        if self.as_one_graph and can_launch_as_one_graph((launch1, launch2)):
            launch_as_one_graph(
                (x.device, x.dtype, with_lo, first, second, T, H, I, bool(traces)), (launch1, launch2), x.device
            )
            return
        launch1()
        launch2()


def grad_down_in_second_launch(form: GluonLaunches) -> GluonLaunches:
    """``form`` with dWd's tiles moved to launch 2 (there they wait for nothing: they read only the call's inputs)."""
    return dataclasses.replace(
        form,
        first=dataclasses.replace(form.first, grad_down_tiles=False),
        second=dataclasses.replace(form.second, grad_down_tiles=True),
    )


def with_second(form: GluonLaunches, **fields) -> GluonLaunches:
    """``form`` with ``fields`` of launch 2's config replaced."""
    return dataclasses.replace(form, second=dataclasses.replace(form.second, **fields))


# The launch configs the forms are made of (notes/p1/design-14.md to design-22.md measured each option): launch 1 with
# 128 × 128 tiles ("wide"), 64-row ones ("tall_64") or 64 × 64 dA tiles beside 128-wide dWd ones ("narrow"); its
# epilogue's stores all in flight and the saved tiles asked for early; launch 2 with 64-row tiles ("tall") or the
# default 128 × 256, issued by programmatic dependent launch
_LAUNCH1 = GluonFirstLaunchConfig(buffers=6, early_dependents=True, stores_in_flight=True, saved_tiles_early=True)
_LAUNCH1_TALL = dataclasses.replace(_LAUNCH1, block_m=64, warps=4, buffers=8, d_a_first=True)
_LAUNCH2 = GluonSecondLaunchConfig(programmatic=True)
_LAUNCH2_TALL = GluonSecondLaunchConfig(block_m=64, warps=4, buffers=6, programmatic=True)
# at few tokens launch 2's weight-gradient tiles go to 68 persistent programs beside dx's (notes/p1/design-19.md)
_LAUNCH2_PERSISTENT = dataclasses.replace(
    _LAUNCH2_TALL, grad_x_first=True, weight_grad_programs=68, inputs_before_wait=True
)

FORMS = {  # name -> the pair of launch configs
    "narrow": GluonLaunches(
        dataclasses.replace(_LAUNCH1_TALL, block_n=64, d_a_block_n=64, grad_down_block_n=128), _LAUNCH2_PERSISTENT
    ),
    "tall": GluonLaunches(_LAUNCH1_TALL, _LAUNCH2_PERSISTENT),
    "tall_dx_first": GluonLaunches(_LAUNCH1_TALL, dataclasses.replace(_LAUNCH2_TALL, grad_x_first=True)),
    "wide_da_first": GluonLaunches(
        dataclasses.replace(_LAUNCH1, d_a_first=True), dataclasses.replace(_LAUNCH2_TALL, grad_x_first=True)
    ),
    "wide_da_first_tall": GluonLaunches(dataclasses.replace(_LAUNCH1, d_a_first=True), _LAUNCH2_TALL),
    "wide_tall": GluonLaunches(_LAUNCH1, _LAUNCH2_TALL),
    "wide": GluonLaunches(_LAUNCH1, _LAUNCH2),
    "wide_da256": GluonLaunches(
        dataclasses.replace(_LAUNCH1, d_a_block_n=256, buffers=4, saved_tiles_early=False), _LAUNCH2
    ),
    "wide_narrow_da": GluonLaunches(dataclasses.replace(_LAUNCH1, block_n=64, d_a_block_n=64), _LAUNCH2),
}


_PROGRAM_TRACES: list | None = None  # set inside traced_programs(): where the calls' program traces go


@contextlib.contextmanager
def traced_programs():
    """A diagnostic: inside it, the Gluon launches run a build that records, per program, when it started, when it
    could go on (launch 2: past its wait for launch 1), when it ended (the GPU's global timer, ns), its SM and its
    tile kind (0: the weight-gradient tiles, 1: dA's or dx's). Yields a list; each call inside appends
    {"launch 1": tensor, "launch 2": tensor}, int64 [programs, len(TRACE_FIELDS)], filled as the launches run (on the
    device, so read them after a synchronisation). Calls of other designs append nothing.
    ``scripts/p1/p1_program_trace.py`` reads them."""
    global _PROGRAM_TRACES
    if _PROGRAM_TRACES is not None:
        raise RuntimeError("traced_programs: already inside one")
    _PROGRAM_TRACES = []
    try:
        yield _PROGRAM_TRACES
    finally:
        _PROGRAM_TRACES = None
