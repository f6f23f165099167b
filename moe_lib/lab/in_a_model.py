"""Notebook 07: moe_lib in a model. A tiny Hugging Face MoE transformer trained with its own experts and with
moe_lib's, eager and compiled, on the same synthetic data from the same initial weights.

- :func:`model_config` builds a small Qwen3-MoE configuration (every layer sparse), :func:`make_model` the model
  with one experts implementation ("grouped_mm": transformers' default, or "moe_lib" by
  :func:`moe_lib.integrations.hf.apply_moe_lib`).
- :func:`token_batches`: sequences drawn from a fixed random bigram chain, so the loss has somewhere to go (from
  ln V towards the chain's entropy rate, :func:`chain_entropy`).
- :func:`train` runs one variant (experts implementation × eager or ``torch.compile``) for a number of AdamW
  steps: the loss of every step, the time of every step (the first includes compilation), the tensors saved for
  the backward by one step and, on CUDA, the peak memory allocated.
- :func:`variant_table`, :func:`loss_figure`, :func:`loss_agreement` show and compare the runs.

Imports transformers (the ``dev`` or ``hf`` extra).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import pandas as pd
import torch

STYLE = {"grouped_mm": dict(color="#888888"), "batched_mm": dict(color="#888888"), "moe_lib": dict(color="#1f77b4")}


def own_experts(compiled: bool, dtype: torch.dtype) -> str:
    """The model's own experts implementation to compare with: transformers' default, "grouped_mm", except compiled
    in a dtype other than bf16, where its grouped_mm falls back to a custom op whose backward does not compile (a
    guard on a data-dependent size): there "batched_mm", which transformers itself compiles for generation."""
    return "grouped_mm" if not compiled or dtype == torch.bfloat16 else "batched_mm"


def variants(dtype: torch.dtype, *, compiled: bool = True) -> list[tuple[str, bool]]:
    """(experts implementation, compiled) of each run: the model's own and moe_lib, eager then compiled."""
    modes = (False, True) if compiled else (False,)
    return [(experts, mode) for mode in modes for experts in (own_experts(mode, dtype), "moe_lib")]


def variant_name(experts: str, compiled: bool) -> str:
    return f"{experts} ({'compiled' if compiled else 'eager'})"


def resolve_device(device: str) -> torch.device:
    """ "auto": CUDA where there is a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_config(
    *,
    vocab_size: int,
    hidden_size: int,
    moe_intermediate_size: int,
    num_experts: int,
    top_k: int,
    num_layers: int,
    sequence_length: int,
):
    """A Qwen3-MoE configuration with every layer's MLP sparse (4 attention heads of hidden_size / 4)."""
    from transformers import Qwen3MoeConfig

    heads = 4
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden_size // heads,
        max_position_embeddings=sequence_length,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    )


def make_model(config, experts: str, *, seed: int, device, dtype):
    """The model with ``seed``'s initial weights and ``experts``' implementation ("grouped_mm" or "moe_lib")."""
    from transformers import Qwen3MoeForCausalLM

    from ..integrations.hf import apply_moe_lib

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(copy.deepcopy(config)).to(device=device, dtype=dtype)
    if experts == "moe_lib":
        return apply_moe_lib(model)
    model.set_experts_implementation(experts)
    return model


def bigram_chain(vocab_size: int, *, seed: int, choices: int = 4) -> torch.Tensor:
    """[V, V] transition probabilities: each token is followed by one of ``choices`` tokens, with random weights."""
    generator = torch.Generator().manual_seed(seed)
    chain = torch.zeros(vocab_size, vocab_size)
    for token in range(vocab_size):
        following = torch.randperm(vocab_size, generator=generator)[:choices]
        chain[token, following] = torch.rand(choices, generator=generator) + 0.1
    return chain / chain.sum(dim=1, keepdim=True)


def chain_entropy(chain: torch.Tensor) -> float:
    """The chain's entropy rate in nats (under its stationary distribution): the loss a perfect model reaches."""
    stationary = torch.full((chain.shape[0],), 1.0 / chain.shape[0], dtype=torch.float64)
    for _ in range(200):
        stationary = stationary @ chain.double()
    per_token = -(chain.double() * chain.double().clamp_min(1e-30).log()).sum(dim=1)
    return float(stationary @ per_token)


def token_batches(chain: torch.Tensor, *, steps: int, batch_size: int, sequence_length: int, seed: int) -> torch.Tensor:
    """[steps, batch_size, sequence_length] token ids walked along ``chain`` (the same for every variant)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(steps * batch_size, sequence_length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, chain.shape[0], (steps * batch_size,), generator=generator)
    for position in range(1, sequence_length):
        tokens[:, position] = torch.multinomial(chain[tokens[:, position - 1]], 1, generator=generator)[:, 0]
    return tokens.view(steps, batch_size, sequence_length)


@dataclass
class Run:
    """One variant's training run."""

    experts: str
    compiled: bool
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    saved_bytes: int = 0  # the tensors one step saves for its backward (activations; parameters not counted)
    peak_bytes: int | None = None  # CUDA only: the peak memory allocated over the run

    @property
    def name(self) -> str:
        return variant_name(self.experts, self.compiled)

    def steady_step_ms(self, warmup: int) -> float:
        """The median step time after the first ``warmup`` steps (compilation and warm-up left out)."""
        return statistics.median(self.step_seconds[warmup:] or self.step_seconds) * 1e3


def saved_for_backward_bytes(loss_of, model) -> int:
    """Bytes of the distinct tensors autograd saves for the backward of ``loss_of()`` (parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of()
    loss.backward()
    return sum(storages.values())


def train(
    config,
    experts: str,
    compiled: bool,
    batches: torch.Tensor,
    *,
    seed: int,
    device,
    dtype,
    learning_rate: float,
    compile_backend: str = "inductor",
    compile_mode: str = "default",
) -> Run:
    """Trains a fresh model (``seed``'s weights) on ``batches`` with AdamW; returns the :class:`Run`.
    ``compile_mode``: torch.compile's mode for the compiled variants ("reduce-overhead": the loss's forward and
    backward replayed as CUDA graphs on a GPU, which takes the host's launch time out of the step; inductor only)."""
    device = torch.device(device)
    model = make_model(config, experts, seed=seed, device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)

    def loss_of(input_ids):
        return model(input_ids=input_ids, labels=input_ids).loss

    if compiled:
        mode = None if compile_mode == "default" else compile_mode
        step_loss = torch.compile(loss_of, fullgraph=True, backend=compile_backend, mode=mode)
    else:
        step_loss = loss_of
    run = Run(experts, compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for input_ids in batches.to(device):
        start = time.perf_counter()
        loss = step_loss(input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        run.step_seconds.append(time.perf_counter() - start)
        run.losses.append(loss.item())
    if device.type == "cuda":
        run.peak_bytes = torch.cuda.max_memory_allocated(device)
    run.saved_bytes = saved_for_backward_bytes(lambda: step_loss(batches[0].to(device)), model)
    optimizer.zero_grad(set_to_none=True)
    return run


def variant_table(runs: list[Run], warmup: int) -> pd.DataFrame:
    """Per variant: first and last loss, the first step (with compilation), the steady step time, the speed
    against the model's own experts run the same way, and memory."""
    reference = {run.compiled: run for run in runs if run.experts != "moe_lib"}
    rows = []
    for run in runs:
        own = reference.get(run.compiled)
        steady = run.steady_step_ms(warmup)
        rows.append(
            {
                "variant": run.name,
                "first loss": run.losses[0],
                "last loss": run.losses[-1],
                "first step (s)": run.step_seconds[0],
                "step (ms)": steady,
                "vs own experts": own.steady_step_ms(warmup) / steady if own else math.nan,
                "saved for backward (MiB)": run.saved_bytes / 2**20,
                "peak allocated (MiB)": math.nan if run.peak_bytes is None else run.peak_bytes / 2**20,
            }
        )
    return pd.DataFrame(rows).set_index("variant")


def loss_agreement(runs: list[Run], window: int = 20) -> pd.DataFrame:
    """Each moe_lib run against the model's own experts run the same way: the largest difference of the loss
    curves, and the noise it is measured against (the std of the own run's loss over its last ``window`` steps)."""
    own = {run.compiled: run for run in runs if run.experts != "moe_lib"}
    rows = []
    for run in runs:
        if run.experts != "moe_lib" or run.compiled not in own:
            continue
        theirs = own[run.compiled].losses
        difference = max(abs(a - b) for a, b in zip(run.losses, theirs, strict=True))
        noise = statistics.pstdev(theirs[-window:])
        rows.append(
            dict(
                variant=run.name,
                against=own[run.compiled].name,
                max_loss_difference=difference,
                loss_noise=noise,
                within_noise=difference <= noise,
            )
        )
    return pd.DataFrame(rows).set_index("variant")


def loss_figure(runs: list[Run], entropy: float):
    """The loss curves side by side: eager on the left, compiled on the right; the chain's entropy dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, compiled in zip(axes, (False, True), strict=True):
        for run in runs:
            if run.compiled == compiled:
                style = STYLE.get(run.experts, {})
                ax.plot(
                    run.losses,
                    label=run.name,
                    linewidth=2.2 if run.experts == "moe_lib" else 4,
                    alpha=0.9 if run.experts == "moe_lib" else 0.45,
                    **style,
                )
        ax.axhline(entropy, color="black", linestyle="--", linewidth=1, label="the chain's entropy rate")
        ax.set_title("compiled (torch.compile, fullgraph)" if compiled else "eager")
        ax.set_xlabel("step")
        ax.legend(frameon=False)
    axes[0].set_ylabel("loss (nats per token)")
    fig.tight_layout()
    return fig
