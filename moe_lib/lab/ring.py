"""Notebook 04, the Hopper rung: the producer/consumer ring of a warp-specialised Gluon kernel, simulated on the CPU.

A Gluon kernel such as ``moe_lib/swiglu_down/gluon_launch2.py`` runs two roles at once: a loading warp issues TMA
copies of each K step's operand tiles into the next buffer of a ring in shared memory (``load_steps``), and the
multiplying warpgroups issue wgmma on each buffer once its bytes have landed (``mma_steps``). Two mbarriers per
buffer carry the hand-offs: *ready* (the copy engine completes it when the bytes have arrived) and *empty* (the
multipliers complete it when their products on the buffer are done). An mbarrier counts completed *phases*; a
wait names the parity of the phase it waits for and returns once the barrier has moved past a phase of that
parity. So ring step i uses buffer i mod BUFFERS, the consumer waits on ready with parity (i // BUFFERS) & 1, and the
producer waits on empty with the opposite parity (a fresh barrier, in phase 0, lets a wait on parity 1 through:
every buffer starts free).

:class:`MBarrier` models that wait; :func:`simulate` runs a producer and a consumer over a ring, in an order chosen
at random at every step, with a schedule function ``step -> (slot, ready parity, empty parity)`` (the kernel's is
:func:`kernel_schedule`), and reports a deadlock or a buffer read before it was written or overwritten before it was
read. Notebook 04 draws one run (:func:`ring_figure`); ``moe_lib.lab.exercises.check_ring_schedule`` runs many.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def kernel_schedule(step: int, buffers: int) -> tuple[int, int, int]:
    """(buffer, parity the consumer waits for on ready, parity the producer waits for on empty) of ring step ``step``,
    as ``load_steps`` and ``mma_steps`` compute them (with no rotation)."""
    phase = (step // buffers) & 1
    return step % buffers, phase, phase ^ 1


@dataclass
class MBarrier:
    """An mbarrier of arrival count 1: ``completed`` phases so far; a wait on parity p passes once the barrier's
    current phase has a parity other than p, i.e. the phase of parity p that it waits for has completed."""

    completed: int = 0

    def can_pass(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def arrive(self) -> None:
        self.completed += 1


@dataclass
class RingRun:
    """What :func:`simulate` saw: ``events`` (time, role, step, buffer, what), and ``error`` (None when every step's
    data reached the consumer in order)."""

    events: list = field(default_factory=list)
    error: str | None = None


def simulate(schedule, buffers: int, steps: int, seed: int = 0) -> RingRun:
    """Run a producer (wait empty, copy step i into its buffer, arrive on ready) and a consumer (wait ready, read the
    buffer, arrive on empty) over ``steps`` ring steps of ``buffers`` buffers, picking which role moves next at
    random (``seed``). ``schedule(step, buffers)`` gives each step's (buffer, ready parity, empty parity)."""
    for name, value, least in (("buffers", buffers, 1), ("steps", steps, 0)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an integer ≥ {least}, got {value!r}")
    ready = [MBarrier() for _ in range(buffers)]
    empty = [MBarrier() for _ in range(buffers)]
    contents: list[int | None] = [None] * buffers  # the step whose data the buffer holds
    read: list[bool] = [True] * buffers  # whether the consumer has read what it holds
    produced = consumed = clock = 0
    run = RingRun()
    rng = random.Random(seed)
    while consumed < steps:
        movable = []
        if produced < steps:
            slot, _, empty_parity = schedule(produced, buffers)
            if empty[slot].can_pass(empty_parity):
                movable.append("producer")
        slot, ready_parity, _ = schedule(consumed, buffers)
        if ready[slot].can_pass(ready_parity):
            movable.append("consumer")
        if not movable:
            run.error = f"deadlock: the producer at step {produced}, the consumer at step {consumed}, neither can pass"
            return run
        clock += 1
        if rng.choice(movable) == "producer":
            slot = schedule(produced, buffers)[0]
            if not read[slot]:
                run.error = f"step {produced} overwrote buffer {slot} before step {contents[slot]} was read"
                return run
            contents[slot], read[slot] = produced, False
            ready[slot].arrive()
            run.events.append((clock, "producer", produced, slot, "copy lands, ready completes"))
            produced += 1
        else:
            slot = schedule(consumed, buffers)[0]
            if contents[slot] != consumed:
                run.error = f"step {consumed} read buffer {slot} holding step {contents[slot]}"
                return run
            read[slot] = True
            empty[slot].arrive()
            run.events.append((clock, "consumer", consumed, slot, "products done, empty completes"))
            consumed += 1
    return run


def ring_figure(run: RingRun, buffers: int):
    """One lane per buffer: each step's copy (producer) and its products (consumer) as marks in time, joined by a line
    while the step's data sits in the buffer. Returns the figure."""
    import matplotlib.pyplot as plt

    copies = {step: (t, slot) for t, role, step, slot, _ in run.events if role == "producer"}
    products = {step: t for t, role, step, _, _ in run.events if role == "consumer"}
    fig, ax = plt.subplots(figsize=(11, 0.6 * buffers + 1.4))
    for step, (t, slot) in copies.items():
        end = products.get(step, t)
        ax.plot([t, end], [slot, slot], color="tab:gray", lw=6, alpha=0.35, solid_capstyle="butt")
        ax.scatter([t], [slot], color="tab:blue", marker=">", zorder=3)
        if step in products:
            ax.scatter([end], [slot], color="tab:red", marker="s", zorder=3)
        ax.annotate(str(step), (t, slot), xytext=(0, 7), textcoords="offset points", fontsize=7, ha="center")
    ax.set(
        yticks=range(buffers),
        yticklabels=[f"buffer {b}" for b in range(buffers)],
        xlabel="event",
        title="The ring: ▶ a step's tiles land (ready completes), ■ its products are done (empty completes); "
        "grey while the buffer holds them",
    )
    ax.title.set_fontsize(9)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def ring_diagram(buffers: int = 4):
    """The roles of a warp-specialised Gluon launch and the ring between them: the loading warp's TMA copies fill
    buffer i mod BUFFERS and complete its *ready* barrier; the wgmma warpgroups wait on *ready*, multiply, and
    complete *empty*; the loading warp waits on *empty* before it refills the buffer. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib import patches

    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.add_patch(patches.FancyBboxPatch((0, 1.0), 2.2, 1.6, boxstyle="round,pad=0.05", fc="#ddf4ff", ec="#0969da"))
    ax.text(
        1.1,
        1.8,
        "loading warp\n(1 warp, 40 registers)\nTMA copies:\nglobal → shared",
        ha="center",
        va="center",
        fontsize=8,
    )
    ax.add_patch(patches.FancyBboxPatch((8.3, 1.0), 2.5, 1.6, boxstyle="round,pad=0.05", fc="#fff1e5", ec="#bc4c00"))
    ax.text(
        9.55,
        1.8,
        "2 warpgroups\n(8 warps)\nwgmma from shared,\nfp32 accumulator\nin registers",
        ha="center",
        va="center",
        fontsize=8,
    )
    width = 4.6 / buffers
    for b in range(buffers):
        x = 3.0 + b * width
        ax.add_patch(patches.Rectangle((x, 1.2), width * 0.9, 1.2, fc="#f6f8fa", ec="black"))
        ax.text(x + width * 0.45, 1.95, f"buffer {b}\nA, B tiles\n(step i ≡ {b})", ha="center", va="center", fontsize=7)
        ax.add_patch(patches.Circle((x + width * 0.25, 1.32), 0.08, color="#1a7f37"))
        ax.add_patch(patches.Circle((x + width * 0.65, 1.32), 0.08, color="#cf222e"))
    ax.text(
        5.3,
        -0.05,
        "● ready: the copy engine completes it when the bytes land    "
        "● empty: the warpgroups complete it when their MMAs on the buffer are done",
        fontsize=7,
        ha="center",
    )
    ax.annotate("", xy=(3.0, 2.1), xytext=(2.3, 2.1), arrowprops=dict(arrowstyle="->", lw=1.5, color="#0969da"))
    ax.text(2.65, 2.25, "copy step i", ha="center", fontsize=7, color="#0969da")
    ax.annotate("", xy=(8.2, 2.1), xytext=(7.6, 2.1), arrowprops=dict(arrowstyle="->", lw=1.5, color="#bc4c00"))
    ax.text(7.9, 2.25, "wait ready,\nmultiply", ha="center", fontsize=7, color="#bc4c00")
    ax.annotate(
        "",
        xy=(1.1, 0.95),
        xytext=(9.55, 0.95),
        arrowprops=dict(arrowstyle="->", lw=1, color="#cf222e", connectionstyle="arc3,rad=-0.12"),
    )
    ax.text(
        5.3,
        0.22,
        "arrive on empty: the buffer may be refilled (the loading warp waits on it first)",
        ha="center",
        fontsize=7,
        color="#cf222e",
    )
    ax.text(
        5.3,
        2.85,
        f"the ring: {buffers} buffers in shared memory, step i in buffer i mod {buffers}, "
        "each barrier's phase parity (i // BUFFERS) & 1",
        ha="center",
        fontsize=8,
    )
    ax.set(xlim=(-0.2, 11), ylim=(-0.2, 3.1))
    ax.axis("off")
    fig.tight_layout()
    return fig
