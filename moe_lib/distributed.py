"""Expert parallelism for P2's layer on ``torch.distributed`` (the code lives in :mod:`moe_lib.moe_experts.parallel`).

``moe_experts_parallel(hidden_states, topk_indices, topk_weights, local_gate_weights, local_up_weights,
local_down_weights, num_experts=E)`` shards the experts over the ranks of a group (``expert_partition``
gives each rank's block); rows travel to their expert's rank and back with ``all_to_all_single``, with
``chunks=C`` in C chunks (the rows of C groups of each rank's experts) whose exchanges overlap the
neighbouring chunks' expert compute. It is registered with ``torch.library`` (forward and backward ops), so that
``torch.compile(fullgraph=True)`` takes it whole.
"""

from .moe_experts.parallel import ExpertParallelStats, PhaseTimer, expert_chunks, expert_partition, moe_experts_parallel

__all__ = ["ExpertParallelStats", "PhaseTimer", "expert_chunks", "expert_partition", "moe_experts_parallel"]
