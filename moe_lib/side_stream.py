"""A second CUDA stream per device beside the caller's: work forked onto it after what the caller's stream has
queued, joined back before the caller's stream goes on. Captured into a CUDA graph as two branches (the fork and the
join are event waits), so two launches on the two streams may run at once, each on the SMs the other leaves."""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """A second CUDA stream per device that forks from the caller's stream and joins it again."""

    _streams: dict = {}

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        key = str(device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        self.stream = self._streams[key]
        self.forked = False

    def mark(self) -> torch.cuda.Event:
        """An event recorded on the side stream now: the caller's stream can wait for what is queued there so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self):
        if self.forked:
            self.main.wait_stream(self.stream)


@contextlib.contextmanager
def branch(side: SideStream | None):
    """``with branch(side):`` runs its body on the side stream after everything queued so far on the
    caller's stream (``side`` None: on the caller's stream)."""
    if side is None:
        yield
        return
    side.stream.wait_stream(side.main)
    side.forked = True
    with torch.cuda.stream(side.stream):
        yield
