"""The GPU scripts under scripts/ name a bad argument before any work (here, on a machine without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "p1/p1_host_gap.py --configs default,nope": "--configs: unknown candidate(s) ['nope']",
    "p1/p1_kernel_times.py --configs library_gemms_fast,nope": "--configs: unknown candidate(s) ['nope']",
    "p1/p1_call_timeline.py --configs default,nope": "--configs: unknown candidate(s) ['nope']",
    "p1/p1_few_tokens_trace.py --candidates a_reg,nope": "--candidates: unknown candidate(s) ['nope']",
    "p1/p1_few_tokens_trace.py --flush warm": "--flush: expected a comma list of dirty, clean, none",
    "p1/launch_floor_probe.py --reps 0": "--reps and --programs: expected positive integers",
    "parallel/slot_sum_bench.py --dtypes bfloat16,int8": (
        "--dtypes: expected a comma list of bfloat16, float32, float16"
    ),
    "p1/p1_tune.py --configs gluon_tall_dwd2,nope": "--configs: unknown candidate(s) ['nope']",
    "p1/p1_profile.py --config nope": "argument --config: invalid choice: 'nope'",
    "p1/p1_program_trace.py --config nope": "argument --config: invalid choice: 'nope'",
    "p1/p1_pass_bench.py --variants blocks16x128_w4,nope": "--variants: unknown ['nope']",
    "p1/p1_fp8_lo_probe.py --tokens 8192,x": "--tokens: expected a comma list of positive integers",
    "p2/gemm_probe.py --configs coop_m128n256k64_s3,nope": "--configs: unknown name(s) ['nope']",
    "p2/grouped_probe.py --shapes p2_t8192_gate_up,nope": "--shapes: unknown name(s) ['nope']",
    "p2/fp32_precision_emulation.py --expert 8": "--expert: expected 0 to 7 for Mixtral-8x7B, got 8",
    "p2/fp32_precision_emulation.py --sweep --sweep-tokens 512,x": "--sweep-tokens: expected a comma list of positive",
    "p2/sonicmoe_warmup.py --models Qwen3-30B-A3B,GPT-5": "--models: unknown model 'GPT-5'",
    "p2/sonicmoe_warmup.py --models unaligned-1000x300": "--models: unaligned-1000x300 has no experts",
    "p2/sonicmoe_warmup.py --stacks-every 0": "--stacks-every must be positive",
    "p2/engine_profile.py --model unaligned-1000x300": "--model: unaligned-1000x300 has no experts",
    "p2/engine_profile.py --model Qwen3-30B-A3B,DeepSeek-V2-Lite": "--model: one model",
    "p2/engine_profile.py --written --no-x-s": "--written: not with --in-parts or --no-x-s",
    "p2/engine_ab.py tiles --cases Qwen3-30B-A3B:x": "--cases: expected MODEL:TOKENS",
    "p2/engine_ab.py loads --cases GPT-5:8192": "--cases: expected MODEL:TOKENS",
    "p2/engine_ab.py loads --rounds 0": "--rounds: expected at least 1, got 0",
    "p2/engine_ab.py kloop --variants dswiglu_ring_coop_m128n256k64_s4,nope": "--variants: unknown ['nope']",
    "host_time.py --cases model,nope": "--cases: expected a comma list of tiny, model, bench, bench_bf16",
    "host_time.py --layers moe_experts,nope": "--layers: expected a comma list of moe_experts, swiglu_expert",
}


@pytest.mark.parametrize("command", list(CASES))
def test_bad_argument_is_named_before_any_work(command):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / command.split()[0]), *command.split()[1:]],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0
    assert CASES[command] in done.stderr, done.stderr


def test_gpu_bench_defaults_name_what_the_scripts_know():
    """The candidates and configs scripts/gpu_bench.sh passes by default are still the scripts' own: a removed one
    would fail that run on the GPU, or time nothing."""
    import re
    import runpy

    from moe_lib.bench.tuning import P1_CANDIDATES, parse_fields, replace_fields
    from moe_lib.moe_experts.choose import launch_config

    text = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    p1 = [
        name
        for found in re.findall(r"\$\{P1_\w*CONFIGS:-([^}]*)\}", text) + re.findall(r"--configs (default,\S+)", text)
        for name in found.split(",")
        if name != "default"
    ]
    assert p1 and not set(p1) - set(P1_CANDIDATES)
    few = runpy.run_path(str(ROOT / "scripts" / "p1" / "p1_few_tokens_check.py"), run_name="defaults")
    (few_args,) = re.findall(r"\$\{P1_FEW_ARGS:-([^}]*)\}", text)
    candidates = [word for word in few_args.split() if not word.startswith("-") and not word[0].isdigit()]
    assert not set(candidates) - set(few["CANDIDATES"]) - set(few["VARIANTS"])
    (p2,) = re.findall(r"\$\{P2_TUNE_CONFIGS:-([^}]*)\}", text)
    for item in p2.split(";"):
        replace_fields(launch_config(2048 * 8, 256, input_bytes=2), parse_fields(item.partition(":")[2]))


def test_sonicmoe_warmup_compiles_at_the_models_expert_shapes():
    """--models gives each model's expert shape (H, I, E, K) in the order of moe_lib/bench/models.py; without it,
    P2's own shape."""
    import runpy

    from moe_lib.bench.models import MODEL_SHAPES

    warmup = runpy.run_path(str(ROOT / "scripts" / "p2" / "sonicmoe_warmup.py"), run_name="shapes")
    args = warmup["parse_args"](["--models", "DeepSeek-V2-Lite,Qwen3-30B-A3B", "--tokens", "8192,32768"])
    assert args.tokens == [8192, 32768]
    assert args.shapes == [
        ("Qwen3-30B-A3B", dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)),
        ("DeepSeek-V2-Lite", dict(hidden_size=2048, intermediate_size=1408, num_experts=64, top_k=6)),
    ]
    assert warmup["parse_args"]([]).shapes == [("moe_experts_backward_bf16", {})]
    every = [model.name for model in MODEL_SHAPES if model.num_experts is not None]
    assert [label for label, _ in warmup["warmup_shapes"](every)] == every


def test_sonicmoe_warmup_compiles_every_autotuning_config_before_timing_them():
    """Within compiles_in_parallel an autotuner's pruned configs are each compiled (run with warmup=True) while
    Triton's AsyncCompileMode is active, before the autotuner times them; outside it, pruning compiles nothing."""
    import runpy

    from triton.runtime._async_compile import active_mode
    from triton.runtime.autotuner import Autotuner, Config

    warmup = runpy.run_path(str(ROOT / "scripts" / "p2" / "sonicmoe_warmup.py"), run_name="threads")
    runs = []

    class Kernel:
        def run(self, **kwargs):
            runs.append((kwargs["x"], kwargs["BLOCK"], kwargs["warmup"], active_mode.get() is not None))

    tuner = Autotuner.__new__(Autotuner)
    tuner.fn, tuner.nargs = Kernel(), {"x": "x_ptr"}
    tuner.configs = [Config({"BLOCK": block}) for block in (32, 64, 128)]
    tuner.early_config_prune = tuner.perf_model = None
    with warmup["compiles_in_parallel"](4):
        assert tuner.prune_configs({"grid": (1,), "warmup": False}) == tuner.configs
    assert runs == [("x_ptr", block, True, True) for block in (32, 64, 128)]
    runs.clear()
    assert tuner.prune_configs({"grid": (1,), "warmup": False}) == tuner.configs and runs == []


def test_gpu_bench_layer_run_at_the_models_parses_as_the_benchmark_takes_it():
    """RUNS=p2_layer_models' defaults (models, token counts, layer peers) are accepted by the benchmark's command line:
    a renamed model or peer would fail that run on the GPU."""
    import re

    from moe_lib.bench import cli

    text = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    block = re.search(r'case " \$RUNS " in \*" p2_layer_models "\*\)\n(.*?)\nesac', text, re.S).group(1)
    defaults = dict(re.findall(r"\$\{(P2_LAYER_MODELS\w*):-([^}]*)\}", block))
    assert {"P2_LAYER_MODELS", "P2_LAYER_MODELS_TOKENS", "P2_LAYER_MODELS_IMPLS"} <= set(defaults)
    assert "--models --mode forward_backward --problem moe_experts_backward_bf16" in block
    argv = ["--device", "cpu", "--models", "--mode", "forward_backward", "--problem", "moe_experts_backward_bf16"]
    argv += ["--model", defaults["P2_LAYER_MODELS"], "--tokens", defaults["P2_LAYER_MODELS_TOKENS"]]
    args = cli.parse_args([*argv, "--impl", defaults["P2_LAYER_MODELS_IMPLS"]])
    assert args.model == ["Qwen3-30B-A3B", "DeepSeek-V2-Lite"] and args.tokens == [8192, 32768]
    assert args.model_impls == {"moe_experts_backward_bf16": defaults["P2_LAYER_MODELS_IMPLS"].split(",")}
    assert defaults["P2_LAYER_MODELS_IMPLS"] == "triton_engine_saved,triton_saved,grouped_mm,sonicmoe"
