"""Notebook 06: the expert-parallel layer (:func:`moe_lib.distributed.moe_experts_parallel`) run live on the CPU.

:func:`run_live` spawns a small gloo group (one process per rank, ``file://`` rendezvous in a temporary
folder, bounded in time) that runs the layer forward and backward on float64 inputs drawn from one seed;
:func:`single_process` runs ``moe_lib.moe_experts`` on the same global inputs in one process, and
:func:`gather` puts the ranks' pieces back together to compare.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

import moe_lib

from .. import problems
from ..bench.parallel import OUTPUT_NAMES
from ..moe_experts.parallel import ExpertParallelStats, expert_partition, moe_experts_parallel
from .derivations import relative_error

LIVE_TIMEOUT_S = 120  # the live run's ranks are stopped after this long
GRAD_NAMES = OUTPUT_NAMES[1:]  # the gradients of hidden_states, topk_weights and the three expert weights
TOKEN_OUTPUTS = OUTPUT_NAMES[:3]  # per token: stay on the token's rank
EXPERT_OUTPUTS = OUTPUT_NAMES[3:]  # per expert: land on the expert's rank


@dataclass(frozen=True)
class LiveCase:
    """A small expert-parallel case: every rank brings ``tokens_per_rank`` tokens; float64 throughout."""

    world_size: int
    tokens_per_rank: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    routing: str = "uniform"
    seed: int = 0
    chunks: int = 1  # the layer's chunks: the exchanges in that many overlapped pieces

    @property
    def partition(self) -> list[range]:
        return expert_partition(self.num_experts, self.world_size)

    def tokens_of(self, rank: int) -> slice:
        """Rank r brings the r-th block of ``tokens_per_rank`` global tokens."""
        return slice(rank * self.tokens_per_rank, (rank + 1) * self.tokens_per_rank)


def live_inputs(case: LiveCase) -> dict:
    """The global inputs of ``case`` (float64), identical in every process that draws them."""
    return problems.make_inputs(
        "moe_experts_backward",
        case.world_size * case.tokens_per_rank,
        seed=case.seed,
        dtype=torch.float64,
        routing=case.routing,
        hidden_size=case.hidden_size,
        intermediate_size=case.intermediate_size,
        num_experts=case.num_experts,
        top_k=case.top_k,
    )


def expected_rows_sent(topk_indices: torch.Tensor, num_experts: int, world_size: int) -> list[list[int]]:
    """[W][W]: the (token, slot) rows rank r sends to rank s (its own rank included), when rank r holds the
    r-th block of tokens and rank s the experts ``expert_partition(num_experts, W)[s]``."""
    tokens_per_rank = topk_indices.shape[0] // world_size
    table = []
    for rank in range(world_size):
        experts = topk_indices[rank * tokens_per_rank : (rank + 1) * tokens_per_rank].reshape(-1)
        table.append(
            [
                int(((experts >= block.start) & (experts < block.stop)).sum())
                for block in expert_partition(num_experts, world_size)
            ]
        )
    return table


def _live_rank(rank: int, case: LiveCase, init_file: str, folder: str) -> None:
    """One rank of the live run: its forward and backward of the parallel layer, saved to ``folder``."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=case.world_size)
        try:
            inputs = live_inputs(case)
            tokens, experts = case.tokens_of(rank), case.partition[rank]
            hidden_states = inputs["hidden_states"][tokens].clone().requires_grad_()
            topk_weights = inputs["topk_weights"][tokens].clone().requires_grad_()
            shard = [
                inputs[name][experts.start : experts.stop].clone().requires_grad_()
                for name in ("gate_weights", "up_weights", "down_weights")
            ]
            stats = ExpertParallelStats()
            output = moe_experts_parallel(
                hidden_states,
                inputs["topk_indices"][tokens],
                topk_weights,
                *shard,
                impl="reference",
                num_experts=case.num_experts,
                stats=stats,
                chunks=case.chunks,
            )
            grads = torch.autograd.grad(output, [hidden_states, topk_weights, *shard], inputs["grad_output"][tokens])
            results = dict(
                output=output.detach(),
                **dict(zip(GRAD_NAMES, grads, strict=True)),
                rows_sent=stats.rows_sent,
                rows_received=stats.rows_received,
            )
            torch.save(results, Path(folder) / f"rank{rank}.pt")
            dist.barrier()  # no rank tears its connections down while a peer may still be reading from them
        finally:
            dist.destroy_process_group()
    except BaseException:
        (Path(folder) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_live(case: LiveCase, timeout_s: float = LIVE_TIMEOUT_S) -> list[dict]:
    """Runs ``case`` on ``case.world_size`` spawned gloo processes; each rank's results, in rank order.

    Every process is joined, or killed once ``timeout_s`` has passed; the temporary folder (rendezvous file
    and results) is removed. Raises RuntimeError with the failing rank's traceback if a rank fails or hangs.
    """
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moe-ep-live-") as folder:
        init_file = str(Path(folder) / "init")
        processes = [
            context.Process(target=_live_rank, args=(rank, case, init_file, folder), daemon=True)
            for rank in range(case.world_size)
        ]
        try:
            for process in processes:
                process.start()
            deadline = time.monotonic() + timeout_s
            for process in processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        errors = {
            rank: (Path(folder) / f"rank{rank}.error").read_text()
            for rank in range(case.world_size)
            if (Path(folder) / f"rank{rank}.error").is_file()
        }
        if errors or hung or any(process.exitcode != 0 for process in processes):
            stopped = f"ranks {hung} stopped after {timeout_s} s; " if hung else ""
            detail = "".join(f"\nrank {rank}:\n{text}" for rank, text in errors.items())
            raise RuntimeError(f"the live run failed ({stopped}exit codes {[p.exitcode for p in processes]}){detail}")
        return [torch.load(Path(folder) / f"rank{rank}.pt") for rank in range(case.world_size)]


def single_process(case: LiveCase) -> dict[str, torch.Tensor]:
    """``moe_lib.moe_experts`` forward and backward on the global inputs, in this process: output and gradients."""
    inputs = live_inputs(case)
    leaves = [
        inputs[name].clone().requires_grad_()
        for name in ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
    ]
    x, w, gate, up, down = leaves
    output = moe_lib.moe_experts(x, inputs["topk_indices"], w, gate, up, down, impl="reference")
    grads = torch.autograd.grad(output, leaves, inputs["grad_output"])
    return dict(output=output.detach(), **dict(zip(GRAD_NAMES, grads, strict=True)))


def gather(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The ranks' outputs put together in rank order: the token outputs (ranks hold consecutive token blocks)
    and the expert-weight gradients (ranks hold consecutive expert blocks) as the global tensors."""
    return {name: torch.cat([results[name] for results in per_rank]) for name in OUTPUT_NAMES}


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖got − want‖ / ‖want‖ per output, in float64."""
    return {name: relative_error(got[name], want[name]) for name in OUTPUT_NAMES}


def equal_outputs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Per output: whether the two runs' tensors are equal bit for bit."""
    return {name: torch.equal(got[name], want[name]) for name in OUTPUT_NAMES}


def partition_table(cases) -> pd.DataFrame:
    """``expert_partition(E, W)`` for each (E, W) of ``cases``: the experts each rank holds."""
    rows = []
    for num_experts, world_size in cases:
        blocks = expert_partition(num_experts, world_size)
        rows.append(
            {
                "E": num_experts,
                "W": world_size,
                "experts per rank": " · ".join(str(len(block)) for block in blocks),
                "blocks (global ids)": " · ".join(f"{b.start}–{b.stop - 1}" if len(b) else "none" for b in blocks),
            }
        )
    return pd.DataFrame(rows).set_index(["E", "W"])
