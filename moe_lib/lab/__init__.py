"""What the notebooks call, one module per notebook, so that the notebooks explain and show while the logic lives here.

    derivations.py    01, 02: float64 autograd of every forward tensor, the step log, routing loads
    results.py        03, 05: the benchmark's result files, the implementations' styles, per-case tables
    roofline.py       03: ridge points, cost per case, ridge crossings, measured points and their projection
    kernels.py        04: the kernels' launch plans as tables and diagrams, the designs measured on the GPU
    tutorial.py       04: teaching kernels from naive to fused, run under the interpreter; kernels' sources for the page
    benchmark.py      05: times, speed-ups, scores, correctness and per-case figures of the result files
    official_runs.py         05: graph replay against NVIDIA's harness, per workload: the host's share of a call
    training_step.py  05: the layers' forward and forward + backward runs, and what saved activations trade
    targets.py        05: the project's targets (``data/problems/<name>/lab.json``) judged on the result files
    parallel.py       06: the exchanges, the cost model and the measured multi-GPU runs of expert parallelism
    parallel_live.py  06: the expert-parallel layer run live on gloo processes, against one process
    in_a_model.py     07: a transformers MoE model trained with its own experts and moe_lib's, eager and compiled
"""
