"""The benchmark: check every implementation against the reference, then time it (``python -m moe_lib.bench``).

cli.py        the command line: options, their checks and defaults; main()
harness.py    the run loop: every case, every implementation, checked then timed
modes.py      what a run times: the problem's function, or a training step of its layer (--mode)
layer_step.py one training step of an op's layer (its leaves, the forward, the gradients)
models.py     the model suite: both problems at public MoE models' expert shapes (``--models``)
checks.py     errors against the high-precision reference, the element rule, the verdicts
timing.py     CUDA-graph, CUDA-event and wall-clock timers; L2 flush; NaN-poisoned allocator
official_timing.py  NVIDIA's method: eager calls on fresh input addresses, CUPTI span (official_ms)
official.py   NVIDIA's harness itself: any implementation exported as its solution, its CLI run
results.py    the CSV and JSON files: columns, names, summaries, score, text tables
provenance.py versions, commit, driver, GPU key: where a measurement was made
peers/        every implementation under its label, one module per op (registry.py: the registry)
parallel.py   the expert-parallel benchmark on several GPUs (``python -m moe_lib.bench.parallel``)
tuning.py     what the tuning scripts share (candidate configs, field overrides, cases)
sm90.py       Triton kernels compiled for sm_90 without a GPU, and their resource usage
"""
