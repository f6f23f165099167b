"""Races the interpreter cannot see: every wait and counter between the programs of one P1 launch.

Where programs of one launch hand each other data (notes/p1/races.md):

    chained_kernel (design 8)           launch 2's tiles spin-wait on the dA counter (tickets[1]) for this launch's
                                        dA programs, which count themselves in after storing dGate, dUp
    few_tokens_kernel (designs 5, 11)   phase 2's tile (b2, c2) spin-waits on I-block b2's counter for the phase-1
                                        tiles whose dA partials it sums; with dx_sum_slices S the tiles b2 < S of
                                        H-tile c2 spin-wait on c2's counter for all its dx partials, else the last
                                        tile of c2 to arrive sums them
    one_token_kernel (design 9)         the same waits and the same last arrival, one token
    kernels.combine_splits (design 2)   split-K: the last split of a tile to arrive sums the partials
                                        (triton_launches and chained, every kind of tile)
    gluon_launch2.count_in_partial      dx split over programs in Gluon, as combine_splits (GPU only); launch 2 waits
                                        for launch 1 by griddepcontrol.wait (programmatic dependent launch)

The interpreter runs a launch's programs one after another, in order, so there every wait is satisfied when it is
reached and every read finds its data written: a wait on the wrong counter or for the wrong count, an arrival before
the store it stands for, or a "last split" chosen by split number instead of by the count still give the right bits.
So the CPU tests do not stop at the outputs: ``interpreter_races.Recorder`` logs every program's loads, stores,
atomics, barriers and waits (target and counter), and
- each wait is held to a model of the design's dataflow below (which tiles write what the waiting tile reads, on
  which counter they count themselves in, so the counter and the count it must wait for), and the counter's
  arrivals in the launch are exactly those tiles';
- ``interpreter_races.races`` finds every pair of programs that touch one address without a release/acquire chain
  on a counter that orders them, counted so that it holds in any order the programs could run in;
- the launches run in program order, reversed and shuffled too, the outputs the same bits in every order (the sums
  run in split order), so that a decision taken on a count (which program is last) is taken by other programs.
The few-token launch's waits need every program resident at once, which the interpreter cannot do: there it runs as
two launches; here its one launch (PHASE 0) runs with waits that log their target and return at once (its outputs
are then meaningless, its log is not).
GPU (``gpu``): many calls back to back on fresh random inputs, and on two streams at once, each result the same bits
as a call of the same inputs run alone, at token counts that leave partial tiles (every design with counters is
deterministic: its sums run in a fixed order whatever the arrival order), in a child process with a time limit so
that a hang fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from interpreter_races import Recorder, in_order, races, reversed_order, shuffled_order

from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.swiglu_down.backward import allocate_outputs, swiglu_down_backward_triton
from moe_lib.swiglu_down.designs import ChainedConfig, Inputs, chained, few_tokens
from moe_lib.swiglu_down.designs.few_tokens import FewTokensConfig
from moe_lib.swiglu_down.designs.triton_launches import launch_plan
from moe_lib.swiglu_down.kernels import wait_for

from .helpers import DEVICE, OUTPUTS
from .test_designs import INTERPRETER_CONFIGS, ODD, SPLIT_TILES
from .test_few_tokens import ONE_TOKEN_TILINGS, TILINGS
from .test_few_tokens import H as FEW_H
from .test_few_tokens import I as FEW_I

ROOT = Path(__file__).resolve().parents[2]
needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="needs the Triton interpreter (no CUDA)")
ORDERS = {"in order": in_order, "reversed": reversed_order}


def odd_inputs(seed: int, T: int = ODD[0], H: int = ODD[1], I: int = ODD[2], dtype=ODD[3]) -> dict:
    return problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        dtype=dtype,
        hidden_size=H,
        intermediate_size=I,
        distribution="harness",
    )


def waits_of(launch, counters: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    """program -> [(counter index in ``counters``, target)] of every wait the launch made, in the order made."""
    waits = {}
    for pid, event in launch.events("wait"):
        index = (int(event.addresses[0]) - counters.data_ptr()) // counters.element_size()
        waits.setdefault(pid, []).append((index, event.target))
    return waits


def arrivers(launch, address: int) -> list[int]:
    """The programs that added to the counter at ``address`` in ``launch``, once per addition, sorted."""
    return sorted(pid for pid, _, counter, _ in launch.arrivals() if counter == address)


def assert_no_races(launch, names=None) -> None:
    found = races(launch, names)
    assert not found, "\n".join(found[:10])


# ---------------------------------------------------------------------------------------------
# the checker itself, on a hand-off between two programs


@triton.jit
def handoff_kernel(data_ptr, counter_ptr, TARGET: tl.constexpr, SEM: tl.constexpr, BARRIER: tl.constexpr):
    """Program 0 stores four values and counts itself in; program 1 waits for TARGET and doubles them."""
    offsets = tl.arange(0, 4)
    if tl.program_id(0) == 0:
        tl.store(data_ptr + offsets, tl.full((4,), 1.5, tl.float32))
        if BARRIER:
            tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem=SEM, scope="gpu")
    else:
        wait_for(counter_ptr, TARGET)
        tl.store(data_ptr + 4 + offsets, 2 * tl.load(data_ptr + offsets))


@triton.jit
def last_split_kernel(partials_ptr, counter_ptr, out_ptr, BY_COUNT: tl.constexpr):
    """Four programs park a partial each and count themselves in; the last to arrive (BY_COUNT) or program 3 sums."""
    pid = tl.program_id(0)
    tl.store(partials_ptr + pid, pid.to(tl.float32) + 0.5)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = (arrived % 4 == 3) if BY_COUNT else (pid == 3)
    if last:
        tl.store(out_ptr, tl.sum(tl.load(partials_ptr + tl.arange(0, 4))))


@needs_interpreter
@pytest.mark.parametrize(
    "target, sem, barrier, why",
    [
        (1, "release", True, None),
        (0, "release", True, "gets there without p"),
        (2, "release", True, "the launch takes to 1 only"),
        (1, "relaxed", True, "not a release"),
        (1, "release", False, "no barrier"),
    ],
)
def test_the_checker_flags_a_hand_off_left_unordered(target, sem, barrier, why, monkeypatch):
    """In the interpreter program 1 reads program 0's values in every case (program 0 ran first): the check tells
    the hand-off that holds on a GPU from the ones that race there (or, waiting for 2, never end)."""
    recorder = Recorder(wait_modules=[sys.modules[__name__]], spin=False).install(monkeypatch)
    data, counter = torch.zeros(8), torch.zeros(1, dtype=torch.int64)
    handoff_kernel[(2,)](data, counter, target, sem, barrier)
    assert torch.equal(data[4:], torch.full((4,), 3.0))
    found = races(recorder.launches[0])
    assert (not found) if why is None else (len(found) == 1 and why in found[0]), found


@needs_interpreter
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("by_count", [True, False])
def test_the_checker_flags_a_last_split_chosen_by_its_number(by_count, order, monkeypatch):
    """The last split chosen by the count it found is ordered after every other in any program order; chosen by its
    number (program 3), it is only when it happens to run last: in order the sum is right and nothing is flagged,
    reversed it reads partials not stored yet, and the check says so."""
    recorder = Recorder(order=ORDERS[order]).install(monkeypatch)
    partials, counter, out = torch.full((4,), float("nan")), torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    last_split_kernel[(4,)](partials, counter, out, by_count)
    found = races(recorder.launches[0])
    if by_count or order == "in order":
        assert not found and out.item() == 8.0, found
    else:
        assert found and all("w found 0" in line for line in found), found


# ---------------------------------------------------------------------------------------------
# the few-token launch (PHASE 0, as the GPU runs it)


def few_token_waits(config: FewTokensConfig, H: int, I: int) -> dict[int, list[tuple[int, frozenset[int]]]]:
    """program -> [(counter index, the programs whose arrivals on it the program must wait for)], from what each tile
    reads (``few_tokens.py``; counters [0] launches, [1 + b] per phase-2 I-block b, [1 + N_I2 + c] per H-tile c):

    - phase-1 tile (c1, b1), program b1 · N_H1 + c1, writes dA partial c1 over its I-columns and counts itself in on
      the counter of every phase-2 I-block those columns overlap;
    - phase-2 tile (b2, c2), program b2 · N_H2 + c2, sums the N_H1 dA partials over its I-columns: it waits on b2's
      counter for every phase-1 tile whose columns overlap them;
    - with dx_sum_slices S > 1, the tiles (b2 < S, c2) then sum rows of dx_b[:, c2] for every b: they wait on c2's
      counter for every phase-2 tile of H-tile c2, which each write one dx_b and count themselves in there.

    A wait must reach (its launch number + 1) × the tiles it waits for: the counters only grow, by that much a
    launch."""
    n_h1, n_i1, n_i2, n_h2 = config.tiles(H, I)
    span_i1, span_i2 = config.i_spans

    def columns(block: int, span: int) -> set[int]:
        return set(range(block * span, min(block * span + span, I)))

    dx_slices = 1 if config.cuda_cores else config.dx_sum_slices
    waits = {}
    for b2 in range(n_i2):
        writers = frozenset(
            b1 * n_h1 + c1 for b1 in range(n_i1) for c1 in range(n_h1) if columns(b1, span_i1) & columns(b2, span_i2)
        )
        for c2 in range(n_h2):
            waits[b2 * n_h2 + c2] = [(1 + b2, writers)]
            if dx_slices > 1 and b2 < dx_slices:
                waits[b2 * n_h2 + c2].append((1 + n_i2 + c2, frozenset(b * n_h2 + c2 for b in range(n_i2))))
    return waits


FEW_TOKEN_CASES = {
    **{name: (config, 5 if config.block_t == 16 else 17) for name, config in TILINGS.items()},
    **{f"one token, {name}": (config, 1) for name, config in ONE_TOKEN_TILINGS.items()},
}


@needs_interpreter
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("case", list(FEW_TOKEN_CASES))
def test_few_token_waits_target_the_tiles_they_read(case, order, seed, monkeypatch):
    """The one launch, twice on the same counters (launch numbers 0 and 1): every program waits on exactly the
    counters and for exactly the counts of the model (:func:`few_token_waits`), each such counter gets its arrivals
    from exactly the model's tiles, and every read of another program's partials is ordered after its store."""
    config, T = FEW_TOKEN_CASES[case]
    H, I = FEW_H, FEW_I
    inputs = odd_inputs(seed, T, H, I, torch.bfloat16)
    n_h1, _, n_i2, n_h2 = config.tiles(H, I)
    grid = config.grid_size(H, I)
    counters = torch.zeros(1 + n_i2 + n_h2, dtype=torch.int64)
    d_a, d_x = torch.full((n_h1, T, I), float("nan")), torch.full((n_i2, T, H), float("nan"))
    out = allocate_outputs(inputs["x"], I)
    kernel, constexprs = config.launch(H, I, with_lo=True, interpreter=True, phase=0)
    recorder = Recorder(order=ORDERS[order], wait_modules=[few_tokens], spin=False).install(monkeypatch)
    for _ in range(2):
        kernel[(grid,)](
            *Inputs(*inputs.values()),
            *out,
            d_a,
            d_x,
            counters,
            counters,
            T,
            **constexprs,
            num_warps=config.warps,
            num_stages=config.stages,
        )
    model = few_token_waits(config, H, I)
    names = {"dA partials": (d_a.data_ptr(), d_a.nbytes), "dx partials": (d_x.data_ptr(), d_x.nbytes)}
    for number, launch in enumerate(recorder.launches):
        want = {
            pid: [(counter, (number + 1) * len(writers)) for counter, writers in waits] for pid, waits in model.items()
        }
        assert waits_of(launch, counters) == want, f"launch {number}"
        for pid, waits in model.items():
            for counter, writers in waits:
                address = counters.data_ptr() + 8 * counter
                assert arrivers(launch, address) == sorted(writers), (pid, counter)
        assert_no_races(launch, names)
    assert counters[0] == 2 * grid  # each program counted its launch once


# ---------------------------------------------------------------------------------------------
# the chained launch


def chained_roles(config: ChainedConfig, T: int, H: int, I: int) -> list[str]:
    """What each ticket does (``chained.py``): "dA", "dWd" or "launch 2", in ticket order."""
    plan = launch_plan(T, H, I, config.tiles)
    n_a = sum(kind.programs for kind in plan if kind.kind == "dA")
    n_wd = sum(kind.programs for kind in plan if kind.kind == "dWd")
    n_2 = sum(kind.programs for kind in plan if kind.launch == 2)
    if config.grad_down_first:
        return ["dWd"] * n_wd + ["dA"] * n_a + ["launch 2"] * n_2
    if config.grad_down_last:
        return ["dA"] * n_a + ["launch 2"] * n_2 + ["dWd"] * n_wd
    return ["dA"] * n_a + ["dWd"] * n_wd + ["launch 2"] * n_2


@needs_interpreter
@pytest.mark.parametrize("label", list(INTERPRETER_CONFIGS["chained"]))
def test_chained_waits_target_this_launchs_da_programs(label, seed, monkeypatch, poisoned):
    """Two calls (the ticket counters carry over, so the second is launch number g ≥ 1). Every program takes its
    ticket first; those of launch 2's tiles wait once, on the counter next to the tickets, for (g + 1) · nA: launch 2's
    tiles read dGate and dUp, which the dA tiles write, and exactly the nA dA programs count themselves in there. No
    wait is short when reached (tickets go out in the order programs start, so in the interpreter's order too), and
    every cross-program read is ordered after its store (dGate, dUp and the split-K partials)."""
    config = INTERPRETER_CONFIGS["chained"][label]
    T, H, I, _ = ODD
    inputs = odd_inputs(seed)
    roles = chained_roles(config, T, H, I)
    recorder = Recorder(wait_modules=[chained], spin=True).install(monkeypatch)
    for _ in range(2):
        swiglu_down_backward_triton(*inputs.values(), config=config)
    assert len(recorder.launches) == 2
    for launch in recorder.launches:
        grid = len(launch.programs)
        assert grid == len(roles)
        tickets = {pid: events[0] for pid, events in launch.programs.items()}  # each program's first atomic
        assert all(event.kind == "atomic" and event.added[0] == 1 for event in tickets.values())
        counter = int(tickets[0].addresses[0]) + 8  # tickets[1]: the dA programs done
        taken = {pid: int(event.found[0]) for pid, event in tickets.items()}
        assert sorted(count % grid for count in taken.values()) == list(range(grid))
        role = {pid: roles[count % grid] for pid, count in taken.items()}
        for pid, events in launch.programs.items():
            waits = [(int(e.addresses[0]), e.target) for e in events if e.kind == "wait"]
            number = taken[pid] // grid  # the launch number, from the ticket
            want = [(counter, (number + 1) * roles.count("dA"))] if role[pid] == "launch 2" else []
            assert waits == want, (pid, role[pid])
        assert arrivers(launch, counter) == sorted(pid for pid in role if role[pid] == "dA")
        assert_no_races(launch)


# ---------------------------------------------------------------------------------------------
# split reductions in any program order


ORDER_CASES = {
    "triton_launches, split": (SPLIT_TILES, ODD[0]),
    "triton_launches, split, dx first": (INTERPRETER_CONFIGS["triton_launches"]["split, dx first"], ODD[0]),
    "chained, split, dWd first": (INTERPRETER_CONFIGS["chained"]["split, dWd first"], ODD[0]),
    "few_tokens, streamed straddled": (TILINGS["streamed straddled"], 5),
    "few_tokens, one token": (ONE_TOKEN_TILINGS["streamed, I spans"], 1),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_split_sums_are_the_same_bits_in_any_program_order(case, seed, monkeypatch, poisoned):
    """Through the call, from NaN-filled memory, programs in order, reversed and shuffled: the same bits every time
    (the last split to arrive sums all splits in split order, whichever it is), and no cross-program read unordered
    after its store in any launch (the few-token design as the interpreter runs it: its phases as two launches, the
    last phase-2 tile of an H-tile to arrive summing its dx partials)."""
    config, T = ORDER_CASES[case]
    H, I = (FEW_H, FEW_I) if case.startswith("few") else ODD[1:3]
    inputs = odd_inputs(seed, T, H, I, torch.bfloat16)
    results, checked = {}, 0
    for name, order in (("in order", in_order), ("reversed", reversed_order), ("shuffled", shuffled_order(seed))):
        with monkeypatch.context() as patch:
            recorder = Recorder(order=order, wait_modules=[chained, few_tokens], spin=True).install(patch)
            results[name] = swiglu_down_backward_triton(*inputs.values(), config=config)
        for launch in recorder.launches:
            assert_no_races(launch)
            checked += len(launch.arrivals())
    assert checked, "no counter in any launch: nothing was checked"
    for name, got in results.items():
        for output, a, b in zip(OUTPUTS, got, results["in order"], strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b), (name, output)


# ---------------------------------------------------------------------------------------------
# every atomic and every wait of the library is one of those above


# file -> its calls of tl.atomic_*, gl.atomic_*, wait_for and gdc_wait (a launch's wait for the one before it), and
# where they are checked (the mbarriers of the Gluon kernels order the warps of one program: not counted here)
INVENTORY = {
    "moe_lib/swiglu_down/kernels.py": 3,  # combine_splits' arrival, wait_for's two polls: every test above
    "moe_lib/swiglu_down/designs/chained.py": 3,  # the ticket, dA done, the wait: test_chained_waits_...
    "moe_lib/swiglu_down/designs/few_tokens.py": 6,  # arrive, both kernels' phase-1 arrivals, three waits: test_few_...
    "moe_lib/swiglu_down/gluon_launch2.py": 4,  # count_in_partial, the PDL waits: test_gpu_... (Gluon runs on GPUs)
}
SYNCHRONISING = re.compile(r"\b(?:tl|gl)\.atomic_\w+\(|(?<![\w.])wait_for\(|\bgdc_wait\(")


def test_every_atomic_and_wait_of_the_library_is_accounted_for():
    """A new atomic or wait between programs needs a test here (and a line in notes/p1/races.md) before it lands;
    P2 has none (tests/moe_experts/test_races.py)."""
    found = {}
    for path in sorted((ROOT / "moe_lib").rglob("*.py")):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        count = sum(1 for match in SYNCHRONISING.finditer(code) if not code[: match.start()].endswith("def "))
        if count:
            found[str(path.relative_to(ROOT))] = count
    assert found == INVENTORY


# ---------------------------------------------------------------------------------------------
# GPU: many calls back to back and on two streams, each the bits of the same call run alone


STRESS_SCRIPT = """
import sys
import torch
from moe_lib import problems
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.designs.few_tokens import FewTokensConfig
from moe_lib.swiglu_down.designs.library_gemms import LibraryGemmsConfig
from moe_lib.swiglu_down.runtime import device_of
from swiglu_down.helpers import OUTPUTS, check_against_float64

spec, precision, seed, calls, hidden, inter = sys.argv[1], sys.argv[2], *map(int, sys.argv[4:8])
device = device_of(torch.empty(0, device="cuda"))
ran = 0
for T in map(int, sys.argv[3].split(",")):
    if spec == "default":
        config = choose_design(T, hidden, inter, dtype=torch.bfloat16, precision=precision, device=device)
        if isinstance(config, LibraryGemmsConfig):  # no counters; cuBLAS on two streams need not give the same bits
            print(f"T={T}: cuBLAS's GEMMs")
            continue
    else:
        few = spec == "few_tokens"
        config = FewTokensConfig.for_shape(T, hidden, inter, device.sms) if few else P1_CANDIDATES[spec]
        reason = config.supports(T, hidden, inter, torch.bfloat16, device)
        if reason is not None:
            print(f"T={T}: {reason}")
            continue
    inputs = [problems.make_inputs("swiglu_down_backward", T, seed=seed + 7919 * T + k, device="cuda",
                                   distribution="harness", hidden_size=hidden, intermediate_size=inter)
              for k in range(calls)]

    def call(x):
        return swiglu_down_backward_triton(*x.values(), config=config, precision=precision)

    alone = []
    for x in inputs:  # one call at a time
        torch.cuda.synchronize()
        alone.append(call(x))
        torch.cuda.synchronize()
    check_against_float64(inputs[0], alone[0], precision)
    back_to_back = [call(x) for x in inputs]
    torch.cuda.synchronize()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    two_streams = []
    for k, x in enumerate(inputs):
        with torch.cuda.stream(streams[k % 2]):
            two_streams.append(call(x))
    torch.cuda.synchronize()
    for how, results in (("back to back", back_to_back), ("on two streams", two_streams)):
        for k, (got, want) in enumerate(zip(results, alone)):
            for name, g, w in zip(OUTPUTS, got, want):
                assert torch.equal(g, w), f"{type(config).__name__} T={T}, call {k} {how}: {name} differs from alone"
    ran += 1
print("ok" if ran else "nothing ran")
"""


def stress(spec: str, tokens, seed: int, precision: str = "faithful", calls: int = 16, shape=(2048, 768)) -> None:
    """STRESS_SCRIPT in a child process (a hang fails the test instead of stopping the run)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            STRESS_SCRIPT,
            spec,
            precision,
            ",".join(map(str, tokens)),
            str(seed),
            str(calls),
            *map(str, shape),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode == 0 and done.stdout.strip().endswith("nothing ran"):
        pytest.skip(f"{spec} runs none of {tokens} here: {done.stdout.strip()}")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("shape", [(2048, 768), (1000, 300)])
def test_gpu_few_token_launch_back_to_back_and_on_two_streams(shape, precision, seed):
    """The waits between the phases and the sliced dx sum (2-128 tokens), the last arrival (one token on the CUDA
    cores): token counts that leave the token block partly empty; an odd shape whose tiles are ragged."""
    stress("few_tokens", (1, 2, 3, 17, 33, 64, 100, 128), seed, precision, shape=shape)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, tokens",
    [("chained", (1, 7, 100, 333)), ("chained_wide", (512, 999)), ("chained_wide_dwd_last", (1153, 1249))],
)
def test_gpu_chained_launch_back_to_back_and_on_two_streams(name, tokens, seed):
    """Launch 2's wait for the dA tiles by tickets over one to many waves of programs."""
    stress(name, tokens, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens", [("triton_tiny", (1, 5, 16)), ("triton_mid", (17, 100, 255))])
def test_gpu_split_k_launches_back_to_back_and_on_two_streams(name, tokens, seed):
    """The portable launches with every reduction split (8 or 4 programs a tile, the last to arrive sums)."""
    stress(name, tokens, seed, "fast")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gluon_narrow_dx4", "gluon_tall_dx2", "gluon_wide_dx4", "gluon_tall_dx_first_dx2"])
def test_gpu_gluon_split_dx_back_to_back_and_on_two_streams(name, seed):
    """dx split over programs in Gluon (count_in_partial), launch 2 waiting for launch 1 by programmatic dependent
    launch: partial tiles along T."""
    stress(name, (65, 100, 257, 1087), seed)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_default_call_back_to_back_and_on_two_streams(precision, seed):
    """The chooser's own designs across the few-token and Gluon bands (to 512 tokens: dx split 4 and 2 ways there)."""
    stress("default", (1, 3, 16, 64, 65, 127, 128, 129, 200, 257, 511), seed, precision)
