"""moe_lib in Hugging Face models (transformers 5, its experts interface): tiny random Qwen3-MoE, Mixtral and
DeepSeek-V3 models built here (nothing downloaded) give the logits and every parameter's gradient of their own
experts implementation: in float32 to float32 rounding, in bfloat16 within twice the error their own bf16 experts
make against the float32 model (QuACK's rule)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import rel_error

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("moe_lib.integrations.hf")

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
MODELS = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            SMALL,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            SMALL, intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            SMALL,
            intermediate_size=48,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
}


def tiny_model(name: str, seed: int, dtype=torch.float32):
    """A random model of that family with its own experts (the "eager" loop over experts)."""
    model_class, config_class, sizes = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**sizes)
    model = getattr(transformers, model_class)(config).to(dtype)
    model.set_experts_implementation("eager")
    return model


def step(model, input_ids) -> tuple[torch.Tensor, dict]:
    """Logits (float32) and every parameter's gradient of the language-model loss."""
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return out.logits.detach().float(), grads


@pytest.mark.parametrize("name", MODELS)
def test_float32_logits_and_every_gradient_match_the_model_own_experts(name, seed):
    model = tiny_model(name, seed)
    ours = hf.apply_moe_lib(copy.deepcopy(model))
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    want_logits, want_grads = step(model, input_ids)
    got_logits, got_grads = step(ours, input_ids)
    assert rel_error(got_logits, want_logits) <= 1e-5
    experts = [n for n in want_grads if ".experts." in n]
    assert experts and all(want_grads[n].abs().sum() > 0 for n in experts)  # the experts do get gradients
    for parameter, want in want_grads.items():
        assert rel_error(got_grads[parameter], want) <= 1e-4, parameter


def recorded_routing(model) -> tuple[list, list]:
    """(a list that each router's (logits, its chosen experts sorted) will be appended to in a forward, the hooks)."""
    seen = []

    def record(module, inputs, output):  # the routers return (logits, weights, chosen experts)
        seen.append((output[0].detach().float(), output[-1].detach().sort(dim=-1).values))

    hooks = [m.register_forward_hook(record) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    return seen, hooks


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_within_twice_the_model_own_bf16_error(name, seed):
    """Logits and every gradient within twice the model's own bf16 error against fp32. Where a later layer's router
    chooses other experts in the two bf16 runs (a near-tie of its logits: the two forwards differ by bf16 roundings),
    every gradient differs discontinuously and only the logits are compared, once the tie is checked to be one."""
    exact = tiny_model(name, seed)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    exact_logits, exact_grads = step(exact, input_ids)
    theirs = copy.deepcopy(exact).to(torch.bfloat16)
    ours = hf.apply_moe_lib(copy.deepcopy(theirs))
    (their_routing, hooks), (our_routing, more) = recorded_routing(theirs), recorded_routing(ours)
    their_logits, their_grads = step(theirs, input_ids)
    our_logits, our_grads = step(ours, input_ids)
    for hook in hooks + more:
        hook.remove()
    floor = 2**-8  # one bf16 rounding: what a parameter whose error is near zero in both may still differ by
    assert rel_error(our_logits, exact_logits) <= 2 * rel_error(their_logits, exact_logits) + floor
    top_k = exact.config.num_experts_per_tok
    flipped = False
    for (logits, chosen), (_, ours_chosen) in zip(their_routing, our_routing, strict=True):
        tokens = (chosen != ours_chosen).any(dim=-1)
        if tokens.any():
            ranked = logits[tokens].sort(dim=-1, descending=True).values
            margin = ranked[:, top_k - 1] - ranked[:, top_k]
            assert (margin <= 2**-6 * ranked.abs().amax(dim=-1)).all(), margin  # within two bf16 steps: a tie
            flipped = True
    if flipped:
        return
    for parameter, exact_grad in exact_grads.items():
        theirs_error = rel_error(their_grads[parameter], exact_grad)
        assert rel_error(our_grads[parameter], exact_grad) <= 2 * theirs_error + floor, parameter


def test_the_model_selects_moe_lib_by_name_and_switches_back(seed, monkeypatch):
    model = tiny_model("qwen3_moe", seed)
    hf.apply_moe_lib(model, impl="reference")
    assert model.config._experts_implementation == "moe_lib"
    calls = []
    real = hf.moe_experts_gate_up
    monkeypatch.setattr(hf, "moe_experts_gate_up", lambda *a, **k: calls.append(k) or real(*a, **k))
    input_ids = torch.randint(0, VOCAB, (1, 6))
    model(input_ids=input_ids)
    assert len(calls) == model.config.num_hidden_layers
    assert calls[0] == dict(impl="reference", validate=False, save_activations=False)
    model.set_experts_implementation("eager")
    model(input_ids=input_ids)
    assert len(calls) == model.config.num_hidden_layers


def test_from_config_by_name_after_register(seed):
    """After register(), "moe_lib" is a name transformers accepts like its own."""
    hf.register()
    model_class, config_class, sizes = MODELS["mixtral"]
    config = getattr(transformers, config_class)(**sizes, experts_implementation="moe_lib")
    model = getattr(transformers, model_class)(config)
    assert model.config._experts_implementation == "moe_lib"


def test_models_and_experts_it_cannot_run_are_refused_by_name(seed):
    with pytest.raises(TypeError, match="^model: expected a transformers PreTrainedModel, got Linear"):
        hf.apply_moe_lib(torch.nn.Linear(2, 2))
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SMALL, intermediate_size=16, num_key_value_heads=2)
    )
    with pytest.raises(ValueError, match="^model: LlamaForCausalLM has no expert modules"):
        hf.apply_moe_lib(dense)
    model = tiny_model("qwen3_moe", seed)
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(
        ValueError,
        match=r"^model: model.layers.1.mlp.experts \(Qwen3MoeExperts\): its experts have "
        "biases",
    ):
        hf.apply_moe_lib(model)
    model.model.layers[1].mlp.experts.has_bias = False
    model.model.layers[0].mlp.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="its activation is GELU, not SiLU"):
        hf.apply_moe_lib(model)
    with pytest.raises(ValueError, match="^impl: expected one of"):
        hf.apply_moe_lib(model, impl="fast")


def test_the_model_compiles_whole_with_moe_lib(seed):
    """The model's own graph breaks nowhere around moe_lib's experts (its "eager" experts loop breaks it)."""
    model = hf.apply_moe_lib(tiny_model("qwen3_moe", seed))
    input_ids = torch.randint(0, VOCAB, (2, 8))
    explained = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(input_ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend="aot_eager", fullgraph=True)
    model.zero_grad()
    compiled(input_ids).backward()
    compiled_grad = model.model.layers[0].mlp.experts.gate_up_proj.grad.clone()
    model.zero_grad()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert rel_error(compiled_grad, model.model.layers[0].mlp.experts.gate_up_proj.grad) <= 1e-5
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_bfloat16_on_the_triton_path(name, seed):
    exact = tiny_model(name, seed).to("cuda")
    input_ids = torch.randint(0, VOCAB, (4, 64), device="cuda")
    exact_logits, exact_grads = step(exact, input_ids)
    theirs = copy.deepcopy(exact).to(torch.bfloat16)
    theirs.set_experts_implementation("grouped_mm")
    ours = hf.apply_moe_lib(copy.deepcopy(theirs))  # impl="auto": Triton on CUDA
    their_logits, their_grads = step(theirs, input_ids)
    our_logits, our_grads = step(ours, input_ids)
    floor = 2**-8
    assert rel_error(our_logits, exact_logits) <= 2 * rel_error(their_logits, exact_logits) + floor
    for parameter, exact_grad in exact_grads.items():
        assert (
            rel_error(our_grads[parameter], exact_grad) <= 2 * rel_error(their_grads[parameter], exact_grad) + floor
        ), parameter


@pytest.mark.gpu
def test_gpu_the_model_compiles_whole_with_moe_lib(seed):
    model = hf.apply_moe_lib(tiny_model("qwen3_moe", seed).to("cuda", torch.bfloat16))
    input_ids = torch.randint(0, VOCAB, (4, 64), device="cuda")
    explained = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(input_ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, fullgraph=True)
    eager_loss = model(input_ids=input_ids, labels=input_ids).loss
    assert abs(compiled(input_ids).item() - eager_loss.item()) <= 2e-2 * abs(eager_loss.item())
