"""Expert-parallel benchmark of :func:`moe_lib.distributed.moe_experts_parallel` on several GPUs.

Launch either way, from the repository root::

    torchrun --nproc_per_node=2 -m moe_lib.bench.parallel
    python -m moe_lib.bench.parallel --nproc 2                       # spawns its own ranks
    python -m moe_lib.bench.parallel --nproc 2 --small --device cpu  # gloo, tiny shapes (the test)
    python -m moe_lib.bench.parallel --nproc 4 --chunks 1,2,4        # overlapped exchanges, per chunk count

NCCL on CUDA (rank r on GPU r, or on LOCAL_RANK under torchrun), gloo on CPU. Before the process
group starts, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are
set (unless already set), checked (any other value stops the run) and printed.

Shapes: P2's (H 4096, I 2048, E 256, K 8), bf16 (the ``moe_experts_backward_bf16`` inputs: fp32
routing weights) and fp32 (``moe_experts_backward``), W·T_r global tokens for T_r in 2048, 8192 and
32768 tokens per rank; ``--small``: H 32, I 16, E 8, K 2 and T_r in 16, 64. Per case, every rank
draws the same global inputs from ``--seed``, keeps its T_r tokens and its experts
``expert_partition(E, W)[rank]``, and:

1. times forward + backward of the parallel layer, ``--warmup`` runs then ``--reps`` timed runs,
   each after a barrier: CUDA events around the whole step and around each phase (the all-to-all
   exchanges, the local expert forward and backward; "other" is the rest: the row gathers, the
   sums over each token's K rows and the host read of the counts). Each rank takes the median of
   each metric; the CSV reports the largest of those medians over the ranks. With ``--chunks`` each
   case runs once per chunk count (the layer's ``chunks``): an exchange's time is then what the compute
   stream waited for it, the part the overlap did not hide; ``exchange_share`` is that over the step.
2. times the same per-rank work on one GPU with no communication: ``moe_lib.moe_experts`` with the
   rank's E/W experts on the rows the rank receives (one expert per row), forward + backward.
3. checks correctness: rank 0 runs the single-GPU layer ``moe_lib.moe_experts`` on the global
   inputs; every rank sends its output and gradients to rank 0, one tensor at a time, and the
   relative Frobenius error ‖parallel − single‖/‖single‖ of each is reported. Correct when every
   error is below :data:`CORRECT_REL_ERROR` of the dtype.
A case whose estimated memory does not fit the GPUs' free memory is skipped with a message (all
ranks agree); when only rank 0's single-GPU reference does not fit, the case is timed and its
correctness marked skipped.

Outputs, written by rank 0 under ``<out>/<gpu key>/`` (``H200``, ..., ``cpu``):
``<YYYY-MM-DD>-moe_experts_parallel-<dtype>[-small]-<W>gpus.csv`` (one row per token count, columns
:data:`CSV_COLUMNS`) and a ``.json`` beside it with the provenance (GPU, driver, torch, world size,
backend, date, git commit from the environment's GIT_COMMIT or else ``git rev-parse``, environment) and
per case the rows each rank sent and received, each rank's phase medians and each rank's timeline of its
last step (phases and the marks of each exchange's issue, ms from the step's start).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import tempfile
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from .. import problems
from ..dispatch import IMPLS
from ..moe_experts import moe_experts
from ..moe_experts.inputs import ROUTINGS
from ..moe_experts.parallel import (
    ALL_TO_ALL_PHASES,
    ExpertParallelStats,
    PhaseTimer,
    expert_partition,
    moe_experts_parallel,
)
from .checks import error_sums, relative_error
from .cli import DTYPE_ALIASES, non_negative, positive, problems_by_dtype, resolve_device, token_list
from .provenance import gpu_key, run_context
from .results import DEFAULT_OUT, result_paths, result_stem, write_run

REQUIRED_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROBLEM = "moe_experts_parallel"
OP = "moe_experts_backward"  # the op whose layer is sharded
# the problems of that op by the dtype of their inputs: "bfloat16" -> moe_experts_backward_bf16, "float32" -> P2
PROBLEM_OF_DTYPE = {dtype: problem.name for dtype, problem in problems_by_dtype(OP).items()}
FULL_AXES = {name: value for name, value in problems.load(OP).sizes(0).items() if name != "num_tokens"}
SMALL_AXES = dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
FULL_TOKENS = [2048, 8192, 32768]
SMALL_TOKENS = [16, 64]
CORRECT_REL_ERROR = {"bfloat16": 3e-2, "float32": 1e-3}
MEMORY_HEADROOM = 0.9  # use at most this fraction of the free memory
OUTPUT_NAMES = ("output", *problems.load(OP).output_names)  # the layer's output, then the op's gradients
TOKEN_OUTPUTS = 3  # the first three are per token (output, grad_hidden_states, grad_topk_weights), the rest per expert
TIME_COLUMNS = ("total_ms", "all_to_all_ms", "expert_ms", "expert_forward_ms", "expert_backward_ms", "other_ms")
CSV_COLUMNS = [
    "problem",
    "dtype",
    "world_size",
    "tokens_per_rank",
    "global_tokens",
    "hidden_size",
    "intermediate_size",
    "num_experts",
    "top_k",
    "routing",
    "impl",
    "chunks",
    *TIME_COLUMNS,
    "exchange_share",
    "single_gpu_same_work_ms",
    "rows_sent_total",
    "rows_remote_total",
    "max_rows_received",
    *(f"rel_error_{name}" for name in OUTPUT_NAMES),
    "max_rel_error",
    "correct",
    "status",
    "warmup",
    "reps",
    "backend",
    "device",
    "gpu",
    "small",
]


# ---------------------------------------------------------------------------------------------
# environment and command line


def set_required_environment() -> dict[str, str]:
    """Sets each variable of :data:`REQUIRED_ENVIRONMENT` unless already set, then checks the values
    (NVLink multicast stays off); returns them."""
    for name, value in REQUIRED_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    wrong = {name: os.environ[name] for name, value in REQUIRED_ENVIRONMENT.items() if os.environ[name] != value}
    if wrong:
        raise SystemExit(f"environment: {wrong} is set, but this benchmark needs {REQUIRED_ENVIRONMENT}")
    return {name: os.environ[name] for name in REQUIRED_ENVIRONMENT}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lib.bench.parallel",
        description="Check and time the expert-parallel MoE layer (forward + backward) on W ranks; "
        "launch under torchrun, or give --nproc to spawn the ranks.",
    )
    parser.add_argument("--nproc", type=positive, help="spawn this many ranks (default: torchrun's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available (NCCL), else cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (H 32, I 16, E 8, K 2; 16 and 64 tokens)")
    parser.add_argument("--tokens", type=token_list, help="tokens per rank, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    parser.add_argument("--routing", default="uniform", choices=ROUTINGS)
    parser.add_argument(
        "--impl",
        default="auto",
        choices=IMPLS,
        help="the local expert backward (auto: triton on CUDA, the reference on CPU)",
    )
    parser.add_argument(
        "--chunks",
        type=chunk_list,
        default=[1],
        help="chunk counts of the overlapped exchange, comma-separated; one run each (default 1)",
    )
    parser.add_argument("--seed", type=non_negative, default=0)
    parser.add_argument("--warmup", type=non_negative, help="untimed runs per case (default 2; CPU 1)")
    parser.add_argument("--reps", type=positive, help="timed runs per case (default 5; CPU 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    return parser


def chunk_list(text: str) -> list[int]:
    """Comma-separated positive chunk counts, e.g. "1,2,4"."""
    counts = token_list(text)
    if 0 in counts:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return counts


def resolve_shared_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options this benchmark shares with ``moe_lib.bench.rank_work``, resolved in place: ``--device`` (its
    type), ``--dtypes`` (a checked list), and the defaults of ``--tokens``, ``--warmup`` and ``--reps``."""
    args.device = resolve_device(parser, args.device).type
    args.dtypes = [DTYPE_ALIASES.get(name.strip(), name.strip()) for name in args.dtypes.split(",") if name.strip()]
    for name in args.dtypes:
        if name not in PROBLEM_OF_DTYPE:
            parser.error(f"--dtypes: expected {' or '.join(sorted(PROBLEM_OF_DTYPE))}, got {name!r}")
    if args.tokens is None:
        args.tokens = SMALL_TOKENS if args.small else FULL_TOKENS
    if args.warmup is None:
        args.warmup = 2 if args.device == "cuda" else 1
    if args.reps is None:
        args.reps = 5 if args.device == "cuda" else 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_shared_args(parser, args)
    launched_by_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc is not None and launched_by_torchrun:
        parser.error("--nproc: not with torchrun (it starts the ranks itself)")
    if args.nproc is None and not launched_by_torchrun:
        parser.error("--nproc: give the number of ranks to spawn, or launch under torchrun --nproc_per_node=N")
    if args.nproc is not None and args.device == "cuda" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc: {args.nproc} ranks but {torch.cuda.device_count()} GPU(s)")
    return args


# ---------------------------------------------------------------------------------------------
# one case on every rank


def memory_needed(tokens_per_rank: int, world_size: int, element_bytes: int, axes: dict) -> dict[str, int]:
    """Rough peak bytes on one GPU: ``run`` for drawing the inputs and the parallel layer's forward +
    backward on every rank, ``reference`` for rank 0's single-GPU layer on the global inputs (with its
    shard and the shard's gradients still held)."""
    H, I, E, K = (axes[name] for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"))
    expert_bytes = 3 * I * H * element_bytes
    local_experts = -(-E // world_size)
    rows = tokens_per_rank * K  # rows sent, and about as many received
    global_tokens = world_size * tokens_per_rank
    inputs = E * expert_bytes + 2 * global_tokens * H * element_bytes
    shard = 2 * local_experts * expert_bytes  # weights and their gradients
    # ~10 row buffers of [rows, H] (dispatch, expert outputs, combine, their gradients), an fp32 sum,
    # the Triton backward's fp32 dX workspace and its three bf16 [rows, I] workspaces
    layer = rows * H * (10 * element_bytes + 8) + 3 * rows * I * 2
    single = 2 * E * expert_bytes + global_tokens * K * (H * (4 + 2 * element_bytes) + 3 * I * 2)
    return dict(
        run=max(inputs + local_experts * expert_bytes, shard + layer),
        reference=shard + single + 3 * global_tokens * H * element_bytes,
    )


def global_inputs(dtype_name: str, tokens_per_rank: int, world_size: int, args, device) -> dict:
    """The global inputs of a case, identical on every rank (one seed)."""
    axes = SMALL_AXES if args.small else FULL_AXES
    return problems.make_inputs(
        PROBLEM_OF_DTYPE[dtype_name],
        world_size * tokens_per_rank,
        seed=args.seed,
        device=device,
        dtype=getattr(torch, dtype_name),
        routing=args.routing,
        **axes,
    )


def local_share(inputs: dict, rank: int, world_size: int, tokens_per_rank: int) -> dict:
    """This rank's leaves: its tokens (with routing and output gradient), its expert shard, and the
    rows it will receive (for the single-GPU timing of the same work)."""
    tokens = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    experts = expert_partition(inputs["gate_weights"].shape[0], world_size)[rank]
    ids = inputs["topk_indices"]
    token_ids, slot_ids = ((ids >= experts.start) & (ids < experts.stop)).nonzero(as_tuple=True)
    return dict(
        hidden_states=inputs["hidden_states"][tokens].clone().requires_grad_(),
        topk_indices=inputs["topk_indices"][tokens].clone(),
        topk_weights=inputs["topk_weights"][tokens].clone().requires_grad_(),
        grad_output=inputs["grad_output"][tokens].clone(),
        shard=[
            inputs[name][experts.start : experts.stop].clone().requires_grad_()
            for name in ("gate_weights", "up_weights", "down_weights")
        ],
        received_rows=dict(
            hidden_states=inputs["hidden_states"][token_ids].requires_grad_(),
            topk_indices=(ids[token_ids, slot_ids] - experts.start)[:, None],
            topk_weights=inputs["topk_weights"][token_ids, slot_ids][:, None].requires_grad_(),
            grad_output=inputs["grad_output"][token_ids],
        ),
    )


def parallel_step(share: dict, num_experts: int, impl: str, stats: ExpertParallelStats, chunks: int = 1) -> tuple:
    """Forward + backward of the parallel layer on this rank: (output, *gradients)."""
    leaves = [share["hidden_states"], share["topk_weights"], *share["shard"]]
    output = moe_experts_parallel(
        share["hidden_states"],
        share["topk_indices"],
        share["topk_weights"],
        *share["shard"],
        impl=impl,
        num_experts=num_experts,
        stats=stats,
        chunks=chunks,
    )
    return (output.detach(), *torch.autograd.grad(output, leaves, share["grad_output"]))


def phase_times(totals: dict[str, float]) -> dict[str, float]:
    """The reported times (ms) of one step from the timer's per-phase totals."""
    all_to_all = sum(totals.get(name, 0.0) for name in ALL_TO_ALL_PHASES)
    forward, backward = totals.get("expert_forward", 0.0), totals.get("expert_backward", 0.0)
    return dict(
        total_ms=totals["total"],
        all_to_all_ms=all_to_all,
        expert_ms=forward + backward,
        expert_forward_ms=forward,
        expert_backward_ms=backward,
        other_ms=totals["total"] - all_to_all - forward - backward,
    )


def time_parallel(share: dict, num_experts: int, args, device, chunks: int = 1):
    """Median phase times of this rank over ``args.reps`` steps after ``args.warmup``; the last step's
    outputs, stats and timeline (:meth:`PhaseTimer.timeline_ms`)."""
    timer = PhaseTimer(device)
    stats = ExpertParallelStats(timer=timer)
    samples, outputs = [], None
    for step in range(args.warmup + args.reps):
        outputs = None  # frees the previous step's gradients before the next step allocates its own
        dist.barrier()
        timer.reset()
        with timer.phase("total"):
            outputs = parallel_step(share, num_experts, args.impl, stats, chunks)
        times = phase_times(timer.totals_ms())
        if step >= args.warmup:
            samples.append(times)
    medians = {name: statistics.median(sample[name] for sample in samples) for name in TIME_COLUMNS}
    return medians, outputs, stats, timer.timeline_ms()


def same_work_step(rows: dict, shard: list, impl: str) -> tuple:
    """``moe_lib.moe_experts`` forward + backward with a rank's expert ``shard`` on the ``rows`` it receives
    (``local_share``'s ``received_rows``): (output, *gradients)."""
    leaves = [rows["hidden_states"], rows["topk_weights"], *shard]
    output = moe_experts(
        rows["hidden_states"], rows["topk_indices"], rows["topk_weights"], *shard, impl=impl, validate=False
    )
    return (output.detach(), *torch.autograd.grad(output, leaves, rows["grad_output"]))


def time_same_work_on_one_gpu(share: dict, args, device) -> float:
    """Median ms of :func:`same_work_step` with this rank's experts on the rows it receives, on its GPU alone
    (no communication)."""
    if share["shard"][0].shape[0] == 0:
        return math.nan
    timer, samples = PhaseTimer(device), []
    for step in range(args.warmup + args.reps):
        timer.reset()
        with timer.phase("total"):
            outputs = same_work_step(share["received_rows"], share["shard"], args.impl)
        if step >= args.warmup:
            samples.append(timer.totals_ms()["total"])
        del outputs
    return statistics.median(samples)


def single_gpu_outputs(dtype_name: str, tokens_per_rank: int, world_size: int, args, device) -> tuple:
    """Rank 0: (output, *gradients) of the single-GPU layer ``moe_lib.moe_experts`` on the global inputs."""
    inputs = global_inputs(dtype_name, tokens_per_rank, world_size, args, device)
    names = ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
    leaves = [inputs[name].requires_grad_() for name in names]
    output = moe_experts(
        inputs["hidden_states"],
        inputs["topk_indices"],
        inputs["topk_weights"],
        inputs["gate_weights"],
        inputs["up_weights"],
        inputs["down_weights"],
        impl=args.impl,
    )
    return (output.detach(), *torch.autograd.grad(output, leaves, inputs["grad_output"]))


def gather_errors(
    outputs: tuple, reference: tuple | None, tokens_per_rank: int, partition: list[range], rank: int, world_size: int
) -> dict[str, float]:
    """Every rank sends its outputs to rank 0 one tensor at a time; rank 0 returns each output's
    relative error against ``reference`` (token slices or expert blocks of the global tensors)."""
    errors = {}
    for index, name in enumerate(OUTPUT_NAMES):
        on_tokens = index < TOKEN_OUTPUTS
        error = norm = 0.0
        for source in range(world_size):
            if rank == 0:
                if source == 0:
                    piece = outputs[index]
                else:
                    rows = tokens_per_rank if on_tokens else len(partition[source])
                    piece = reference[index].new_empty((rows, *reference[index].shape[1:]))
                    dist.recv(piece, src=source)
                block = (
                    slice(source * tokens_per_rank, (source + 1) * tokens_per_rank)
                    if on_tokens
                    else slice(partition[source].start, partition[source].stop)
                )
                sums = error_sums(piece, reference[index][block])
                error, norm = error + sums["diff_sq"], norm + sums["ref_sq"]
            elif rank == source:
                dist.send(outputs[index].contiguous(), dst=0)
        errors[name] = relative_error(error, norm)
    return errors


def all_ranks_agree(flag: bool, device) -> bool:
    """True when ``flag`` is true on every rank."""
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def run_case(
    dtype_name: str, tokens_per_rank: int, args, device, rank: int, world_size: int, log, chunks: int = 1
) -> dict:
    """One (dtype, tokens per rank, chunks) case on every rank; rank 0's return value is the full result."""
    axes = SMALL_AXES if args.small else FULL_AXES
    row = dict(
        problem=PROBLEM,
        dtype=dtype_name,
        world_size=world_size,
        tokens_per_rank=tokens_per_rank,
        global_tokens=world_size * tokens_per_rank,
        **axes,
        routing=args.routing,
        impl=args.impl,
        chunks=chunks,
        warmup=args.warmup,
        reps=args.reps,
    )
    detail = {}
    needed = memory_needed(tokens_per_rank, world_size, getattr(torch, dtype_name).itemsize, axes)
    free = math.inf
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0] * MEMORY_HEADROOM
    if not all_ranks_agree(needed["run"] <= free, device):
        row["status"] = f"skipped: needs ~{needed['run'] / 2**30:.0f} GiB per GPU, less is free"
        log(f"{dtype_name} {tokens_per_rank} tokens/rank: {row['status']}")
        return dict(row=row, detail=detail)

    inputs = global_inputs(dtype_name, tokens_per_rank, world_size, args, device)
    share = local_share(inputs, rank, world_size, tokens_per_rank)
    num_experts = inputs["gate_weights"].shape[0]
    del inputs

    medians, outputs, stats, timeline = time_parallel(share, num_experts, args, device, chunks)
    same_work_ms = time_same_work_on_one_gpu(share, args, device)
    del share["received_rows"]
    gathered = [None] * world_size
    dist.all_gather_object(
        gathered,
        dict(
            times=medians,
            rows_sent=stats.rows_sent,
            timeline=timeline,
            rows_received=stats.rows_received,
            same_work_ms=same_work_ms,
        ),
    )
    row.update({name: max(g["times"][name] for g in gathered) for name in TIME_COLUMNS})
    row["exchange_share"] = row["all_to_all_ms"] / row["total_ms"] if row["total_ms"] > 0 else math.nan
    row["single_gpu_same_work_ms"] = max(g["same_work_ms"] for g in gathered)
    sent = [g["rows_sent"] for g in gathered]
    row["rows_sent_total"] = sum(map(sum, sent))
    row["rows_remote_total"] = row["rows_sent_total"] - sum(sent[r][r] for r in range(world_size))
    row["max_rows_received"] = max(sum(g["rows_received"]) for g in gathered)
    detail.update(
        rows_sent_by_rank=sent,
        rows_received_by_rank=[g["rows_received"] for g in gathered],
        times_by_rank=[g["times"] for g in gathered],
        timelines_by_rank=[g["timeline"] for g in gathered],
        single_gpu_same_work_ms_by_rank=[g["same_work_ms"] for g in gathered],
    )

    del share
    reference, reference_failure = None, None
    if rank == 0 and needed["reference"] > free:
        reference_failure = f"needs ~{needed['reference'] / 2**30:.0f} GiB on rank 0, less is free"
    elif rank == 0:
        try:
            reference = single_gpu_outputs(dtype_name, tokens_per_rank, world_size, args, device)
        except torch.cuda.OutOfMemoryError:
            reference_failure = "out of memory on rank 0"
    if all_ranks_agree(rank != 0 or reference is not None, device):
        partition = expert_partition(num_experts, world_size)
        errors = gather_errors(outputs, reference, tokens_per_rank, partition, rank, world_size)
        row.update({f"rel_error_{name}": value for name, value in errors.items()})
        row["max_rel_error"] = max(errors.values())
        row["correct"] = row["max_rel_error"] < CORRECT_REL_ERROR[dtype_name]
        row["status"] = "ok"
    else:
        row["status"] = f"timed; correctness skipped: {reference_failure}"
        log(f"{dtype_name} {tokens_per_rank} tokens/rank: {row['status']}")
    return dict(row=row, detail=detail)


# ---------------------------------------------------------------------------------------------
# results


def provenance(args, device, world_size: int, backend: str, environment: dict, started) -> dict:
    """Where, when and how the run was made."""
    return dict(
        run_context(device, started, "moe_lib.bench.parallel"),
        nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        world_size=world_size,
        backend=backend,
        seed=args.seed,
        routing=args.routing,
        impl=args.impl,
        warmup=args.warmup,
        reps=args.reps,
        small=args.small,
        allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        correct_rel_error=CORRECT_REL_ERROR,
        environment=dict(environment, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES")),
    )


def format_table(frame: pd.DataFrame, title: str) -> str:
    shown = frame[
        [
            "tokens_per_rank",
            "chunks",
            *TIME_COLUMNS,
            "exchange_share",
            "single_gpu_same_work_ms",
            "max_rel_error",
            "status",
        ]
    ]
    return title + "\n" + shown.to_string(index=False, float_format=lambda value: f"{value:.4g}")


def write_results(
    results: list[dict], dtype_name: str, args, device, world_size, backend, environment, started
) -> tuple[Path, Path]:
    """Rank 0: the CSV and JSON of one dtype's cases (and their table, printed); returns their paths."""
    stem = result_stem(
        PROBLEM, dtype_name, small=args.small, tag=f"{world_size}gpus", date=started.strftime("%Y-%m-%d")
    )
    csv_path, json_path = result_paths(args.out, device, stem)
    frame = pd.DataFrame(
        [dict(r["row"], backend=backend, device=device.type, gpu=gpu_key(device), small=args.small) for r in results]
    ).reindex(columns=CSV_COLUMNS)
    axes = SMALL_AXES if args.small else FULL_AXES
    document = dict(
        problem=PROBLEM,
        dtype=dtype_name,
        axes=axes,
        tokens_per_rank=args.tokens,
        provenance=provenance(args, device, world_size, backend, environment, started),
        chunks=args.chunks,
        cases=[
            dict(
                tokens_per_rank=r["row"]["tokens_per_rank"],
                chunks=r["row"]["chunks"],
                status=r["row"]["status"],
                **r["detail"],
            )
            for r in results
        ],
    )
    write_run(csv_path, frame, json_path, document)
    title = f"{PROBLEM} · {dtype_name} · {gpu_key(device)} × {world_size} · ms, largest median over ranks"
    print(format_table(frame, title), flush=True)
    print(f"wrote {csv_path}\n      {json_path}", flush=True)
    return csv_path, json_path


def run_rank(rank: int, local_rank: int, world_size: int, init_method: str, args) -> None:
    """Everything one rank does: join the group, run every case, rank 0 writes the results."""
    environment = set_required_environment()
    started = datetime.datetime.now(datetime.timezone.utc)
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, device_id=device)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    log("environment: " + " ".join(f"{name}={value}" for name, value in environment.items()))
    log(
        f"{world_size} ranks, {backend} on {device.type}; tokens per rank {args.tokens}; chunks {args.chunks}; "
        f"dtypes {args.dtypes}"
    )
    try:
        for dtype_name in args.dtypes:
            results = [
                run_case(dtype_name, tokens, args, device, rank, world_size, log, chunks)
                for tokens in args.tokens
                for chunks in args.chunks
            ]
            if rank == 0:
                write_results(results, dtype_name, args, device, world_size, backend, environment, started)
        dist.barrier()  # no rank tears its connections down while a peer still uses them (gloo aborts)
    finally:
        dist.destroy_process_group()


def _spawned_rank(index: int, world_size: int, init_method: str, args) -> None:
    run_rank(index, index, world_size, init_method, args)


def main(argv=None) -> None:
    args = parse_args(argv)
    set_required_environment()
    if args.nproc is None:  # under torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run_rank(rank, int(os.environ.get("LOCAL_RANK", rank)), world_size, "env://", args)
        return
    with tempfile.TemporaryDirectory(prefix="moe_experts_parallel-") as folder:
        init_method = f"file://{Path(folder) / 'init'}"
        torch.multiprocessing.spawn(_spawned_rank, args=(args.nproc, init_method, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
