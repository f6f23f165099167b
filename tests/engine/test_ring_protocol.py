"""The Gluon GEMM's mbarrier protocol (``moe_lib/engine/gluon_gemm.py``), played out on the CPU over random
interleavings: no deadlock, every wgmma reads the K step it waited for, no TMA copy overwrites a buffer a wgmma
still reads.

The model repeats the kernel's index arithmetic (ring step i in buffer i mod BUFFERS, phase (i // BUFFERS) mod 2,
a fresh barrier waited on with parity 1 passing, the ping-pong turns) with an mbarrier's semantics: a wait on
parity P passes once the barrier's phase of parity P has completed, i.e. while the count of its completed phases
has the other parity. TMA copies and wgmma complete asynchronously, copies in any order, each partition's wgmma in
issue order. A partition that passes a wait meant for a later use of a buffer reads the wrong step: the model
reports it, as it does for ping-pong without its turns (the check can fail).
"""

import random

import pytest


class Barrier:
    """An mbarrier of arrival count 1."""

    def __init__(self):
        self.completed = 0  # phases completed

    def passes(self, parity: int) -> bool:
        return (self.completed & 1) != parity

    def arrive(self):
        self.completed += 1


def waiting_on(barrier: Barrier, parity: int):
    return lambda: barrier.passes(parity)


def all_done(mmas: list):
    return lambda: all(mma["done"] for mma in mmas)


def play(tiles: int, k_steps: int, buffers: int, consumers: int, rng: random.Random, turns_on: bool = True):
    """One program's run (``tiles`` tiles); returns the faults seen ("deadlock" among them)."""
    ready, empty = [Barrier() for _ in range(buffers)], [Barrier() for _ in range(buffers)]
    turns = [Barrier(), Barrier()]
    content, writing, reading = [None] * buffers, [False] * buffers, [0] * buffers
    copies, mmas, faults = [], [], []

    def loader():
        i = 0
        for _tile in range(tiles):
            for _step in range(k_steps):
                slot = i % buffers
                yield waiting_on(empty[slot], ((i // buffers) & 1) ^ 1)
                if reading[slot]:
                    faults.append(f"step {i}: copy into buffer {slot} while a wgmma reads it")
                writing[slot] = True
                copies.append((slot, i))
                i += 1

    def consumer(me: int):
        n = 0
        for tile in range(me, tiles, consumers):
            step0 = tile * k_steps
            if consumers > 1 and turns_on:
                yield waiting_on(turns[me], (n & 1) ^ (1 - me))
            in_flight = []
            for step in range(k_steps):
                i = step0 + step
                slot = i % buffers
                yield waiting_on(ready[slot], (i // buffers) & 1)
                if writing[slot] or content[slot] != i:
                    faults.append(f"consumer {me}, step {i}: buffer {slot} holds step {content[slot]}")
                reading[slot] += 1
                mma = dict(slot=slot, step=i, done=False, consumer=me)
                mmas.append(mma)
                in_flight.append(mma)
                yield all_done(in_flight[:-1])  # warpgroup_mma_wait(num_outstanding=1)
                in_flight = in_flight[-1:]
                if step > 0:
                    empty[(i + buffers - 1) % buffers].arrive()
            if consumers > 1 and turns_on:
                turns[1 - me].arrive()
            yield all_done(in_flight)
            empty[(step0 + k_steps - 1) % buffers].arrive()
            n += 1

    agents = {"loader": loader(), **{f"consumer {c}": consumer(c) for c in range(consumers)}}
    waits = {name: (lambda: True) for name in agents}
    while agents or copies:
        choices = [("agent", name) for name in agents if waits[name]()]
        choices += [("copy", k) for k in range(len(copies))]
        choices += [
            ("mma", mma)
            for mma in mmas
            if not mma["done"]
            and all(
                other["done"] for other in mmas if other["consumer"] == mma["consumer"] and other["step"] < mma["step"]
            )
        ]
        if not choices:
            return faults + [f"deadlock: {sorted(agents)} waiting"]
        kind, what = rng.choice(choices)
        if kind == "copy":
            slot, i = copies.pop(what)
            content[slot], writing[slot] = i, False
            ready[slot].arrive()
        elif kind == "mma":
            if content[what["slot"]] != what["step"] or writing[what["slot"]]:
                faults.append(f"wgmma of step {what['step']} saw buffer {what['slot']} overwritten")
            reading[what["slot"]] -= 1
            what["done"] = True
        else:
            try:
                waits[what] = next(agents[what])
            except StopIteration:
                del agents[what]
    return faults


@pytest.mark.parametrize("consumers", [1, 2], ids=["cooperative", "pingpong"])
@pytest.mark.parametrize("buffers", [2, 3, 4, 5])
def test_ring_protocol_holds_over_random_interleavings(consumers, buffers, seed):
    rng = random.Random(seed)
    for tiles in (1, 2, 3, 5):
        for k_steps in (1, 2, 3, 4, 7, 11):
            for _ in range(6):
                faults = play(tiles, k_steps, buffers, consumers, rng)
                assert not faults, (tiles, k_steps, faults[:3])


def test_pingpong_without_its_turns_is_caught(seed):
    """Without the order barrier a consumer waits on a buffer two uses ahead and reads another step: the model sees
    it (so the test above can fail)."""
    rng = random.Random(seed)
    found = [play(4, 8, 2, 2, rng, turns_on=False) for _ in range(50)]
    assert any(found), "the model found nothing wrong with ping-pong consumers running unordered"
