"""NVIDIA SOL-ExecBench's timing method inside our harness (``timing="official"``).

The leaderboard times a call the way a user's eager code runs it, not as a replayed CUDA graph:

- every timed call gets its inputs at fresh addresses (:class:`FreshInputs`: one pool per input,
  the data copied to an offset 256 bytes further on each call, outside the timed window), so no call
  finds its operands where the previous one left them;
- before each call the L2 is cleared by zeroing a buffer twice its size, and nothing waits for that
  to finish (the call is enqueued behind it, as the harness does);
- each call is one eager Python call; CUPTI records every CUDA API call (runtime and driver) and every
  kernel, copy and memset the GPU ran, and the call's time is its **span**: from the start of the
  first GPU activity it launched to the end of the last (:func:`call_spans`). Host time between two
  launches therefore counts whenever the GPU runs out of queued work.

Graph replay (``timing="graph"``, :mod:`.timing`) measures GPU time alone; the difference between the
two is the host's share of a call (``docs/methodology.md``). CUPTI comes from the ``cupti-python``
package (CUDA 13 and later); without it :func:`unavailable` says so and nothing is timed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

POOL_SHIFT_BYTES = 256  # how far each call's copy of an input moves (keeps 256-byte alignment)


def unavailable(device: torch.device) -> str | None:
    """Why official timing cannot run on ``device`` (None when it can)."""
    if torch.device(device).type != "cuda":
        return "needs a CUDA device"
    try:
        from cupti import cupti  # noqa: F401
    except ImportError:
        return "cupti-python is not installed (pip install cupti-python; CUDA 13 or later)"
    return None


class FreshInputs:
    """Hands out the inputs at a new address on every call of :meth:`next`.

    Each tensor input gets one pool of its bytes plus ``calls`` × 256 bytes; call i copies the data
    to offset i × 256 (enqueued on the current stream, no synchronisation). Non-tensor values pass
    through unchanged. After ``calls`` calls the offsets start again from zero.
    """

    def __init__(self, inputs: dict, calls: int):
        if calls < 1:
            raise ValueError(f"calls: expected at least 1, got {calls}")
        self.inputs, self.calls, self.index = inputs, calls, 0
        self.pools = {}
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                if not value.is_contiguous():
                    raise ValueError(f"inputs[{name!r}]: FreshInputs copies contiguous tensors only")
                nbytes = value.numel() * value.element_size() + calls * POOL_SHIFT_BYTES
                self.pools[name] = torch.empty(nbytes, dtype=torch.uint8, device=value.device)

    def next(self) -> dict:
        offset = (self.index % self.calls) * POOL_SHIFT_BYTES
        self.index += 1
        fresh = {}
        for name, value in self.inputs.items():
            if name not in self.pools:
                fresh[name] = value
                continue
            nbytes = value.numel() * value.element_size()
            view = self.pools[name][offset : offset + nbytes].view(value.dtype).view(value.shape)
            view.copy_(value)
            fresh[name] = view
        return fresh


@dataclass(frozen=True)
class GpuActivity:
    """A kernel, copy or memset the GPU ran (ns timestamps) and the API call that launched it."""

    start: int
    end: int
    correlation_id: int
    name: str = ""


def call_spans(
    calls: list[tuple[int, int]], launches: list[tuple[int, int]], activities: list[GpuActivity]
) -> list[dict]:
    """Each call's span on the GPU: from its first activity's start to its last activity's end.

    ``calls``: (host start, host end) of each timed call, CUPTI timestamps in ns; ``launches``: (host
    start, correlation id) of every recorded API call; ``activities``: what the GPU ran. An activity
    belongs to the call during which the API call that launched it started. Returns per call
    dict(span_ms, activities, names) (names sorted); raises ``ValueError`` for a call that launched
    nothing (it could not have been timed).
    """
    launches = sorted(launches)
    starts = [start for start, _ in launches]
    by_correlation: dict[int, list[GpuActivity]] = {}
    for activity in activities:
        by_correlation.setdefault(activity.correlation_id, []).append(activity)
    spans = []
    for index, (begin, end) in enumerate(calls):
        first, last = bisect.bisect_left(starts, begin), bisect.bisect_right(starts, end)
        mine = [a for _, cid in launches[first:last] for a in by_correlation.get(cid, ())]
        if not mine:
            raise ValueError(f"call {index}: no GPU activity was recorded for it")
        span_ns = max(a.end for a in mine) - min(a.start for a in mine)
        spans.append(dict(span_ms=span_ns / 1e6, activities=len(mine), names=sorted(a.name for a in mine)))
    return spans


def time_official(make_call, inputs: dict, device, *, warmup: int, reps: int) -> dict:
    """Times ``reps`` eager calls the harness's way; ``make_call(inputs)`` returns the call for one set of
    inputs (it runs outside the timed window, after the fresh copies are enqueued).

    Returns dict(samples_ms, activities per call, names of the GPU activities of one call).
    """
    from cupti import cupti

    device = torch.device(device)
    clear = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8, device=device)
    fresh = FreshInputs(inputs, warmup + reps)
    torch.cuda.synchronize(device)
    for _ in range(warmup):
        call = make_call(fresh.next())
        clear.zero_()
        out = call()
        del out
    torch.cuda.synchronize(device)

    launches, activities = [], []
    kinds = (
        cupti.ActivityKind.RUNTIME,
        cupti.ActivityKind.DRIVER,
        cupti.ActivityKind.CONCURRENT_KERNEL,
        cupti.ActivityKind.MEMCPY,
        cupti.ActivityKind.MEMSET,
    )
    gpu_kinds = kinds[2:]

    def buffer_requested():
        return 8 * 2**20, 0

    callback_errors = []

    def buffer_completed(records):
        try:
            for record in records:
                if record.kind == cupti.ActivityKind.CONCURRENT_KERNEL:
                    activities.append(GpuActivity(record.start, record.end, record.correlation_id, str(record.name)))
                elif record.kind in gpu_kinds:  # copies and memsets carry no name
                    activities.append(GpuActivity(record.start, record.end, record.correlation_id, str(record.kind)))
                elif record.kind in kinds[:2]:
                    launches.append((record.start, record.correlation_id))
        except Exception as exc:  # raised again below: an exception here would only be printed by CUPTI
            callback_errors.append(exc)

    calls = []
    for kind in kinds:
        cupti.activity_enable(kind)
    cupti.activity_register_callbacks(buffer_requested, buffer_completed)
    try:
        for _ in range(reps):
            call = make_call(fresh.next())
            clear.zero_()
            begin = cupti.get_timestamp()
            out = call()
            end = cupti.get_timestamp()
            torch.cuda.synchronize(device)
            calls.append((begin, end))
            del out
        cupti.activity_flush_all(1)  # forced: the last, incomplete buffer too
    finally:
        for kind in kinds:
            cupti.activity_disable(kind)
        cupti.finalize()
    if callback_errors:
        raise RuntimeError(f"reading CUPTI's records failed: {callback_errors[0]!r}") from callback_errors[0]
    if not activities or not launches:
        raise RuntimeError(
            f"CUPTI recorded {len(launches)} API calls and {len(activities)} GPU activities over {reps} calls"
        )
    spans = call_spans(calls, launches, activities)
    return dict(samples_ms=[s["span_ms"] for s in spans], activities=spans[0]["activities"], names=spans[0]["names"])
