"""Notebook 07's training step timed several times per variant: the model's own experts against moe_lib's, in
blocks of steps that take turns, so that a drift of the machine falls on every variant alike.

    PYTHONPATH=. python scripts/p2/model_step_time.py [--rounds 4] [--steps 30] [--compile-mode default]
        [--eager] [--out DIR]

Each variant's model is built once (notebook 07's GPU sizes, its seed, bf16, AdamW at its learning rate) and
compiled once (``torch.compile(fullgraph=True)``; ``--eager`` adds the eager variants); a first block of
``--steps`` steps warms each up (compilation), then ``--rounds`` blocks of each take turns. The table gives each
variant's median step over its blocks' medians, their spread (min-max) and the own experts' median over this
variant's (above 1: faster than the model's own experts run the same way). ``--out DIR`` writes
``step-times.json`` with every step time and the run's provenance. Needs transformers (and CUDA but with
``--device cpu``, which runs small sizes in fp32: a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from moe_lib.bench.provenance import run_context
from moe_lib.lab import in_a_model as lab

GPU_SIZES = dict(hidden_size=1024, moe_intermediate_size=512, num_experts=64, top_k=8, num_layers=4)
GPU_BATCH = dict(batch_size=8, sequence_length=1024)
CPU_SIZES = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, num_layers=2)
CPU_BATCH = dict(batch_size=2, sequence_length=32)
VOCAB_SIZE, SEED, LEARNING_RATE = 64, 0, 1e-3  # notebook 07's


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead"))
    parser.add_argument("--eager", action="store_true", help="time the eager variants too")
    parser.add_argument("--device", default="cuda", help='"cpu" runs it small, to try the script without a GPU')
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive count, got {getattr(args, name)}")
    return args


class Variant:
    """One variant's model, optimizer and (compiled) loss, trained block by block."""

    def __init__(self, config, experts: str, compiled: bool, compile_mode: str, device, dtype):
        self.name = lab.variant_name(experts, compiled)
        self.model = lab.make_model(config, experts, seed=SEED, device=device, dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
        self.loss = self._loss
        if compiled:
            mode = None if compile_mode == "default" else compile_mode
            self.loss = torch.compile(self._loss, fullgraph=True, mode=mode)

    def _loss(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def block(self, batches: torch.Tensor) -> list[float]:
        """Trains one step per batch; each step's seconds (synchronised, as notebook 07 times them)."""
        seconds = []
        for input_ids in batches:
            start = time.perf_counter()
            loss = self.loss(input_ids)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return seconds


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("model_step_time: --device cuda, but there is no CUDA GPU")
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    sizes, batch = (GPU_SIZES, GPU_BATCH) if on_gpu else (CPU_SIZES, CPU_BATCH)
    started = datetime.now(timezone.utc)
    config = lab.model_config(vocab_size=VOCAB_SIZE, sequence_length=batch["sequence_length"], **sizes)
    chain = lab.bigram_chain(VOCAB_SIZE, seed=SEED)
    batches = lab.token_batches(chain, steps=args.steps, seed=SEED, **batch).to(device)
    variants = [
        Variant(config, experts, compiled, args.compile_mode, device, dtype)
        for experts, compiled in lab.variants(dtype)
        if compiled or args.eager
    ]
    warmup = {v.name: v.block(batches) for v in variants}  # compilation and warm-up: not counted
    steps: dict[str, list[list[float]]] = {v.name: [] for v in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            steps[variant.name].append([s * 1e3 for s in variant.block(batches)])
            print(f"round {round_index}: {variant.name:24s} {statistics.median(steps[variant.name][-1]):7.2f} ms")
    medians = {name: [statistics.median(block) for block in blocks] for name, blocks in steps.items()}
    print(f"\n{'variant':24s} {'median ms':>9s} {'min':>7s} {'max':>7s} {'own / this':>10s}")
    for variant in variants:
        compiled = variant.name.endswith("(compiled)")
        own = medians[lab.variant_name(lab.own_experts(compiled, dtype), compiled)]
        mine = medians[variant.name]
        ratio = statistics.median(own) / statistics.median(mine)
        print(f"{variant.name:24s} {statistics.median(mine):9.2f} {min(mine):7.2f} {max(mine):7.2f} {ratio:10.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = dict(
            context=run_context(device, started, "scripts.p2.model_step_time"),
            sizes=sizes | batch,
            arguments={k: str(v) for k, v in vars(args).items()},
            warmup_first_step_s={name: seconds[0] for name, seconds in warmup.items()},
            block_median_ms=medians,
            step_ms=steps,
        )
        (args.out / "step-times.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
