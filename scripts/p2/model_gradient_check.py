"""One training step's gradients of notebook 07's model on a GPU: the model's own experts and moe_lib's, in bf16,
each against the same model in fp32 (its "eager" experts, TF32 off, from the same bf16-rounded weights).

    PYTHONPATH=. python scripts/p2/model_gradient_check.py [--hidden-size 1024] [--intermediate-size 512]
        [--experts 64] [--top-k 8] [--layers 4] [--batch-size 8] [--sequence-length 1024] [--seed 0]

Prints the three losses and, per parameter, its gradient's norm and the relative error of each bf16 gradient
against fp32 (and of the two bf16 gradients against each other): if moe_lib's gradients were off, their error
would stand out from the model's own. The defaults are notebook 07's GPU sizes. Needs CUDA and transformers.
"""

from __future__ import annotations

import argparse
import copy

import torch

from moe_lib.lab import in_a_model as lab


def gradients(model, ids) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (
        ("hidden-size", 1024),
        ("intermediate-size", 512),
        ("experts", 64),
        ("top-k", 8),
        ("layers", 4),
        ("batch-size", 8),
        ("sequence-length", 1024),
        ("seed", 0),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: moe_lib's bf16 kernels are compared on a GPU")
    device = torch.device("cuda")
    vocab = 64
    config = lab.model_config(
        vocab_size=vocab,
        sequence_length=args.sequence_length,
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.intermediate_size,
        num_experts=args.experts,
        top_k=args.top_k,
        num_layers=args.layers,
    )
    chain = lab.bigram_chain(vocab, seed=args.seed)
    ids = lab.token_batches(
        chain, steps=1, batch_size=args.batch_size, sequence_length=args.sequence_length, seed=args.seed
    )[0].to(device)
    own = lab.make_model(config, "grouped_mm", seed=args.seed, device=device, dtype=torch.bfloat16)
    ours = lab.make_model(config, "moe_lib", seed=args.seed, device=device, dtype=torch.bfloat16)
    exact = copy.deepcopy(own).float()
    exact.set_experts_implementation("eager")
    torch.backends.cuda.matmul.allow_tf32 = False
    loss_exact, g_exact = gradients(exact, ids)
    loss_own, g_own = gradients(own, ids)
    loss_ours, g_ours = gradients(ours, ids)
    print(f"loss: fp32 {loss_exact:.5f}, own experts {loss_own:.5f}, moe_lib {loss_ours:.5f}")
    print(f"{'parameter':55s} {'|grad|':>9s} {'own':>9s} {'moe_lib':>9s} {'between':>9s}")
    for name, g in g_exact.items():
        print(
            f"{name:55s} {g.norm().item():9.3e} {relative(g_own[name], g):9.2e} {relative(g_ours[name], g):9.2e} "
            f"{relative(g_ours[name], g_own[name]):9.2e}"
        )


if __name__ == "__main__":
    main()
