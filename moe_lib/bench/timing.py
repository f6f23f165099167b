"""Timing and memory-poisoning helpers of the benchmark harness and the scripts.

Three timers share one procedure (:func:`measure`: warm-up, an estimate, then timed repetitions):

- ``"graph"``: the callable captured once in a CUDA graph; each replay timed with CUDA events, so
  host launch overhead stays out. GPU time only.
- ``"events"``: for callables that cannot be captured (a host sync inside): CUDA events around each
  call, after a synchronize, so the time includes whatever the GPU waits on the host.
- ``"cpu"``: wall clock (``time.perf_counter``) around each call, for machines without CUDA.

Before every timed run a 512 MiB buffer is overwritten (outside the timed window) so that each run
starts with a cold L2. Samples are summarised by their median and 20th/80th percentiles.
:func:`time_graph` (and its shorthand :func:`graph_median_ms`) captures a callable and times its
replays in one call, for the harness and the tuning scripts alike. :func:`cprofile_table` tells where a call's host
time goes, for the host-time scripts.
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time

import numpy as np
import torch

L2_FLUSH_BYTES = 512 * 2**20
LONG_CASE_MS = 10.0  # cases slower than this get fewer repetitions ...
LONG_CASE_BUDGET_MS = 2000.0  # ... about this much time in all, but never fewer than
MIN_LONG_CASE_REPS = 5


class CaptureError(RuntimeError):
    """The callable could not be captured in a CUDA graph."""


def summarize(samples_ms) -> dict:
    """Median and 20th/80th percentiles of the samples (ms), and their count."""
    samples = np.asarray(samples_ms, dtype=np.float64)
    return dict(
        median_ms=float(np.median(samples)),
        p20_ms=float(np.percentile(samples, 20)),
        p80_ms=float(np.percentile(samples, 80)),
        reps=int(samples.size),
    )


def repetitions(estimate_ms: float, reps: int) -> int:
    """How many timed runs: ``reps``, or for cases over 10 ms as many as fit in about 2 s, at least 5."""
    if estimate_ms <= LONG_CASE_MS:
        return reps
    fitting = math.ceil(LONG_CASE_BUDGET_MS / estimate_ms)
    return min(reps, max(MIN_LONG_CASE_REPS, fitting))


class L2Flusher:
    """Overwrites a buffer larger than the L2 (on CUDA); does nothing on CPU."""

    def __init__(self, device, nbytes: int = L2_FLUSH_BYTES):
        self.device = torch.device(device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if self.is_cuda else None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1)


def poison_allocator(device, nbytes: int) -> None:
    """Fills the memory the caching allocator will hand out next with NaN, so that outputs an
    implementation allocates but never writes read as NaN.

    Claims every free block the allocator already caches for the current stream (where stale
    results of earlier runs may lie), then fresh memory: one large block (``nbytes``, at most half
    the free memory) and 64 blocks of 1 MiB (the pool for small tensors); fills all of it with 0xFF
    bytes, a NaN in every float dtype, and frees it, so the allocator keeps it cached and hands it
    out to the next allocations. Best effort: a no-op on CPU.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    held = []
    try:
        cached = _free_cached_blocks(device)
        for size in sorted((size for size, small in cached if not small), reverse=True):
            held.append(_poisoned(size, device))
        for size in sorted((size for size, small in cached if small), reverse=True):
            while size > 0:  # requests above 1 MiB go to the large pool: claim small blocks in pieces
                piece = min(size, SMALL_POOL_LIMIT)
                held.append(_poisoned(piece, device))
                size -= piece
        free, _ = torch.cuda.mem_get_info(device)
        large = int(min(nbytes, free // 2))
        while large >= 2 * SMALL_POOL_LIMIT:  # halve the block until the allocator finds room for it
            try:
                held.append(_poisoned(large, device))
                break
            except torch.cuda.OutOfMemoryError:
                large //= 2
        held += [_poisoned(SMALL_POOL_LIMIT, device) for _ in range(64)]
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.synchronize(device)
    del held


SMALL_POOL_LIMIT = 2**20  # the caching allocator serves requests up to 1 MiB from its small pool


def _poisoned(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(255)


def _free_cached_blocks(device: torch.device) -> list[tuple[int, bool]]:
    """(bytes, in the small pool) of each free block the caching allocator caches for the current
    stream of ``device`` (CUDA graphs' private pools left out)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    found = []
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", device.index) != device.index or segment.get("stream", stream) != stream:
            continue
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        small = segment.get("segment_type") == "small"
        found += [(block["size"], small) for block in segment["blocks"] if block["state"] == "inactive"]
    return found


def _time_cuda_runs(fn, flush: L2Flusher, count: int, sync_each: bool) -> list[float]:
    """CUDA-event times (ms) of ``count`` calls of ``fn``, each after an L2 flush outside the window."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in pairs:
        flush()
        if sync_each:
            torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        del out
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def _time_cpu_runs(fn, flush: L2Flusher, count: int) -> list[float]:
    """Wall-clock times (ms) of ``count`` calls of ``fn``."""
    times = []
    for _ in range(count):
        flush()
        start = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - start) * 1e3)
        del out
    return times


def run_and_time(fn, mode: str, flush: L2Flusher, count: int) -> list[float]:
    """Times ``count`` runs of ``fn`` with the timer ``mode`` ("graph" replays, "events" or "cpu")."""
    if mode == "cpu":
        return _time_cpu_runs(fn, flush, count)
    if mode == "graph":
        return _time_cuda_runs(fn, flush, count, sync_each=False)
    if mode == "events":
        return _time_cuda_runs(fn, flush, count, sync_each=True)
    raise ValueError(f"mode: expected 'graph', 'events' or 'cpu', got {mode!r}")


def capture(fn, warmup: int = 2):
    """Captures ``fn`` in a CUDA graph after ``warmup`` calls on a side stream.

    Returns (graph, outputs of the captured call); replaying the graph rewrites those outputs.
    Raises :class:`CaptureError` if the capture fails (e.g. a host sync inside ``fn``).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            out = fn()
            del out
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    previous_stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            outputs = fn()
        torch.cuda.synchronize()
    except Exception as exc:
        del graph
        # a failed capture_end skips the graph context's own stream restore: restore it here, and let
        # one small operation pick up any error the failed capture left behind
        torch.cuda.set_stream(previous_stream)
        try:
            torch.ones(1, device=previous_stream.device).add_(1)
            torch.cuda.synchronize()
        except Exception:
            pass
        raise CaptureError(f"CUDA graph capture failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    return graph, outputs


def measure(fn, mode: str, flush: L2Flusher, *, warmup: int, reps: int) -> dict:
    """Warm-up, one estimate run, then the timed runs; returns :func:`summarize` of the timed runs.

    ``fn`` is what one timed run calls (for "graph", the graph's ``replay``).
    """
    if warmup > 0:
        run_and_time(fn, mode, flush, 1)  # the first call may be far slower than the rest
    estimate = run_and_time(fn, mode, flush, 1)[0]
    if estimate <= LONG_CASE_MS and warmup > 2:
        run_and_time(fn, mode, flush, warmup - 2)
    samples = run_and_time(fn, mode, flush, repetitions(estimate, reps))
    return summarize(samples)


def time_graph(fn, flush=None, *, warmup: int = 5, reps: int = 30, check_replay=None) -> dict:
    """Captures ``fn`` in a CUDA graph (:func:`capture`) and times its replays with :func:`measure`.

    ``flush`` runs before every replay, outside the timed window (an :class:`L2Flusher`, any callable,
    or None for a warm L2). ``check_replay(outputs)``, when given, is called with the outputs the last
    replay rewrote and returns a reason (str) when they are wrong. Returns :func:`summarize`'s dict
    plus ``replay_wrong`` (that reason, or None).
    """
    flush = flush if flush is not None else (lambda: None)
    graph, outputs = capture(fn)
    try:
        stats = measure(graph.replay, "graph", flush, warmup=warmup, reps=reps)
        torch.cuda.synchronize()
        replay_wrong = check_replay(outputs) if check_replay is not None else None
    finally:
        del graph, outputs
    return dict(stats, replay_wrong=replay_wrong)


def graph_median_ms(fn, flush=None, reps: int = 30) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (:func:`time_graph`, ``flush`` before each)."""
    return time_graph(fn, flush, reps=reps)["median_ms"]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def cprofile_table(call, calls: int, top: int = 25) -> str:
    """cProfile's table of ``calls`` calls of ``call`` (a CUDA synchronize after them), the ``top`` costliest
    functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
