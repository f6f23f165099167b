"""Expert parallelism (moe_lib.distributed) on CPU with gloo.

Spawned groups of 2 and 4 ranks each build the same global inputs from one seed (float64 with the
reference backward; one float32 case with the Triton backward under the interpreter), take their
token slice and expert shard, and run the parallel layer's forward and backward; the parent compares
the gathered outputs and gradients with the single-process ``moe_lib.moe_experts`` (same impl) on
the global inputs, and checks the rows every rank sent and received. Convention checked: a rank sends
``rows_sent[s]`` = the number of its (token, slot) pairs whose expert lives on rank s, its own rank
included (rows for local experts go through all_to_all_single's chunk to itself), and
``rows_received[s]`` = rank s's count for it.
"""

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from conftest import join_ranks, rel_error

import moe_lib
from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.distributed import ExpertParallelStats, expert_partition, moe_experts_parallel

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_AXES = dict(hidden_size=32, intermediate_size=16)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
JOIN_TIMEOUT_S = 60
GRAD_NAMES = ("grad_hidden_states", "grad_topk_weights", "grad_gate_weights", "grad_up_weights", "grad_down_weights")

# name: tokens per rank, experts, experts per token, routing ("hot_on_rank_<r>": every token on K experts of rank r),
# whether the call is given num_experts (else the layer adds up the local counts), and optionally the dtype and the
# local backward's impl (float64 and "reference" unless given)
CASES_2 = {
    "uniform": dict(tokens=[5, 7], experts=8, top_k=2, routing="uniform", pass_num_experts=True),
    "hot_on_rank_1": dict(tokens=[6, 4], experts=8, top_k=3, routing="hot_on_rank_1", pass_num_experts=False),
    # overlapped exchanges: chunk counts 2-4, one rank with fewer tokens than chunks (empty chunks)
    "uniform_chunks3": dict(tokens=[5, 7], experts=8, top_k=2, routing="uniform", pass_num_experts=True, chunks=3),
    "hot_on_rank_1_chunks4": dict(
        tokens=[6, 3], experts=8, top_k=3, routing="hot_on_rank_1", pass_num_experts=True, chunks=4
    ),
    # chunks=None: two chunks once the mean rows per rank reach AUTO_CHUNKS_MIN_ROWS (65536), here 65540
    "auto_two_chunks": dict(tokens=[32768, 32772], experts=4, top_k=2, routing="uniform", pass_num_experts=True),
}
if interpreter_enabled():  # the Triton backward on CPU tensors (conftest switches the interpreter on)
    CASES_2["triton_float32"] = dict(
        tokens=[5, 7], experts=8, top_k=2, routing="uniform", pass_num_experts=True, dtype=torch.float32, impl="triton"
    )
    CASES_2["triton_float32_chunks2"] = dict(
        tokens=[5, 7],
        experts=8,
        top_k=2,
        routing="uniform",
        pass_num_experts=True,
        dtype=torch.float32,
        impl="triton",
        chunks=2,
    )
CASES_4 = {
    "uneven_skewed": dict(tokens=[3, 0, 5, 2], experts=6, top_k=2, routing="skewed", pass_num_experts=True),
    "hot_on_rank_0": dict(tokens=[4, 3, 0, 2], experts=6, top_k=2, routing="hot_on_rank_0", pass_num_experts=True),
    "uniform_top3": dict(tokens=[4, 4, 4, 4], experts=6, top_k=3, routing="uniform", pass_num_experts=False),
    "fewer_experts_than_ranks": dict(tokens=[2, 3, 1, 2], experts=3, top_k=2, routing="uniform", pass_num_experts=True),
    # overlapped exchanges: a rank without tokens, ranks with fewer tokens than chunks, skewed and hot routing
    "uneven_skewed_chunks2": dict(
        tokens=[3, 0, 5, 2], experts=6, top_k=2, routing="skewed", pass_num_experts=True, chunks=2
    ),
    "hot_on_rank_0_chunks4": dict(
        tokens=[4, 3, 0, 6], experts=6, top_k=2, routing="hot_on_rank_0", pass_num_experts=True, chunks=4
    ),
    "uniform_top3_chunks3": dict(
        tokens=[4, 4, 4, 4], experts=6, top_k=3, routing="uniform", pass_num_experts=False, chunks=3
    ),
}


# ------------------------------------------------------------------------------------------------
# what every rank (and the parent) computes from a case


def global_inputs(case: dict, seed: int) -> dict:
    """The case's global inputs, identical on every process that asks for them."""
    inputs = problems.make_inputs(
        "moe_experts_backward",
        sum(case["tokens"]),
        seed=seed,
        dtype=case.get("dtype", torch.float64),
        routing="uniform" if case["routing"].startswith("hot_on_rank_") else case["routing"],
        num_experts=case["experts"],
        top_k=case["top_k"],
        **SMALL_AXES,
    )
    if case["routing"].startswith("hot_on_rank_"):
        block = expert_partition(case["experts"], len(case["tokens"]))[int(case["routing"].rsplit("_", 1)[1])]
        generator = torch.Generator().manual_seed(seed + 1)
        choice = torch.rand((sum(case["tokens"]), len(block)), generator=generator).argsort(dim=1)
        inputs["topk_indices"] = choice[:, : case["top_k"]] + block.start
    return inputs


def token_slice(case: dict, rank: int) -> slice:
    start = sum(case["tokens"][:rank])
    return slice(start, start + case["tokens"][rank])


def expected_rows_sent(case: dict, inputs: dict) -> list[list[int]]:
    """[r][s]: (token, slot) pairs of rank r whose expert lives on rank s."""
    partition = expert_partition(case["experts"], len(case["tokens"]))
    table = []
    for rank in range(len(case["tokens"])):
        experts = inputs["topk_indices"][token_slice(case, rank)].reshape(-1)
        table.append([int(((experts >= block.start) & (experts < block.stop)).sum()) for block in partition])
    return table


# ------------------------------------------------------------------------------------------------
# the spawned ranks


def run_case_on_rank(case: dict, seed: int, rank: int) -> dict:
    """This rank's forward and backward of the parallel layer; everything the parent checks."""
    inputs = global_inputs(case, seed)
    tokens = token_slice(case, rank)
    experts = expert_partition(case["experts"], len(case["tokens"]))[rank]
    hidden_states = inputs["hidden_states"][tokens].clone().requires_grad_()
    topk_weights = inputs["topk_weights"][tokens].clone().requires_grad_()
    shards = [
        inputs[name][experts.start : experts.stop].clone().requires_grad_()
        for name in ("gate_weights", "up_weights", "down_weights")
    ]
    stats = ExpertParallelStats()
    output = moe_experts_parallel(
        hidden_states,
        inputs["topk_indices"][tokens],
        topk_weights,
        *shards,
        impl=case.get("impl", "reference"),
        stats=stats,
        chunks=case.get("chunks"),
        num_experts=case["experts"] if case["pass_num_experts"] else None,
    )
    grads = torch.autograd.grad(output, [hidden_states, topk_weights, *shards], inputs["grad_output"][tokens])
    return dict(
        output=output.detach(),
        **dict(zip(GRAD_NAMES, grads, strict=True)),
        rows_sent=stats.rows_sent,
        rows_received=stats.rows_received,
        chunks=stats.chunks,
    )


def errors_on_rank(seed: int, rank: int) -> dict:
    """Bad calls on a 2-rank group; every rank records the exception it got (type, message)."""
    case = CASES_2["uniform"]
    inputs = global_inputs(case, seed)
    tokens = token_slice(case, rank)
    experts = expert_partition(case["experts"], 2)[rank]
    x, w = inputs["hidden_states"][tokens], inputs["topk_weights"][tokens]
    shards = [inputs[name][experts.start : experts.stop] for name in ("gate_weights", "up_weights", "down_weights")]

    out_of_range_on_rank_1 = inputs["topk_indices"][tokens].clone()
    duplicate_on_rank_0 = inputs["topk_indices"][tokens].clone()
    if rank == 1:
        out_of_range_on_rank_1[0, 0] = case["experts"]
    else:
        duplicate_on_rank_0[0, 1] = duplicate_on_rank_0[0, 0]
    calls = {
        # expert_partition(9, 2) gives rank 0 five experts; it holds four (rank 1's four are right)
        "wrong_partition": lambda: moe_experts_parallel(
            x, inputs["topk_indices"][tokens], w, *shards, impl="reference", num_experts=9
        ),
        "out_of_range_on_rank_1": lambda: moe_experts_parallel(
            x, out_of_range_on_rank_1, w, *shards, impl="reference", num_experts=8
        ),
        "duplicate_on_rank_0": lambda: moe_experts_parallel(
            x, duplicate_on_rank_0, w, *shards, impl="reference", num_experts=8
        ),
        # each rank would run a different number of exchanges
        "chunks_disagree": lambda: moe_experts_parallel(
            x, inputs["topk_indices"][tokens], w, *shards, impl="reference", num_experts=8, chunks=1 + rank
        ),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    return errors


def rank_main(rank: int, world_size: int, init_file: str, out_dir: str, cases: dict, seed: int, with_errors: bool):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = {"errors": errors_on_rank(seed, rank)} if with_errors else {}
        for name, case in cases.items():
            results[name] = run_case_on_rank(case, seed, rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them (gloo aborts)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawn_ranks(world_size: int, cases: dict, seed: int, folder: Path, *, with_errors: bool = False) -> list[dict]:
    """Runs ``rank_main`` in ``world_size`` spawned processes (bounded in time); their results by rank."""
    context = multiprocessing.get_context("spawn")
    init_file = folder / "init"
    processes = [
        context.Process(
            target=rank_main, args=(rank, world_size, str(init_file), str(folder), cases, seed, with_errors)
        )
        for rank in range(world_size)
    ]
    join_ranks(processes, JOIN_TIMEOUT_S)
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(world_size)]


@pytest.fixture(scope="module")
def module_seed():
    value = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={value}")
    return value


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, module_seed):
    return spawn_ranks(2, CASES_2, module_seed, tmp_path_factory.mktemp("two_ranks"), with_errors=True)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, module_seed):
    return spawn_ranks(4, CASES_4, module_seed, tmp_path_factory.mktemp("four_ranks"))


# ------------------------------------------------------------------------------------------------
# checks in the parent


def single_device_results(case: dict, seed: int) -> dict:
    """moe_lib.moe_experts forward and backward on the global inputs, in one process."""
    inputs = global_inputs(case, seed)
    leaves = [
        inputs[name].clone().requires_grad_()
        for name in ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
    ]
    x, w, gate, up, down = leaves
    output = moe_lib.moe_experts(x, inputs["topk_indices"], w, gate, up, down, impl=case.get("impl", "reference"))
    grads = torch.autograd.grad(output, leaves, inputs["grad_output"])
    return dict(output=output.detach(), **dict(zip(GRAD_NAMES, grads, strict=True)))


def check_against_single_device(case: dict, seed: int, per_rank: list[dict]) -> None:
    expected = single_device_results(case, seed)
    tolerance = TOLERANCE[case.get("dtype", torch.float64)]
    for name, ref in expected.items():
        gathered = torch.cat([results[name] for results in per_rank])  # token slices, or expert shards, in rank order
        assert gathered.shape == ref.shape and gathered.dtype == ref.dtype, name
        assert rel_error(gathered, ref) < tolerance, f"{name}: rel error {rel_error(gathered, ref):.2e}"


def check_rows(case: dict, seed: int, per_rank: list[dict]) -> list[list[int]]:
    sent = expected_rows_sent(case, global_inputs(case, seed))
    world_size = len(case["tokens"])
    for rank, results in enumerate(per_rank):
        assert results["rows_sent"] == sent[rank], f"rank {rank}"
        assert results["rows_received"] == [sent[source][rank] for source in range(world_size)], f"rank {rank}"
        assert sum(results["rows_sent"]) == case["tokens"][rank] * case["top_k"]
    return sent


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks_match_the_single_device_layer(two_ranks, module_seed, name):
    per_rank = [results[name] for results in two_ranks]
    check_against_single_device(CASES_2[name], module_seed, per_rank)
    sent = check_rows(CASES_2[name], module_seed, per_rank)
    expected_chunks = CASES_2[name].get("chunks") or (2 if name == "auto_two_chunks" else 1)
    assert [results["chunks"] for results in per_rank] == [expected_chunks] * 2
    if name == "hot_on_rank_1":  # rank 0's experts get nothing; all of rank 0's rows cross to rank 1
        assert sent[0][0] == 0 and sent[1][0] == 0 and per_rank[0]["rows_received"] == [0, 0]
        assert sent[0][1] == 6 * 3
        assert all(float(per_rank[0][grad].abs().max()) == 0.0 for grad in GRAD_NAMES[2:])


# (chunked case, the same case without chunks): each expert's rows all fall in one chunk, in the same order
CHUNKED_TWINS_2 = [("uniform_chunks3", "uniform")] + (
    [("triton_float32_chunks2", "triton_float32")] if interpreter_enabled() else []
)
CHUNKED_TWINS_4 = [("uneven_skewed_chunks2", "uneven_skewed"), ("uniform_top3_chunks3", "uniform_top3")]


@pytest.mark.parametrize("chunked, plain", CHUNKED_TWINS_2 + CHUNKED_TWINS_4)
def test_chunks_leave_every_result_bit_for_bit_unchanged(two_ranks, four_ranks, chunked, plain):
    per_rank = two_ranks if (chunked, plain) in CHUNKED_TWINS_2 else four_ranks
    cases = CASES_2 if (chunked, plain) in CHUNKED_TWINS_2 else CASES_4
    assert {k: v for k, v in cases[chunked].items() if k != "chunks"} == cases[plain]
    for rank, results in enumerate(per_rank):
        for name in ("output", *GRAD_NAMES):
            assert torch.equal(results[chunked][name], results[plain][name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks_match_the_single_device_layer(four_ranks, module_seed, name):
    per_rank = [results[name] for results in four_ranks]
    check_against_single_device(CASES_4[name], module_seed, per_rank)
    sent = check_rows(CASES_4[name], module_seed, per_rank)
    for rank, count in enumerate(CASES_4[name]["tokens"]):  # rank 1 or 2 has no tokens in two cases
        assert per_rank[rank]["output"].shape == (count, SMALL_AXES["hidden_size"])
    if name == "hot_on_rank_0":
        assert all(per_rank[rank]["rows_received"] == [0] * 4 for rank in (1, 2, 3))
        assert [row[0] for row in sent] == [t * 2 for t in CASES_4[name]["tokens"]]
    if name == "fewer_experts_than_ranks":  # expert_partition(3, 4): rank 3 holds no expert
        assert per_rank[3]["grad_gate_weights"].shape[0] == 0 and per_rank[3]["rows_received"] == [0] * 4


def test_errors_are_raised_on_every_rank_alike(two_ranks):
    errors = [results["errors"] for results in two_ranks]
    assert errors[0] == errors[1]  # the same exception on both ranks, so neither waits in a collective
    kind, message = errors[0]["wrong_partition"]
    assert kind == "ValueError" and message.startswith("local_gate_weights:") and "rank(s) [0]" in message
    kind, message = errors[0]["out_of_range_on_rank_1"]
    assert kind == "ValueError" and message.startswith("topk_indices:") and "rank(s) [1]" in message
    kind, message = errors[0]["duplicate_on_rank_0"]
    assert kind == "ValueError" and message.startswith("topk_indices:") and "rank(s) [0]" in message
    kind, message = errors[0]["chunks_disagree"]
    assert kind == "ValueError" and message == "chunks: the ranks disagree (by rank: {0: 1, 1: 2})"


def test_expert_partition():
    assert expert_partition(8, 2) == [range(0, 4), range(4, 8)]
    assert expert_partition(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert expert_partition(3, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]
    assert expert_partition(256, 1) == [range(256)]
    for num_experts, world_size in ((0, 2), (4, 0), (4.0, 2), (True, 2)):
        with pytest.raises(ValueError, match="num_experts|world_size"):
            expert_partition(num_experts, world_size)


def _local_call_arguments():
    """Well-formed arguments for one rank holding 4 experts (no process group needed for local checks)."""
    inputs = problems.make_inputs(
        "moe_experts_backward", 3, seed=0, dtype=torch.float64, num_experts=8, top_k=2, **SMALL_AXES
    )
    return dict(
        hidden_states=inputs["hidden_states"],
        topk_indices=inputs["topk_indices"],
        topk_weights=inputs["topk_weights"],
        local_gate_weights=inputs["gate_weights"][:4],
        local_up_weights=inputs["up_weights"][:4],
        local_down_weights=inputs["down_weights"][:4],
    )


@pytest.mark.parametrize(
    "argument, bad, error",
    [
        pytest.param("hidden_states", lambda a: a["hidden_states"][None], ValueError, id="hidden_3d"),
        pytest.param("topk_indices", lambda a: a["topk_indices"].double(), TypeError, id="float_indices"),
        pytest.param("topk_indices", lambda a: a["topk_indices"][:2], ValueError, id="indices_rows"),
        pytest.param("topk_weights", lambda a: a["topk_weights"][:, :1], ValueError, id="weights_columns"),
        pytest.param("topk_weights", lambda a: a["topk_weights"].to(torch.bfloat16), TypeError, id="weights_dtype"),
        pytest.param("local_up_weights", lambda a: a["local_up_weights"][:3], ValueError, id="up_count"),
        pytest.param(
            "local_down_weights", lambda a: a["local_down_weights"].transpose(1, 2), ValueError, id="down_transposed"
        ),
        pytest.param("local_gate_weights", lambda a: a["local_gate_weights"].float(), TypeError, id="gate_dtype"),
        pytest.param("local_gate_weights", lambda a: a["local_gate_weights"].tolist(), TypeError, id="not_tensor"),
    ],
)
def test_bad_arguments_raise_before_any_communication(argument, bad, error):
    arguments = _local_call_arguments()
    arguments[argument] = bad(arguments)
    with pytest.raises(error, match=f"^{argument}:"):
        moe_experts_parallel(**arguments, impl="reference", num_experts=8)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True, "2"])
def test_bad_chunks_raise_before_any_communication(chunks):
    with pytest.raises(ValueError, match="^chunks: expected a positive integer or None"):
        moe_experts_parallel(**_local_call_arguments(), impl="reference", num_experts=8, chunks=chunks)


def test_expert_chunks_cover_the_local_experts_in_order():
    from moe_lib.moe_experts.parallel import expert_chunks

    assert expert_chunks(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert expert_chunks(2, 4) == [range(0, 0), range(0, 1), range(1, 1), range(1, 2)]
    assert expert_chunks(0, 2) == [range(0, 0), range(0, 0)]
    for experts in range(9):
        for chunks in range(1, 6):
            pieces = expert_chunks(experts, chunks)
            assert [e for piece in pieces for e in piece] == list(range(experts))
            assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_bad_impl_raises_before_any_communication():
    with pytest.raises(ValueError, match="^impl:"):
        moe_experts_parallel(**_local_call_arguments(), impl="cuda", num_experts=8)
    with pytest.raises(TypeError, match="^impl:"):  # the Triton path takes no float64
        moe_experts_parallel(**_local_call_arguments(), impl="triton", num_experts=8)


def test_benchmark_entry_point_runs_two_ranks_on_cpu(tmp_path):
    command = [
        sys.executable,
        "-m",
        "moe_lib.bench.parallel",
        "--nproc",
        "2",
        "--small",
        "--device",
        "cpu",
        "--chunks",
        "1,2",
        "--out",
        str(tmp_path),
    ]
    # its own session, so that on a timeout the benchmark and the ranks it spawned are stopped together
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=JOIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the benchmark did not finish within {JOIN_TIMEOUT_S} s:\n{output}")
    assert process.returncode == 0, output
    for name in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert name in output

    for dtype in ("bfloat16", "float32"):
        [csv] = (tmp_path / "cpu").glob(f"*-moe_experts_parallel-{dtype}-small-2gpus.csv")
        frame = pd.read_csv(csv)
        assert list(frame["tokens_per_rank"]) == [16, 16, 64, 64] and list(frame["chunks"]) == [1, 2, 1, 2]
        assert (frame["status"] == "ok").all() and frame["correct"].all(), frame.to_string()
        assert ((frame["exchange_share"] > 0) & (frame["exchange_share"] < 1)).all()
        assert (frame["world_size"] == 2).all() and (frame["max_rel_error"] < 1e-2).all()
        assert (frame["total_ms"] > 0).all() and (frame["all_to_all_ms"] > 0).all() and (frame["expert_ms"] > 0).all()
        assert (frame["single_gpu_same_work_ms"] > 0).all()
        assert (frame["rows_sent_total"] == 2 * frame["tokens_per_rank"] * frame["top_k"]).all()

        document = json.loads(csv.with_suffix(".json").read_text())
        provenance = document["provenance"]
        for key in ("gpu_name", "driver_version", "torch", "world_size", "backend", "date_utc", "git_commit", "seed"):
            assert key in provenance, key
        assert provenance["world_size"] == 2 and provenance["backend"] == "gloo"
        assert provenance["environment"]["NCCL_NVLS_ENABLE"] == "0"
        assert len(document["cases"]) == 4 and len(document["cases"][0]["rows_received_by_rank"]) == 2
        # the last step's timeline per rank: with 2 chunks, two dispatches issued in the forward, each waited for
        timeline = document["cases"][1]["timelines_by_rank"][0]
        names = [entry["name"] for entry in timeline]
        assert document["cases"][1]["chunks"] == 2
        assert names.count("dispatch issued") == 2 and names.count("dispatch") == 2
        assert names.count("backward_combine issued") == 2 and names.count("expert_backward") == 2
        assert all(0 <= entry["start_ms"] <= entry["end_ms"] for entry in timeline)
