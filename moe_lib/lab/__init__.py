"""What the notebooks call, one module per notebook, so that the notebooks explain and show while the logic lives here.

derivations.py       01, 02: float64 autograd of every forward tensor, the step log, the two draws, routing loads
results.py           03, 05: the benchmark's result files, the implementations' styles, per-case tables
roofline.py          03: ridge points, cost per case, ridge crossings, measured points and their projection,
                     the granularity and sparsity of an expert's GEMM
regimes.py           03, 04: P1's design choice read from the chooser: the registry's designs, the design by
                     token count and its map, the Gluon forms, the bands, and the check of any page's regime
                     statements
kernels.py           04: the kernels' launch plans as tables and diagrams, the split-K demonstration
tutorial.py          04: teaching kernels from naive to fused, run under the interpreter; kernels' sources for the
                     page
ladder.py            04: each rung's bytes, FLOPs, predicted and measured time
ring.py              04: the Gluon kernels' mbarrier ring, simulated on the CPU, and its diagram
ledger.py            04: the floors of P1's arithmetic and of P2's decomposition, step by step
engine.py            04: P2's grouped engine: its pipeline drawn, its tile schedules, its twins run on the CPU, the
                     layer's launches recorded
measured_designs.py  04's history in notes/: the designs measured on the GPU, from the committed tuning runs
traces.py            04's history in notes/: where a P1 call's time goes, from the committed traces
schedules.py         04's history in notes/: models of how P1's tiles fill the SMs
tuning_index.py      04, notes/: the committed tuning runs as data (data/results/H200/tuning/index.json): each
                     run's files, script, notes, the labels of its candidates, what its "default" ran
benchmark.py         05: times, speed-ups, scores, correctness and per-case figures of the result files
official_runs.py     05: graph replay against NVIDIA's harness, per workload: the host's share of a call
training_step.py     05: the layers' forward and forward + backward runs, and what saved activations trade
engine_runs.py       05: the grouped engine's committed runs beside their peers, with each file's commit
sonicmoe.py          05: our layer beside SonicMoE's, and our backward's kernels by ncu
models.py            05: the model suite's runs and speed-ups
targets.py           05: the project's targets (``data/problems/<name>/lab.json``) judged on the committed files
parallel.py          06: the exchanges, the cost model and the measured multi-GPU runs of expert parallelism
parallel_live.py     06: the expert-parallel layer run live on gloo processes, against one process
in_a_model.py        07: a transformers MoE model trained with its own experts and moe_lib's, eager and compiled
design_log.py        08: the lab notes' index (``notes/index.md``) as tables
exercises.py         01–04, 06: the lessons' exercises' checkers
"""
