"""Expert parallelism for the MoE expert layer (P2) on ``torch.distributed``.

Who holds what. A process group of W ranks shares E experts: rank r holds the contiguous block
``expert_partition(E, W)[r]`` of expert weights (its *local* experts, numbered 0..L_r − 1 there);
when W does not divide E, the first E % W ranks hold one expert more. Each rank brings its own
tokens: hidden_states [T_r, H], topk_indices [T_r, K] with *global* expert ids, topk_weights [T_r, K].
T_r may differ between ranks (0 included). Outputs and the gradients of hidden_states and
topk_weights stay on the token's rank; the gradients of the expert weights land on the expert's rank.

Each (token, slot) pair is one *row*: rank r has N_r = T_r·K rows, and a row travels to the rank that
holds its expert, together with its routing weight (the weights travel, so that the expert's rank
runs the same backward as the single-device layer, :func:`moe_lib.moe_experts_backward`, which
computes the routing-weight gradient ⟨Wd_eᵀ dy, a⟩ without forming the expert output). A row whose
expert is on its own rank goes through ``all_to_all_single``'s chunk for the rank itself (a local
copy in NCCL and gloo); the counts below include it.

Exchanges, in order (S = rows this rank sends, R = rows it receives):

    forward   arguments int64 [W, 11 + 480] by ``all_gather``: each rank's outcome of its local argument
                        checks (and the error message, when they failed), H, I, K, the dtypes of
                        hidden_states and topk_weights, num_experts as given, its local expert count,
                        its ``chunks`` (0 for None) and its rows T_r·K
              counts    int64 [W, 3 + L_max] each way (``all_to_all_single``, as every exchange below):
                        per destination, this rank's status (local expert count, "an expert id out of
                        range", "a token lists an expert twice") and how many of its rows go to each
                        of the destination's local experts
              dispatch  hidden-state rows [S, H] out, [R, H] in; routing weights [S] out, [R] in
              combine   weighted expert outputs w·Wd_e(silu(Wg_e x) ⊙ Wu_e x): [R, H] out, [S, H] back
    backward  dispatch  output-gradient rows [S, H] out, [R, H] in (the splits of the forward dispatch)
              combine   hidden-state gradient rows [R, H] and routing-weight gradients [R] back to
                        the token's rank ([S, H], [S]), where each token sums its K rows

Rows leave in the order of their global expert id (so grouped by destination rank and, within it, by
local expert); the expert's rank reads each row's local expert from the counts, with no id exchange.
Sums over a token's K rows are taken in a fixed order (deterministic; no atomics).

Overlap (``chunks`` = C > 1). The rows are cut into C chunks by their expert: chunk c holds the rows routed
to the c-th of C contiguous groups of each rank's local experts (``expert_chunks(L_d, C)[c]`` on rank d), and
every exchange above after the arguments runs once per chunk, asynchronously: while the experts compute chunk
i, chunk i + 1's dispatch and chunk i − 1's combine are in flight (NCCL runs them on its own stream; gloo on
its own thread). In the forward:

    start dispatch(0); for i: start dispatch(i + 1), wait dispatch(i), experts of group i, start combine(i);
    then wait every combine and sum each token's K rows

and the backward runs the same schedule around the local expert backward. Each expert's rows all fall in one
chunk, so every expert's weights are read once per pass and its weight gradients are computed once, over the
same rows in the same order as without chunks: the results do not depend on C. One counts exchange (one host
sync) serves every chunk. Every rank must pass the same C (checked with the arguments); the default, None,
takes 2 where the group's mean rows per rank reach :data:`AUTO_CHUNKS_MIN_ROWS`, else 1. What chunks cost:
C times the kernel launches and exchange calls, each on fewer rows; measure it (``python -m
moe_lib.bench.parallel --chunks 1,2,4``).

Errors: no rank raises alone while the others wait in a collective. The arguments exchange comes
before any data moves: a rank whose arguments fail their checks sends its error instead, and every rank
then raises that same error (naming the rank); so do ranks that disagree on H, I, the dtypes or
``num_experts``, which would otherwise exchange rows of different sizes (gloo aborts the process, NCCL
may hang). The counts exchange carries each rank's status (bad expert ids, a wrong number of local
experts) the same way.

Compilation. The layer is two ops, ``torch.ops.moe_lib.moe_experts_parallel`` (the checks, both exchanges of
arguments and counts, and the forward) and ``moe_experts_parallel_backward`` (autograd registered), each with a
fake implementation (the rows a rank receives are a size known only after the counts exchange); so
``torch.compile(fullgraph=True)`` takes the layer whole. The forward op also returns what its backward needs: the
received rows and their routing weights and experts, the send order, and the counts as one CPU tensor, read by
the backward without a device sync. An ``ExpertParallelStats`` is eager-only (it records host-side timings).

Host synchronisation: the arguments exchange is read back once per forward (one ``.tolist()``), and
so is the counts exchange, since ``all_to_all_single`` takes its split sizes as Python ints. There is
no other host sync (with the Triton backward; the reference backward, meant for the CPU, has its
own). Every rank of the group must call the forward and the backward together. A rank that dies or
never makes the call leaves the others waiting for the process group's ``timeout``
(``torch.distributed.init_process_group(..., timeout=datetime.timedelta(seconds=...))``; 10 minutes
for NCCL and 30 for gloo by default): set it to bound that wait.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from ..dispatch import check_impl, resolve_impl
from ..precision import tf32_disabled
from ..validation import check_arguments, finite, flag
from .api import moe_experts_backward, moe_experts_forward
from .checks import PARALLEL_ARGUMENTS, PARALLEL_SIZES_FROM, check_routing_has_values

STATUS_COLUMNS = ("local_experts", "index_out_of_range", "duplicate_expert")
# the arguments exchange: one int64 row per rank, these fields, then the bytes of its error message
ARGUMENT_FIELDS = (
    "error",
    "hidden_size",
    "intermediate_size",
    "top_k",
    "dtype",
    "topk_weights_dtype",
    "num_experts",
    "local_experts",
    "chunks",
    "rows",
    "message_bytes",
)
MESSAGE_BYTES = 480
# chunks=None: two chunks when the group's mean rows per rank (tokens · K) reach this, else one. Measured on two
# H200s at P2's shape (notes/parallel/overlapped-exchange.md): two chunks 4-7% faster in bf16 from 8192
# tokens per rank (65536 rows), within 1% in fp32 there and 2% faster at 32768; slower at 2048 (+2 to +15%).
AUTO_CHUNKS_MIN_ROWS = 65536
ERROR_KINDS = (None, ValueError, TypeError)  # the "error" field: 0 none, 1 ValueError, 2 TypeError
EXCHANGED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # others are sent as -1


def expert_partition(num_experts: int, world_size: int) -> list[range]:
    """The global expert ids each rank holds: rank r gets a contiguous block; the first
    ``num_experts % world_size`` ranks hold one expert more (ranks past ``num_experts`` hold none).

    >>> expert_partition(6, 4)
    [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    """
    for name, value in (("num_experts", num_experts), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    base, extra = divmod(num_experts, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        count = base + (1 if rank < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


class PhaseTimer:
    """Time spent in named phases of the layer, summed per name over everything recorded since the
    last :meth:`reset`: CUDA events on a CUDA device (read after a synchronize), wall clock elsewhere."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._records: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._records.append((name, start, end))

    def mark(self, name: str) -> None:
        """Records an instant (a phase of zero length): when the host issued something, on the stream's clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self._records.append((name, event, event))

    def timeline_ms(self) -> list[dict]:
        """Every phase and mark recorded since the last :meth:`reset`, in the order they ended (a phase is
        recorded when it ends): dict(name, start_ms, end_ms) from the earliest start."""
        if not self._records:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        origin = self._records[0][1]

        def since(event) -> float:
            return origin.elapsed_time(event) if self.device.type == "cuda" else (event - origin) * 1e3

        spans = [(name, since(start), since(end)) for name, start, end in self._records]
        earliest = min(start for _, start, _ in spans)
        return [dict(name=name, start_ms=start - earliest, end_ms=end - earliest) for name, start, end in spans]

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase name."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        totals: dict[str, float] = {}
        for name, start, end in self._records:
            elapsed = start.elapsed_time(end) if self.device.type == "cuda" else (end - start) * 1e3
            totals[name] = totals.get(name, 0.0) + elapsed
        return totals

    def reset(self) -> None:
        self._records.clear()


# phase names, by kind, for readers of PhaseTimer.totals_ms()
ALL_TO_ALL_PHASES = ("counts_exchange", "dispatch", "combine", "backward_dispatch", "backward_combine")
EXPERT_PHASES = ("expert_forward", "expert_backward")


@dataclass
class ExpertParallelStats:
    """Filled in by :func:`moe_experts_parallel` on the rank that passes it.

    ``rows_sent[s]``: (token, slot) rows this rank sent to rank s (its own index included: rows for
    its own experts, which go through all_to_all_single's chunk to itself); ``rows_received[s]``:
    rows it received from rank s. With a ``timer``, the phases of the forward and backward are
    recorded in it (names in :data:`ALL_TO_ALL_PHASES` and :data:`EXPERT_PHASES`). An exchange phase is
    the compute stream's wait for that exchange (all of it without overlap, what is left of it with
    ``chunks`` > 1); each exchange's issue is marked "<phase> issued" (:meth:`PhaseTimer.timeline_ms`).
    """

    rows_sent: list[int] = field(default_factory=list)
    rows_received: list[int] = field(default_factory=list)
    chunks: int = 0  # the chunk count the call ran with (its ``chunks``, or the one None chose)
    timer: PhaseTimer | None = None

    def phase(self, name: str):
        return self.timer.phase(name) if self.timer is not None else contextlib.nullcontext()

    def mark(self, name: str) -> None:
        if self.timer is not None:
            self.timer.mark(name)


@dataclass
class _ChunkPlan:
    """One chunk of the exchange: the rows routed to one group of every rank's local experts
    (``expert_chunks(L_d, C)[c]`` on rank d).

    On the token's rank: ``send_slot[i]`` is the slot t·K + k of the chunk's send row i (rows ordered by
    global expert id), ``send_splits[s]`` how many of them go to rank s. On the expert's rank:
    ``experts`` are this rank's local experts in the chunk, ``receive_splits[s]`` rows come from rank s,
    ``received_local_expert[j]`` is received row j's expert counted from ``experts.start``,
    ``expert_order`` sorts the received rows by that expert and ``expert_row_counts[e]`` is how many
    received rows the chunk's e-th expert has.
    """

    send_slot: torch.Tensor
    send_splits: list[int]
    experts: range
    receive_splits: list[int]
    received_local_expert: torch.Tensor
    expert_order: torch.Tensor
    expert_row_counts: list[int]


@dataclass
class _DispatchPlan:
    """Where every row goes, worked out from the counts exchange (identical for forward and backward):
    this rank's T tokens of K slots each, in ``chunks`` (one :class:`_ChunkPlan` each). The combines return the
    chunks' rows one after the other, each chunk's in its send order: ``row_of_slot[t·K + k]`` is where slot
    (t, k)'s row lands in that buffer."""

    group: object
    num_tokens: int
    top_k: int
    chunks: list[_ChunkPlan]
    row_of_slot: torch.Tensor
    num_experts: int
    tables: tuple[list[list[int]], list[list[int]]]  # the counts exchange as sent and as received, [W][3 + L_max]
    sent_slots: torch.Tensor  # every chunk's send_slot, one after the other
    received_local_expert: torch.Tensor  # every chunk's received_local_expert, one after the other

    def layout(self) -> torch.Tensor:
        """The plan's host side as one int64 CPU tensor (an op's output; the backward op rebuilds the plan from it,
        ``sent_slots`` and ``received_local_expert``): E, C, W, the tables' width, then both tables."""
        sent, received = self.tables
        values = [self.num_experts, len(self.chunks), len(sent), len(sent[0])]
        return torch.tensor(values + [n for row in sent + received for n in row], dtype=torch.int64)


def moe_experts_parallel(
    hidden_states,
    topk_indices,
    topk_weights,
    local_gate_weights,
    local_up_weights,
    local_down_weights,
    *,
    group=None,
    impl: str = "auto",
    num_experts: int | None = None,
    stats: ExpertParallelStats | None = None,
    check_finite: bool = False,
    chunks: int | None = None,
):
    """Expert-parallel ``moe_lib.moe_experts``: y_t = Σ_k w_tk · Wd_e(silu(Wg_e x_t) ⊙ Wu_e x_t).

    On every rank of ``group`` (default: the default group): hidden_states [T_r, H] (this rank's
    tokens), topk_indices [T_r, K] global expert ids e (int64/int32, K distinct per token),
    topk_weights [T_r, K]; local_gate_weights, local_up_weights [L_r, I, H] and local_down_weights
    [L_r, H, I] are the experts ``expert_partition(num_experts, W)[rank]``. Returns y [T_r, H] for
    this rank's tokens, differentiable in hidden_states, topk_weights (their gradients stay on this
    rank) and the local expert weights (their gradients are this rank's experts'). The expert
    forward runs here in the input dtype (fp32 with TF32 off); the backward runs
    ``moe_lib.moe_experts_backward(impl=impl)`` on the rows this rank received ("reference" on CPU,
    "auto"/"triton" on CUDA).

    ``num_experts`` (E): when None on every rank it is the sum of every rank's local count; ranks that
    give it must agree. K = 0 (no expert per token) gives y = 0 and zero gradients, as on one device.
    Host syncs: one ``.tolist()`` of the arguments exchange and one of the counts exchange, which
    ``all_to_all_single`` needs as Python split sizes. ``stats``: an :class:`ExpertParallelStats` to
    fill with the rows sent to / received from each rank (and phase times when it has a timer).
    NaN/Inf in the inputs pass through unchecked; ``check_finite=True`` checks this rank's inputs.
    ``chunks``: cut the rows into that many chunks (by expert group) whose exchanges overlap the expert compute
    of their neighbours (module docstring, "Overlap"); every rank must pass the same value. 1: each exchange
    whole, before and after the experts. None (the default): 2 where the group's mean rows per rank (T_r·K)
    reach :data:`AUTO_CHUNKS_MIN_ROWS`, else 1.

    Errors, raised alike on every rank before any data moves (each rank's argument checks are
    exchanged first): a ``ValueError``/``TypeError`` naming the argument and the rank whose arguments
    failed; ranks that disagree on hidden_size, intermediate_size, dtypes or ``num_experts``. After the
    counts exchange, alike on every rank: an expert id out of range, a token listing an expert twice,
    or a local expert count that does not match the partition. Without an initialised process group the
    argument checks raise here alone. A rank that dies or skips the call leaves the others waiting for
    the process group's ``timeout`` (an argument of ``torch.distributed.init_process_group``).
    """
    if group is None:
        group = dist.group.WORLD
    argument_error = ""
    read_values = not torch.compiler.is_compiling()  # else the op checks the values (check_finite) itself
    try:
        _check_call(
            hidden_states,
            topk_indices,
            topk_weights,
            local_gate_weights,
            local_up_weights,
            local_down_weights,
            impl,
            num_experts,
            stats,
            check_finite,
            chunks,
            read_values=read_values,
        )
    except (ValueError, TypeError) as exc:
        if not dist.is_initialized():  # no other rank to tell
            raise
        # told to every rank by the op's arguments exchange; what the op cannot take is replaced meanwhile
        argument_error = f"{type(exc).__name__}:{exc}"
        hidden_states, topk_indices, topk_weights, local_gate_weights, local_up_weights, local_down_weights = (
            t if isinstance(t, torch.Tensor) else torch.empty(0)
            for t in (
                hidden_states,
                topk_indices,
                topk_weights,
                local_gate_weights,
                local_up_weights,
                local_down_weights,
            )
        )
        impl, num_experts, stats, check_finite, chunks = "reference", None, None, False, None
    if stats is not None and torch.compiler.is_compiling():
        raise TypeError("stats: ExpertParallelStats records host-side timings; leave it out under torch.compile")
    y, *_ = torch.ops.moe_lib.moe_experts_parallel(
        hidden_states.contiguous(),
        topk_indices,
        topk_weights.contiguous(),
        local_gate_weights,
        local_up_weights,
        local_down_weights,
        group.group_name,
        impl,
        num_experts,
        chunks,
        check_finite and not read_values,
        _stats_key(stats),
        argument_error,
    )
    return y


# Custom ops take tensors and plain values: a caller's ExpertParallelStats reaches them as a key into this table
# (0: none). Weak values: a call's entry goes when the caller drops its stats.
_STATS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_STATS_KEYS = itertools.count(1)


def _stats_key(stats: ExpertParallelStats | None) -> int:
    if stats is None:
        return 0
    key = next(_STATS_KEYS)
    _STATS[key] = stats
    return key


def _stats(key: int) -> ExpertParallelStats:
    return _STATS.get(key) or ExpertParallelStats()


@torch.library.custom_op("moe_lib::moe_experts_parallel", mutates_args=())
def _moe_experts_parallel_op(
    hidden_states: Tensor,
    topk_indices: Tensor,
    topk_weights: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    group_name: str,
    impl: str,
    num_experts: int | None,
    chunks: int | None,
    check_finite: bool,
    stats_key: int,
    argument_error: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The layer's forward on this rank (its arguments checked by :func:`moe_experts_parallel`, whose failure comes
    as ``argument_error``, "Kind:message"): the arguments exchange, the counts exchange, then dispatch, experts and
    combine. Returns (y [T, H], the received rows [R, H], their routing weights [R] and local experts [R], the
    plan's ``sent_slots`` [T·K], its :meth:`_DispatchPlan.layout`): what the backward needs besides the weights."""
    group = _resolve_process_group(group_name)
    sizes, local_error = None, None
    if argument_error:
        kind, message = argument_error.split(":", 1)
        local_error = (TypeError if kind == "TypeError" else ValueError)(message)
    else:
        try:
            if check_finite:  # the one check that reads values
                finite(
                    dict(
                        hidden_states=hidden_states,
                        topk_weights=topk_weights,
                        local_gate_weights=gate,
                        local_up_weights=up,
                        local_down_weights=down,
                    )
                )
            sizes = _check_inputs(hidden_states, topk_indices, topk_weights, gate, up, down)
        except (ValueError, TypeError) as exc:
            local_error = exc
    num_experts, chunks = _agree_on_arguments(
        sizes, local_error, num_experts, hidden_states, topk_weights, chunks, group
    )
    stats = _stats(stats_key)
    plan = _plan_dispatch(topk_indices, num_experts, sizes["local_experts"], chunks, group, stats)
    stats.chunks = chunks
    stats.rows_sent = [sum(column) for column in zip(*(c.send_splits for c in plan.chunks), strict=True)]
    stats.rows_received = [sum(column) for column in zip(*(c.receive_splits for c in plan.chunks), strict=True)]
    y, received_x, received_w = _parallel_forward(hidden_states, topk_weights, gate, up, down, plan, impl, stats)
    return y, received_x, received_w, plan.received_local_expert, plan.sent_slots, plan.layout()


@_moe_experts_parallel_op.register_fake
def _(hidden_states, topk_indices, topk_weights, gate, up, down, *arguments):
    received = torch.library.get_ctx().new_dynamic_size()  # rows from the other ranks: known after the exchange
    layout = torch.library.get_ctx().new_dynamic_size()
    return (
        hidden_states.new_empty(hidden_states.shape),
        hidden_states.new_empty(received, hidden_states.shape[1]),
        topk_weights.new_empty(received),
        topk_indices.new_empty(received, dtype=torch.int64),
        topk_indices.new_empty(topk_indices.numel(), dtype=torch.int64),
        torch.empty(layout, dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("moe_lib::moe_experts_parallel_backward", mutates_args=())
def _moe_experts_parallel_backward_op(
    grad_output: Tensor,
    received_x: Tensor,
    received_w: Tensor,
    received_local_expert: Tensor,
    sent_slots: Tensor,
    layout: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    top_k: int,
    group_name: str,
    impl: str,
    stats_key: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The layer's backward on this rank: the plan rebuilt from the forward's outputs (no exchange, no host sync),
    then the adjoint exchanges around the local experts' backward."""
    plan = _plan_from_layout(
        layout, sent_slots, received_local_expert, grad_output.shape[0], top_k, _resolve_process_group(group_name)
    )
    return _parallel_backward(grad_output, received_x, received_w, gate, up, down, plan, impl, _stats(stats_key))


@_moe_experts_parallel_backward_op.register_fake
def _(
    grad_output, received_x, received_w, received_local_expert, sent_slots, layout, gate, up, down, top_k, *arguments
):
    return (
        grad_output.new_empty(grad_output.shape),
        received_w.new_empty(grad_output.shape[0], top_k),
        gate.new_empty(gate.shape),
        up.new_empty(up.shape),
        down.new_empty(down.shape),
    )


def _save_for_backward(ctx, inputs, output):
    topk_indices, gate, up, down = inputs[1], *inputs[3:6]
    # received rows, their weights and experts; sent slots; the layout, on the CPU: read there without a device sync
    ctx.save_for_backward(gate, up, down, *output[1:])
    ctx.top_k, ctx.group_name, ctx.impl, ctx.stats_key = topk_indices.shape[1], inputs[6], inputs[7], inputs[11]
    # the saved outputs are reached by no loss: without this autograd hands the backward zeros of their shapes
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_output, *_grads_of_the_saved):
    gate, up, down, received_x, received_w, received_local_expert, sent_slots, layout = ctx.saved_tensors
    grad_x, grad_w, grad_gate, grad_up, grad_down = torch.ops.moe_lib.moe_experts_parallel_backward(
        grad_output.contiguous(),
        received_x,
        received_w,
        received_local_expert,
        sent_slots,
        layout,
        gate,
        up,
        down,
        ctx.top_k,
        ctx.group_name,
        ctx.impl,
        ctx.stats_key,
    )
    return grad_x, None, grad_w, grad_gate, grad_up, grad_down, *([None] * 7)


torch.library.register_autograd("moe_lib::moe_experts_parallel", _backward, setup_context=_save_for_backward)


def expert_chunks(local_experts: int, chunks: int) -> list[range]:
    """``chunks`` contiguous ranges of local expert indices covering 0..local_experts − 1, sizes differing by at
    most one (empty ranges when a rank holds fewer experts than chunks).

    >>> expert_chunks(10, 3)
    [range(0, 3), range(3, 6), range(6, 10)]
    """
    bounds = [local_experts * c // chunks for c in range(chunks + 1)]
    return [range(start, stop) for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]


def _check_call(
    hidden_states,
    topk_indices,
    topk_weights,
    gate,
    up,
    down,
    impl,
    num_experts,
    stats,
    check_finite,
    chunks,
    *,
    read_values: bool = True,
) -> dict:
    """This rank's argument checks (values read only with ``check_finite`` and ``read_values``); returns the
    sizes."""
    check_impl(impl)
    flag("check_finite", check_finite)
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"chunks: expected a positive integer or None, got {chunks!r}")
    sizes = _check_inputs(hidden_states, topk_indices, topk_weights, gate, up, down)
    resolve_impl(impl, hidden_states.device, hidden_states.dtype)
    if num_experts is not None:
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts: expected a positive integer or None, got {num_experts!r}")
        if sizes["top_k"] > num_experts:
            raise ValueError(f"topk_indices: top_k={sizes['top_k']} exceeds num_experts={num_experts}")
    if stats is not None and not isinstance(stats, ExpertParallelStats):
        raise TypeError(f"stats: expected an ExpertParallelStats or None, got {type(stats).__name__}")
    if check_finite and read_values:
        finite(
            dict(
                hidden_states=hidden_states,
                topk_weights=topk_weights,
                local_gate_weights=gate,
                local_up_weights=up,
                local_down_weights=down,
            )
        )
    return sizes


def _check_inputs(hidden_states, topk_indices, topk_weights, gate, up, down) -> dict:
    """Shape, dtype and device checks of :data:`.checks.PARALLEL_ARGUMENTS` (metadata only); returns the sizes."""
    values = dict(
        hidden_states=hidden_states,
        topk_indices=topk_indices,
        topk_weights=topk_weights,
        local_gate_weights=gate,
        local_up_weights=up,
        local_down_weights=down,
    )
    sizes = check_arguments(PARALLEL_ARGUMENTS, values, PARALLEL_SIZES_FROM)
    check_routing_has_values(topk_indices)
    return sizes


def _exchange_device(group) -> torch.device:
    """Where the small exchanges' tensors live: the current CUDA device for NCCL, the CPU otherwise."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _argument_row(sizes, local_error, num_experts, hidden_states, topk_weights, chunks) -> list[int]:
    """This rank's row of the arguments exchange (see :data:`ARGUMENT_FIELDS`)."""
    if local_error is not None:
        message = str(local_error).encode()[:MESSAGE_BYTES].decode(errors="ignore").encode()
        kind = ERROR_KINDS.index(TypeError if isinstance(local_error, TypeError) else ValueError)
        row = [kind] + [-1] * (len(ARGUMENT_FIELDS) - 2) + [len(message)]
        return row + list(message) + [0] * (MESSAGE_BYTES - len(message))
    dtype_codes = [
        EXCHANGED_DTYPES.index(t.dtype) if t.dtype in EXCHANGED_DTYPES else -1 for t in (hidden_states, topk_weights)
    ]
    row = [
        0,
        sizes["hidden_size"],
        sizes["intermediate_size"],
        sizes["top_k"],
        *dtype_codes,
        -1 if num_experts is None else num_experts,
        sizes["local_experts"],
        0 if chunks is None else chunks,
        sizes["num_tokens"] * sizes["top_k"],
        0,
    ]
    return row + [0] * MESSAGE_BYTES


def _agree_on_arguments(sizes, local_error, num_experts, hidden_states, topk_weights, chunks, group) -> tuple[int, int]:
    """Exchanges every rank's argument checks and sizes (an all_gather and one host sync) and raises the same
    error on every rank when any rank's checks failed or the ranks disagree; returns (num_experts, chunks)."""
    row = torch.tensor(
        _argument_row(sizes, local_error, num_experts, hidden_states, topk_weights, chunks),
        dtype=torch.int64,
        device=_exchange_device(group),
    )
    gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, row, group=group)
    table = [
        dict(zip(ARGUMENT_FIELDS, values, strict=False)) | {"message": values[len(ARGUMENT_FIELDS) :]}
        for values in torch.stack(gathered).tolist()
    ]
    failed = [r for r, entry in enumerate(table) if entry["error"]]
    if failed:
        first = table[failed[0]]
        message = bytes(first["message"][: first["message_bytes"]]).decode(errors="ignore")
        others = f"; rank(s) {failed[1:]} failed their argument checks too" if len(failed) > 1 else ""
        raise ERROR_KINDS[first["error"]](f"{message} (on rank {failed[0]}{others})") from local_error
    for field_name, argument, error in (
        ("hidden_size", "hidden_states", ValueError),
        ("dtype", "hidden_states", TypeError),
        ("topk_weights_dtype", "topk_weights", TypeError),
        ("intermediate_size", "local_gate_weights", ValueError),
    ):
        by_rank = [entry[field_name] for entry in table]
        if len(set(by_rank)) > 1:
            if "dtype" in field_name:
                by_rank = [str(EXCHANGED_DTYPES[c]) if c >= 0 else "another dtype" for c in by_rank]
            what = field_name.removeprefix("topk_weights_")
            raise error(f"{argument}: the ranks disagree on its {what} (by rank: {dict(enumerate(by_rank))})")
    by_rank = {r: entry["chunks"] or None for r, entry in enumerate(table)}
    if len(set(by_rank.values())) > 1:  # each rank would run a different number of exchanges
        raise ValueError(f"chunks: the ranks disagree (by rank: {by_rank})")
    mean_rows = sum(entry["rows"] for entry in table) / len(table)
    chunks = by_rank[0] or (2 if mean_rows >= AUTO_CHUNKS_MIN_ROWS else 1)
    given = {r: entry["num_experts"] for r, entry in enumerate(table) if entry["num_experts"] != -1}
    if len(set(given.values())) > 1:
        raise ValueError(f"num_experts: the ranks disagree (by rank: {given})")
    total = next(iter(given.values())) if given else sum(entry["local_experts"] for entry in table)
    too_many = [r for r, entry in enumerate(table) if entry["top_k"] > total]
    if too_many:
        raise ValueError(f"topk_indices: top_k exceeds num_experts={total} on rank(s) {too_many}")
    return total, chunks


@functools.lru_cache(maxsize=64)
def _message_columns(num_experts: int, world_size: int, device: torch.device) -> torch.Tensor:
    """[E] int64: for global expert e on rank d as its local expert j, the position d·L_max + j in
    the [W, L_max] table of per-expert row counts (built once per (E, W, device))."""
    partition = expert_partition(num_experts, world_size)
    max_local = max(len(block) for block in partition)
    columns = [rank * max_local + j for rank, block in enumerate(partition) for j in range(len(block))]
    return torch.tensor(columns, dtype=torch.int64, device=device)


def _plan_dispatch(topk_indices, num_experts, local_experts, chunks, group, stats) -> _DispatchPlan:
    """Orders this rank's rows by global expert, exchanges the per-expert counts with every rank (one host
    sync), checks every rank's status and works out both sides of each chunk's exchange."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    partition = expert_partition(num_experts, world_size)
    max_local = max(len(block) for block in partition)
    device = topk_indices.device
    num_tokens, top_k = topk_indices.shape

    expert = topk_indices.reshape(-1).long()
    out_of_range = ((expert < 0) | (expert >= num_experts)).any()
    ordered = topk_indices.sort(dim=1).values
    duplicate = (ordered[:, 1:] == ordered[:, :-1]).any()
    position = _message_columns(num_experts, world_size, device)[expert.clamp(0, num_experts - 1)]
    send_slot = torch.argsort(position, stable=True)
    # scatter_add_ rather than bincount: bincount on CUDA reads the largest id back to the host
    counts = torch.zeros(world_size * max_local, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, position, torch.ones_like(position)).view(world_size, max_local)

    status = torch.stack(
        [torch.full((), local_experts, dtype=torch.int64, device=device), out_of_range.long(), duplicate.long()]
    )
    message = torch.cat([status.expand(world_size, len(STATUS_COLUMNS)), counts], dim=1)
    received = torch.empty_like(message)
    with stats.phase("counts_exchange"):
        dist.all_to_all_single(received, message, group=group)
    sent_table, received_table = torch.stack([message, received]).tolist()  # the one host sync
    _raise_for_status([row[: len(STATUS_COLUMNS)] for row in received_table], partition, topk_indices.dtype)

    ranges = _chunk_ranges(sent_table, partition, chunks)
    sent_slots = (
        send_slot
        if chunks == 1
        else send_slot[torch.cat([torch.arange(a, b, device=device) for chunk in ranges for a, b in chunk])]
    )
    local_expert = []  # received row j's local expert, chunk by chunk: from each source rank, by expert
    for groups in zip(*(expert_chunks(len(block), chunks) for block in partition), strict=True):
        mine = groups[rank]
        counts_by_source = received[:, len(STATUS_COLUMNS) + mine.start : len(STATUS_COLUMNS) + mine.stop]
        local_expert.append(
            torch.repeat_interleave(
                torch.arange(len(mine), device=device).repeat(world_size),
                counts_by_source.reshape(-1),
                output_size=sum(row[len(STATUS_COLUMNS) + j] for row in received_table for j in mine),
            )
        )
    return _build_plan(
        group, num_experts, chunks, num_tokens, top_k, (sent_table, received_table), sent_slots, torch.cat(local_expert)
    )


def _chunk_ranges(sent_table: list[list[int]], partition: list[range], chunks: int) -> list[list[tuple[int, int]]]:
    """[c][s]: chunk c's rows to rank s, a range of this rank's rows ordered by (destination rank, its local
    expert)."""
    sent_counts = [row[len(STATUS_COLUMNS) :] for row in sent_table]  # [s][j]: rows to rank s's local expert j
    rank_start = [sum(map(sum, sent_counts[:s])) for s in range(len(partition))]
    groups_by_rank = [expert_chunks(len(block), chunks) for block in partition]
    return [
        [
            (
                rank_start[s] + sum(sent_counts[s][: groups_by_rank[s][c].start]),
                rank_start[s] + sum(sent_counts[s][: groups_by_rank[s][c].stop]),
            )
            for s in range(len(partition))
        ]
        for c in range(chunks)
    ]


def _build_plan(
    group,
    num_experts: int,
    chunks: int,
    num_tokens: int,
    top_k: int,
    tables: tuple,
    sent_slots: torch.Tensor,
    received_local_expert: torch.Tensor,
) -> _DispatchPlan:
    """Both sides of each chunk's exchange from the counts exchange's ``tables`` (as sent, as received) and the
    device-side orders: ``sent_slots`` (every chunk's send rows) and ``received_local_expert`` (every chunk's
    received rows' expert)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    partition = expert_partition(num_experts, world_size)
    sent_table, received_table = tables
    received_counts = [row[len(STATUS_COLUMNS) :] for row in received_table]  # [s][j]: rows from rank s
    plans, sent_start, received_start = [], 0, 0
    for c, ranges in enumerate(_chunk_ranges(sent_table, partition, chunks)):
        mine = expert_chunks(len(partition[rank]), chunks)[c]
        rows_by_source = [received_counts[s][mine.start : mine.stop] for s in range(world_size)]
        send_splits, receive_splits = [b - a for a, b in ranges], [sum(row) for row in rows_by_source]
        local_expert = received_local_expert[received_start : received_start + sum(receive_splits)]
        plans.append(
            _ChunkPlan(
                send_slot=sent_slots[sent_start : sent_start + sum(send_splits)],
                send_splits=send_splits,
                experts=mine,
                receive_splits=receive_splits,
                received_local_expert=local_expert,
                expert_order=torch.argsort(local_expert, stable=True),
                expert_row_counts=[sum(column) for column in zip(*rows_by_source, strict=True)] if len(mine) else [],
            )
        )
        sent_start, received_start = sent_start + sum(send_splits), received_start + sum(receive_splits)
    row_of_slot = torch.empty_like(sent_slots)
    row_of_slot[sent_slots] = torch.arange(len(sent_slots), device=sent_slots.device)
    return _DispatchPlan(
        group=group,
        num_tokens=num_tokens,
        top_k=top_k,
        chunks=plans,
        row_of_slot=row_of_slot,
        num_experts=num_experts,
        tables=tables,
        sent_slots=sent_slots,
        received_local_expert=received_local_expert,
    )


def _plan_from_layout(
    layout: torch.Tensor,
    sent_slots: torch.Tensor,
    received_local_expert: torch.Tensor,
    num_tokens: int,
    top_k: int,
    group,
) -> _DispatchPlan:
    """The forward's plan again, from its :meth:`_DispatchPlan.layout` and device-side orders."""
    num_experts, chunks, world_size, width, *flat = layout.tolist()
    rows = [flat[i * width : (i + 1) * width] for i in range(2 * world_size)]
    return _build_plan(
        group,
        num_experts,
        chunks,
        num_tokens,
        top_k,
        (rows[:world_size], rows[world_size:]),
        sent_slots,
        received_local_expert,
    )


def _raise_for_status(status_by_rank: list[list[int]], partition: list[range], index_dtype) -> None:
    """The same ValueError on every rank when any rank's status reports a problem."""
    num_experts = partition[-1].stop
    wrong_count = [r for r, status in enumerate(status_by_rank) if status[0] != len(partition[r])]
    if wrong_count:
        held = {r: status_by_rank[r][0] for r in wrong_count}
        expected = {r: len(partition[r]) for r in wrong_count}
        raise ValueError(
            f"local_gate_weights: rank(s) {wrong_count} hold {held} experts, but expert_partition("
            f"{num_experts}, {len(partition)}) gives them {expected}"
        )
    bad_index = [r for r, status in enumerate(status_by_rank) if status[1]]
    if bad_index:
        raise ValueError(f"topk_indices: an expert index out of range [0, {num_experts}) on rank(s) {bad_index}")
    repeated = [r for r, status in enumerate(status_by_rank) if status[2]]
    if repeated:
        raise ValueError(
            f"topk_indices: a token lists the same expert twice on rank(s) {repeated}; "
            "each token's top_k experts must be distinct"
        )


def _start_all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group, out=None):
    """Starts scattering ``rows`` [sum(input_splits), ...] to the ranks (input_splits[s] rows to rank s);
    returns (the buffer that receives [sum(output_splits), ...], output_splits[s] rows from rank s: ``out``
    where given, a contiguous tensor of that shape; and the collective's work: ``.wait()`` before reading the
    buffer)."""
    received = rows.new_empty((sum(output_splits), *rows.shape[1:])) if out is None else out
    work = dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group, async_op=True)
    return received, work


def _finish(started: list) -> list[torch.Tensor]:
    """Waits for every (buffer, work) of ``started``; returns the buffers."""
    for _, work in started:
        work.wait()
    return [buffer for buffer, _ in started]


def _combined_rows(like: torch.Tensor, plan: _DispatchPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The buffer [S, ...] that receives every chunk's combine (S = the rows this rank sent), and its slice for
    each chunk."""
    sizes = [sum(chunk.send_splits) for chunk in plan.chunks]
    rows = like.new_empty((sum(sizes), *like.shape[1:]))
    return rows, list(rows.split(sizes))


def _rows_by_slot(rows: torch.Tensor, plan: _DispatchPlan) -> torch.Tensor:
    """The combined rows [S, ...] in slot order, viewed as [T, K, ...]."""
    return rows[plan.row_of_slot].view(plan.num_tokens, plan.top_k, *rows.shape[1:])


def _sum_over_slots(rows: torch.Tensor, plan: _DispatchPlan) -> torch.Tensor:
    """[T, H]: each token's K combined rows summed in slot order (:mod:`.slot_sum`)."""
    from .slot_sum import sum_slot_rows  # imports triton: not before the layer runs

    return sum_slot_rows(rows, plan.row_of_slot, plan.num_tokens, plan.top_k)


def _local_experts_forward(rows, row_weights, chunk: _ChunkPlan, gate, up, down) -> torch.Tensor:
    """On the expert's rank: w · Wd_e(silu(Wg_e x) ⊙ Wu_e x) for each received row x with routing
    weight w and expert e (of the chunk's ``gate``, ``up``, ``down``); [R, H] in the rows' dtype and order.
    Products in the input dtype (fp32 with TF32 off), one expert at a time over its rows."""
    by_expert = rows[chunk.expert_order]
    weights_by_expert = row_weights[chunk.expert_order]
    outputs = torch.empty_like(by_expert)
    start = 0
    with tf32_disabled():
        for e, count in enumerate(chunk.expert_row_counts):
            if count == 0:
                continue
            x = by_expert[start : start + count]
            activation = F.silu(x @ gate[e].T) * (x @ up[e].T)
            weight = weights_by_expert[start : start + count, None]
            outputs[start : start + count] = weight * (activation @ down[e].T)
            start += count
    unsorted = torch.empty_like(outputs)
    unsorted[chunk.expert_order] = outputs
    return unsorted


def _expert_forward(received_x, received_w, chunk: _ChunkPlan, gate, up, down, impl) -> torch.Tensor:
    """The weighted outputs of the chunk's experts (``gate``, ``up``, ``down``: their weights) for the rows
    this rank received (one slot per row)."""
    use_triton = resolve_impl(impl, received_x.device, received_x.dtype) == "triton"
    if received_x.shape[0] > 0 and use_triton:  # the single-device layer's kernels
        return moe_experts_forward(
            received_x, chunk.received_local_expert[:, None], received_w[:, None], gate, up, down, impl=impl
        )
    return _local_experts_forward(received_x, received_w, chunk, gate, up, down)


def _expert_backward(
    received_dy, received_x, received_w, chunk: _ChunkPlan, gate, up, down, impl, weight_grads_out=None
) -> tuple:
    """(dx rows, routing-weight gradient rows, dWg, dWu, dWd) of the chunk's experts (``gate``, ``up``, ``down``:
    their weights) for the rows this rank received; the weight gradients written into ``weight_grads_out``
    (views of every local expert's gradients) when given."""
    if received_x.shape[0] == 0:  # no rows for these experts: their gradients are zero
        grads = weight_grads_out or tuple(torch.empty_like(w) for w in (gate, up, down))
        return torch.zeros_like(received_x), torch.zeros_like(received_w), *(g.zero_() for g in grads)
    arguments = (received_dy, received_x, chunk.received_local_expert[:, None], received_w[:, None], gate, up, down)
    if resolve_impl(impl, received_x.device, received_x.dtype) == "triton":
        from .launch import moe_experts_backward_triton  # imports triton: only on this path

        grad_x_rows, grad_w_rows, *weight_grads = moe_experts_backward_triton(
            *arguments, weight_grads_out=weight_grads_out
        )
    else:
        grad_x_rows, grad_w_rows, *weight_grads = moe_experts_backward(*arguments, impl=impl, validate=False)
        if weight_grads_out is not None:
            weight_grads = [out.copy_(g) for out, g in zip(weight_grads_out, weight_grads, strict=True)]
    return grad_x_rows, grad_w_rows.reshape(-1), *weight_grads


def _chunk_weights(chunk: _ChunkPlan, *weights: torch.Tensor) -> list[torch.Tensor]:
    """The chunk's experts' blocks of each local weight tensor (views)."""
    return [w[chunk.experts.start : chunk.experts.stop] for w in weights]


def _parallel_forward(hidden_states, topk_weights, gate, up, down, plan: _DispatchPlan, impl, stats) -> tuple:
    """Dispatch, local experts, combine, chunk by chunk with each chunk's exchanges overlapping its neighbours' expert
    compute. Returns (y [T, H], the rows this rank received [R, H] and their routing weights [R], every chunk's one
    after the other): the backward runs the experts' backward on them. Every rank runs the same collectives in the
    same order."""
    group = plan.group
    sizes = [sum(chunk.receive_splits) for chunk in plan.chunks]
    received_x = hidden_states.new_empty((sum(sizes), hidden_states.shape[1]))
    received_w = topk_weights.new_empty((sum(sizes),))
    x_by_chunk, w_by_chunk = received_x.split(sizes), received_w.split(sizes)

    def start_dispatch(i):
        chunk = plan.chunks[i]
        stats.mark("dispatch issued")
        send_x = hidden_states[chunk.send_slot // plan.top_k]
        send_w = topk_weights.reshape(-1)[chunk.send_slot]
        return [
            _start_all_to_all(rows, chunk.receive_splits, chunk.send_splits, group, out=out)
            for rows, out in ((send_x, x_by_chunk[i]), (send_w, w_by_chunk[i]))
        ]

    combines, returned, returned_by_chunk = [], None, None
    in_flight = start_dispatch(0)
    for i, chunk in enumerate(plan.chunks):
        following = start_dispatch(i + 1) if i + 1 < len(plan.chunks) else None
        with stats.phase("dispatch"):  # the compute stream's wait for this chunk's rows
            chunk_x, chunk_w = _finish(in_flight)
        with stats.phase("expert_forward"):
            expert_rows = _expert_forward(chunk_x, chunk_w, chunk, *_chunk_weights(chunk, gate, up, down), impl)
        if returned is None:
            returned, returned_by_chunk = _combined_rows(expert_rows, plan)
        stats.mark("combine issued")
        combines.append(
            _start_all_to_all(expert_rows, chunk.send_splits, chunk.receive_splits, group, out=returned_by_chunk[i])
        )
        in_flight = following
    with stats.phase("combine"):
        _finish(combines)
    return _sum_over_slots(returned, plan), received_x, received_w


def _parallel_backward(grad_output, received_x, received_w, gate, up, down, plan: _DispatchPlan, impl, stats) -> tuple:
    """The adjoint exchanges around the local expert backward, on the forward's schedule: (grad_hidden_states,
    grad_topk_weights, grad of each local weight tensor)."""
    group = plan.group
    sizes = [sum(chunk.receive_splits) for chunk in plan.chunks]
    x_by_chunk, w_by_chunk = received_x.split(sizes), received_w.split(sizes)

    def start_dispatch(chunk):
        stats.mark("backward_dispatch issued")
        send_dy = grad_output[chunk.send_slot // plan.top_k]
        return [_start_all_to_all(send_dy, chunk.receive_splits, chunk.send_splits, group)]

    # one chunk: the backward's own weight gradients; several: each chunk's experts' block of these
    weight_grads = None if len(plan.chunks) == 1 else [torch.empty_like(w) for w in (gate, up, down)]
    combines, returned = [], None
    in_flight = start_dispatch(plan.chunks[0])
    for i, chunk in enumerate(plan.chunks):
        following = start_dispatch(plan.chunks[i + 1]) if i + 1 < len(plan.chunks) else None
        with stats.phase("backward_dispatch"):
            [received_dy] = _finish(in_flight)
        with stats.phase("expert_backward"):
            out = None if weight_grads is None else _chunk_weights(chunk, *weight_grads)
            grad_x_rows, grad_w_rows, *chunk_grads = _expert_backward(
                received_dy,
                x_by_chunk[i],
                w_by_chunk[i],
                chunk,
                *_chunk_weights(chunk, gate, up, down),
                impl,
                out,
            )
            if weight_grads is None:
                weight_grads = chunk_grads
        if returned is None:
            returned = [_combined_rows(rows, plan) for rows in (grad_x_rows, grad_w_rows)]
        stats.mark("backward_combine issued")
        combines += [
            _start_all_to_all(rows, chunk.send_splits, chunk.receive_splits, group, out=by_chunk[i])
            for rows, (_, by_chunk) in zip((grad_x_rows, grad_w_rows), returned, strict=True)
        ]
        in_flight = following
    with stats.phase("backward_combine"):
        _finish(combines)
    (grad_x_all, _), (grad_w_all, _) = returned
    return _sum_over_slots(grad_x_all, plan), _rows_by_slot(grad_w_all, plan), *weight_grads
