"""Races the Triton interpreter cannot see, made visible: every memory access of an interpreted launch, program by
program, and a happens-before check over them.

The interpreter runs a launch's programs one after another, so a program that reads what another wrote without
waiting for it, or that waits on the wrong counter or for the wrong count, still gets the right bits there: what it
reads was written by then (or is never written, and it reads stale memory). On a GPU the programs run at once.
:class:`Recorder` logs, for each program of each interpreted launch, in the order it ran:

    load, store   the addresses (masked-off lanes left out)
    atomic        the addresses, what was added, what was found there, the memory semantics
    barrier       tl.debug_barrier()
    wait          a spin-wait (``wait_for``, wrapped where a kernel's module names it): the counter, the target, and
                  the count it found when it got there

and :func:`races` lists every pair of programs that touch one address (one stores, the other loads or stores it)
with nothing ordering them. Program p's store comes before program w's access when p, after the store and a
barrier, adds to a counter C with release semantics (release or acq_rel), and before the access w either
    - spin-waits on C (the poll an acquire, then a barrier) for a target that C cannot reach without p's additions, or
    - adds to C itself with acquire semantics (the last of a tile's splits to arrive) and found there a count that C
      cannot hold before w's addition without p's.
"Cannot reach without p's additions" is counted, not observed: C at the launch's start plus every addition the
launch makes to it, p's left out (and w's own, for a count w found), is below what was needed. So an ordering holds
in whatever order the programs run; a decision a program takes on the count it found (whether it is the last) is
tested by running the launch in other program orders too (``Recorder(order=...)``).
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field

import numpy as np

# what an atomic's sem= is, by the name of the interpreter builder's enum member
ACQUIRES = {"ACQUIRE", "ACQUIRE_RELEASE"}
RELEASES = {"RELEASE", "ACQUIRE_RELEASE"}


def in_order(grid: int) -> list[int]:
    return list(range(grid))


def reversed_order(grid: int) -> list[int]:
    return list(range(grid))[::-1]


def shuffled_order(seed: int):
    """Program ids in a seeded random order, a fresh one per launch."""
    rng = random.Random(seed)

    def order(grid: int) -> list[int]:
        programs = list(range(grid))
        rng.shuffle(programs)
        return programs

    return order


@dataclass(eq=False)
class Event:
    seq: int  # when it ran, over the whole launch (the interpreter runs one program at a time)
    kind: str  # "load", "store", "atomic", "barrier", "wait"
    addresses: np.ndarray | None = None  # int64 byte addresses (load, store, atomic); the counter's (wait)
    added: np.ndarray | None = None  # atomic: what each lane added (0: a poll)
    found: np.ndarray | None = None  # atomic: what each lane found there
    sem: str = ""  # atomic: the memory semantics' name
    target: int = 0  # wait: the count waited for
    seen: int = 0  # wait: the count the counter held when the wait was reached


@dataclass
class Launch:
    kernel: str
    programs: dict[int, list[Event]] = field(default_factory=dict)  # program id -> its events in order
    _arrivals: list | None = field(default=None, repr=False)

    def events(self, kind: str):
        """(program, event) of every event of ``kind``, in the order they ran."""
        found = [(pid, e) for pid, events in self.programs.items() for e in events if e.kind == kind]
        return sorted(found, key=lambda item: item[1].seq)

    def arrivals(self):
        """(program, event, address, added) of every lane of every atomic that added something, in the order run."""
        if self._arrivals is None:
            self._arrivals = [
                (pid, e, int(a), int(v))
                for pid, e in self.events("atomic")
                for a, v in zip(e.addresses, e.added, strict=True)
                if v != 0
            ]
        return self._arrivals

    def start_count(self, address: int) -> int:
        """The counter at ``address`` when the launch started: what its first atomic found there."""
        for _, e in self.events("atomic"):
            hits = np.nonzero(e.addresses == address)[0]
            if hits.size:
                return int(e.found[hits[0]])
        raise KeyError(f"no atomic on {address:#x} in {self.kernel}")


class Recorder:
    """Installs itself in the interpreter (``install(monkeypatch)``) and keeps a :class:`Launch` per launch
    (``launches``). ``order``: program ids in the order the interpreter runs them, a function of the grid size
    (default: in order). ``wait_modules``: modules whose kernels call ``wait_for(counter_ptr, target)``: it is
    wrapped there to log the target and the count found. With ``spin=False`` a wait whose target was not reached
    yet returns at once (for launches whose programs wait for programs that run after them, which the interpreter
    cannot run: only the log is meaningful then); with ``spin=True`` that is an error (it would wait forever)."""

    def __init__(self, order=in_order, wait_modules=(), spin=True):
        self.order, self.wait_modules, self.spin = order, tuple(wait_modules), spin
        self.launches: list[Launch] = []
        self._launch: Launch | None = None
        self._seq = 0

    def install(self, monkeypatch) -> Recorder:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        sem_names = {value: name for name, value in ir.MEM_SEMANTIC.__members__.items()}
        recorder, orders = self, {}

        def linear(x, y, z):  # a program's id: its place in the interpreter's loops over the grid
            _, ny, nz = builder.grid_dim
            return (x * ny + y) * nz + z

        def log(kind, **fields):
            if recorder._launch is None:
                return
            pid = linear(*builder.grid_idx)
            recorder._seq += 1
            recorder._launch.programs.setdefault(pid, []).append(Event(recorder._seq, kind, **fields))

        def addresses(ptrs, mask=None):
            addr = np.asarray(ptrs.data).astype(np.int64).ravel()
            if mask is None:
                return addr, np.ones(addr.shape, bool)
            on = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel().astype(bool)
            return addr[on], on

        load, store = builder.create_masked_load, builder.create_masked_store
        rmw, set_grid_dim, set_grid_idx = builder.create_atomic_rmw, builder.set_grid_dim, builder.set_grid_idx

        def masked_load(ptrs, mask, *args, **kwargs):  # every load: plain, block-pointer and descriptor ones too
            log("load", addresses=addresses(ptrs, mask)[0])
            return load(ptrs, mask, *args, **kwargs)

        def masked_store(ptrs, value, mask, *args, **kwargs):
            log("store", addresses=addresses(ptrs, mask)[0])
            return store(ptrs, value, mask, *args, **kwargs)

        def atomic_rmw(op, ptrs, value, mask, sem, scope):
            result = rmw(op, ptrs, value, mask, sem, scope)
            addr, on = addresses(ptrs, mask)
            if op != ir.ATOMIC_OP.ADD:
                raise NotImplementedError(f"the race check knows atomic adds only, got {op}")
            added = np.broadcast_to(np.asarray(value.data), np.asarray(ptrs.data).shape).ravel()[on]
            found = np.asarray(result.data).ravel()[on]
            log(
                "atomic", addresses=addr, added=added.astype(np.int64), found=found.astype(np.int64), sem=sem_names[sem]
            )
            return result

        def atomic_cas(*args):
            raise NotImplementedError("the race check knows atomic adds only, got a compare-and-swap")

        def unseen(*args, **kwargs):
            raise NotImplementedError("the race check does not see descriptor gathers and scatters")

        def grid_dim(nx, ny, nz):
            programs = nx * ny * nz
            orders[0] = recorder.order(programs)
            assert sorted(orders[0]) == list(range(programs)), "an order must run every program once"
            return set_grid_dim(nx, ny, nz)

        def grid_idx(x, y, z):  # the loops' next program in place, the one ``order`` puts there run instead
            _, ny, nz = builder.grid_dim
            pid = orders[0][linear(x, y, z)]
            return set_grid_idx(pid // (ny * nz), pid // nz % ny, pid % nz)

        for name, replacement in (
            ("create_masked_load", masked_load),
            ("create_masked_store", masked_store),
            ("create_atomic_rmw", atomic_rmw),
            ("create_atomic_cas", atomic_cas),
            ("create_barrier", lambda: log("barrier")),
            ("set_grid_dim", grid_dim),
            ("set_grid_idx", grid_idx),
            ("create_descriptor_gather", unseen),
            ("create_descriptor_scatter", unseen),
        ):
            monkeypatch.setattr(builder, name, replacement)

        call = interpreter.GridExecutor.__call__

        def launch(executor, *args, **kwargs):
            recorder._launch = Launch(executor.fn.__name__)
            try:
                return call(executor, *args, **kwargs)
            finally:
                recorder.launches.append(recorder._launch)
                recorder._launch = None

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
        for module in self.wait_modules:
            monkeypatch.setattr(module, "wait_for", self._wrapped_wait(module.wait_for, log))
        return self

    def _wrapped_wait(self, wait_for, log):
        def recorded_wait(counter_ptr, target):
            address = int(np.asarray(counter_ptr.handle.data).ravel()[0])
            target = int(np.asarray(target.handle.data).ravel()[0]) if hasattr(target, "handle") else int(target)
            seen = ctypes.c_int64.from_address(address).value
            log("wait", addresses=np.array([address], np.int64), target=target, seen=seen)
            if seen < target and self.spin:
                raise AssertionError(f"a wait for {target} on a counter at {seen}: on its own, it would never end")
            return wait_for(counter_ptr, min(target, seen))  # polls once (acquire), then the barrier

        return recorded_wait


# ---- the happens-before check


def _accesses(events: list[Event], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, seq) of a program's accesses of ``kind``, one row per address: the latest store (kind "store") or
    the earliest load (kind "load") of each."""
    chunks = [(e.addresses, np.full(e.addresses.shape, e.seq)) for e in events if e.kind == kind and e.addresses.size]
    if not chunks:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    addr = np.concatenate([c[0] for c in chunks])
    seq = np.concatenate([c[1] for c in chunks])
    order = np.lexsort((seq if kind == "load" else -seq, addr))  # first row per address: earliest load, latest store
    addr, seq = addr[order], seq[order]
    first = np.ones(addr.shape, bool)
    first[1:] = addr[1:] != addr[:-1]
    return addr[first], seq[first]


def _ordered(launch: Launch, p: int, store_seq: int, w: int, access_seq: int) -> str | None:
    """None when p's store at ``store_seq`` comes before w's access at ``access_seq`` in every order the programs
    could run in (see the module); else why not."""
    events_p, events_w = launch.programs[p], launch.programs[w]
    reasons = []
    for pid, arrival, counter, _ in launch.arrivals():
        if pid != p or arrival.seq < store_seq:
            continue
        if arrival.sem not in RELEASES:
            reasons.append(f"p's addition to {counter:#x} is {arrival.sem}, not a release")
            continue
        if not any(e.kind == "barrier" and store_seq < e.seq < arrival.seq for e in events_p):
            reasons.append(f"no barrier between p's store and its addition to {counter:#x}")
            continue
        additions = [(pid, e, v) for pid, e, a, v in launch.arrivals() if a == counter]
        total = launch.start_count(counter) + sum(v for _, _, v in additions)
        by_p = sum(v for pid, e, v in additions if pid == p and e.seq > store_seq)
        for wait in (e for e in events_w if e.kind == "wait" and e.seq < access_seq):
            if int(wait.addresses[0]) != counter:
                continue
            polls = [e for e in events_w if e.kind == "atomic" and e.seq > wait.seq and counter in e.addresses]
            if not polls or polls[0].sem not in ACQUIRES:
                reasons.append("w's wait does not poll with acquire")
            elif not any(e.kind == "barrier" and polls[0].seq < e.seq < access_seq for e in events_w):
                reasons.append("no barrier between w's wait and its access")
            elif wait.target > total:
                reasons.append(f"w waits for {wait.target} on a counter the launch takes to {total} only")
            elif wait.target <= total - by_p:
                reasons.append(f"w waits for {wait.target} on a counter that gets there without p (to {total} with)")
            else:
                return None
        for own in (e for e in events_w if e.kind == "atomic" and e.seq < access_seq and counter in e.addresses):
            lane = int(np.nonzero(own.addresses == counter)[0][0])
            if own.added[lane] == 0:
                continue  # a poll (a wait's), counted above
            if own.sem not in ACQUIRES:
                reasons.append(f"w's addition to {counter:#x} is {own.sem}, not an acquire")
            elif own.found[lane] <= total - own.added[lane] - by_p:
                reasons.append(f"w found {own.found[lane]} on a counter that holds that without p")
            else:
                return None
    return "; ".join(dict.fromkeys(reasons)) or "no counter links them"


def races(launch: Launch, names: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """Every pair of programs of ``launch`` that touch one address, one storing it, with nothing ordering the store
    before the other's access (a store of both: either way round), described; empty when there is none. ``names``:
    buffer name -> (first byte address, byte size), to name the buffer in the descriptions."""

    def buffer(address: int) -> str:
        for name, (start, size) in (names or {}).items():
            if start <= address < start + size:
                return name
        return f"{address:#x}"

    stores = {pid: _accesses(events, "store") for pid, events in launch.programs.items()}
    loads = {pid: _accesses(events, "load") for pid, events in launch.programs.items()}
    found = []
    for p, (stored, store_seqs) in stores.items():
        for w in launch.programs:
            for kind, (addr, seqs) in (("loads", loads[w]), ("stores", stores[w])):
                if w == p or (kind == "stores" and w < p):
                    continue
                common, at_p, at_w = np.intersect1d(stored, addr, assume_unique=True, return_indices=True)
                # one check per pair of events (p's store, w's access) that share addresses
                pairs, first, count = np.unique(
                    np.stack([store_seqs[at_p], seqs[at_w]], axis=1), axis=0, return_index=True, return_counts=True
                )
                for (store_seq, access_seq), index, elements in zip(pairs.tolist(), first, count, strict=True):
                    why = _ordered(launch, p, store_seq, w, access_seq)
                    if why is not None and kind == "stores" and _ordered(launch, w, access_seq, p, store_seq) is None:
                        why = None  # a store of both: ordered the other way round will do
                    if why is not None:
                        found.append(
                            f"{launch.kernel}: program {w} {kind} {elements} element(s) of "
                            f"{buffer(int(common[index]))} that program {p} stores: {why}"
                        )
    return found
