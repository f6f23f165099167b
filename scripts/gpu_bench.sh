#!/usr/bin/env bash
# The benchmark runs behind the committed results in data/results/<gpu>/, on one CUDA GPU (an H200):
#   P1 swiglu_down_backward, its 16 cases, every available implementation (reference, torch_eager,
#      torch_compile, and triton where its kernel exists);
#   P2 moe_experts_backward (fp32 interface) at 2048 and 8192 tokens: reference, grouped_mm, liger;
#   P2 moe_experts_backward_bf16 at 2048, 8192 and 32768 tokens: reference, grouped_mm, liger;
#   (RUNS p1_layer, p2_layer) the layers' training step (--mode forward_backward): P1's swiglu_expert
#      against torch.compile over the 16 cases; P2's bf16 layer (ours recomputing and saving its
#      pre-activations, grouped_mm, sonicmoe) at 2048, 8192 and 32768 tokens;
#   (RUNS p2_layer_models) P2's bf16 layer, forward + backward, at the expert shapes of Qwen3-30B-A3B and
#      DeepSeek-V2-Lite, 8192 and 32768 tokens (python -m moe_lib.bench --models --mode forward_backward): the
#      implementations of P2_LAYER_MODELS_IMPLS (default triton_engine_saved,triton_saved,grouped_mm,sonicmoe),
#      P2_LAYER_MODELS and P2_LAYER_MODELS_TOKENS to change the models and token counts; SonicMoE compiles afresh
#      at each shape: first run scripts/p2/sonicmoe_warmup.py --models Qwen3-30B-A3B,DeepSeek-V2-Lite
#      --tokens 8192,32768 (it may run in the background while the other runs go);
#   (RUNS models_warm, models_p1, models_p2_bf16, models_p2_fp32) the model suite (python -m moe_lib.bench --models):
#      models_warm runs every P1 model once in parallel, one process a model, to fill Triton's and Inductor's
#      caches (the compilation of 8 shapes is most of the suite's time when done one after another); the others
#      time the models of MODELS (a comma list; default all) one problem at a time, files tagged MODELS_TAG;
#   (RUNS p1_official) NVIDIA's harness itself on P1's faithful path (python -m moe_lib.bench.official);
#   (RUNS p2_official) the same on P2's fp32 interface (P2_OFFICIAL_PROBLEM=moe_experts_backward_bf16 for
#      bf16), only the workloads of P2_OFFICIAL_TOKENS where set (a comma list: the suite in parts);
#   (RUNS p1_probe) where P1's time goes: scripts/p1/p1_few_tokens_trace.py, scripts/p1/p1_kernel_times.py,
#      scripts/p1/launch_floor_probe.py;
#   (RUNS p1_pass) the fast path's dSwiGLU pass alone, by [tokens, I] blocks of several shapes:
#      scripts/p1/p1_pass_bench.py;
#   (RUNS p1_chain) the chained launch (design 8) against the faithful path's defaults: p1_tune.py, p1_host_gap.py;
#   (RUNS p1_gluon1) the Gluon launches' forms (P1_GLUON1_CONFIGS: by default every form of designs.gluon.FORMS as
#      the faithful path takes it), both precisions by graph replay (p1_tune.py), and the faithful path's host gap
#      (p1_host_gap.py);
#   (RUNS p1_few, p1_lib, p2_tune) the tuning checks of the designs, each candidate checked against float64 before it
#      is timed: scripts/p1/p1_few_tokens_check.py (P1_FEW_ARGS), scripts/p1/p1_tune.py on the cuBLAS design
#      (P1_LIB_CONFIGS), scripts/p2/p2_tune.py (P2_TUNE_CASES, P2_TUNE_CONFIGS); their JSON goes to $OUT/tuning (or
#      /tmp/tuning).
#   The P1 candidates are those of moe_lib.bench.tuning.P1_CANDIDATES (configured designs of the registry).
# Every harness run also times each case the official way (eager, fresh addresses, CUPTI span) where
# cupti-python is importable: it is installed from .whl/sol/*.whl when those wheels are there (with
# pydantic for NVIDIA's harness, whose source must be in .sol-execbench/src for p1_official). SonicMoE
# comes from .whl/sonicmoe-site.tar.xz when it is there (unpacked to /tmp/sonicmoe-site); on a fresh
# machine run scripts/p2/sonicmoe_warmup.py first (minutes of compilation, see its docstring).
# Usage, from anywhere:  bash scripts/gpu_bench.sh
# Results go to data/results/<gpu>/, or to $OUT/results/<gpu>/ when OUT is set, with the full log in
# $OUT/bench.log; the tables are printed last. Liger-Kernel is installed from .whl/liger_kernel-*.whl
# when that wheel is there (pure Python; it needs only torch and triton). Override the implementation
# lists with P1_IMPLS, P2_FP32_IMPLS, P2_BF16_IMPLS (e.g. P2_FP32_IMPLS=reference,grouped_mm,liger,triton),
# the per-run time limits with P1_SECONDS, P2_FP32_SECONDS, P2_BF16_SECONDS, the interpreter with PYTHON;
# RUNS picks which of the three runs happen (default "p1 p2_fp32 p2_bf16"), P2_FP32_TOKENS the fp32 token
# counts ("suite" for the 16-case suite).
# Where the tree travels without .git, pass the commit for the provenance: GIT_COMMIT=<hash> bash ...
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
P1_IMPLS=${P1_IMPLS:-}  # empty: every implementation available for P1
P2_FP32_IMPLS=${P2_FP32_IMPLS:-reference,grouped_mm,liger}
P2_BF16_IMPLS=${P2_BF16_IMPLS:-reference,grouped_mm,liger}
RUNS=${RUNS:-p1 p2_fp32 p2_bf16}
P2_FP32_TOKENS=${P2_FP32_TOKENS:-2048,8192}
if [ "$P2_FP32_TOKENS" = suite ]; then P2_FP32_CASES=(--suite); else P2_FP32_CASES=(--tokens "$P2_FP32_TOKENS"); fi

if [ -n "${OUT:-}" ]; then
  RESULTS="$OUT/results"
  LOG="$OUT/bench.log"
else
  RESULTS=data/results
  LOG=$(mktemp /tmp/gpu_bench.XXXXXX.log)
fi
TABLES=$(mktemp /tmp/gpu_bench_tables.XXXXXX.txt)
mkdir -p "$RESULTS"
: >"$LOG"

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # a later process reuses the autotuning of an earlier one
# Liger's autotuning (32 configs for each of its GEMM kernels) takes minutes at P2's size: by default
# pin its one default config, the library's own switch; LIGER_FUSED_MOE_AUTOTUNE=1 to autotune.
export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}

install_wheels() {  # install_wheels TARGET WHAT-FAILS GLOB...: the wheels matched (if any) onto PYTHONPATH
  local target=$1 failing=$2
  shift 2
  [ -e "$1" ] || return 0
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
      "$@" >>"$LOG" 2>&1; then
    export PYTHONPATH="$target:$PYTHONPATH"
  else
    echo "installing $* failed: $failing" | tee -a "$LOG"
  fi
}
install_wheels /tmp/site "liger will be reported unavailable" .whl/liger_kernel-*.whl
install_wheels /tmp/solsite "no official timing, no NVIDIA harness" .whl/sol/*.whl
if [ -e .whl/sonicmoe-site.tar.xz ]; then
  if [ -d /tmp/sonicmoe-site ] || { mkdir -p /tmp/sonicmoe-site && tar -xJf .whl/sonicmoe-site.tar.xz -C /tmp/sonicmoe-site; }; then
    export PYTHONPATH="/tmp/sonicmoe-site:/tmp/sonicmoe-site/nvidia_cutlass_dsl/python_packages:$PYTHONPATH"
    export QUACK_CACHE_AUTOTUNING=1 TRITON_CACHE_AUTOTUNING=1
    # SonicMoE's compiled kernels and autotuning choices from an earlier machine (scripts/p2/sonicmoe_warmup.py --pack)
    [ -e .whl/quack-cache.tar.xz ] && tar -xJf .whl/quack-cache.tar.xz -C / >>"$LOG" 2>&1
  else
    echo "unpacking .whl/sonicmoe-site.tar.xz failed: sonicmoe will be reported unavailable" | tee -a "$LOG"
  fi
fi

{
  date -u +"started %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >>"$LOG" 2>&1

failures=0
bench() {  # bench NAME SECONDS ARGS...: one harness run, its table kept for the end
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "=== $name: $PYTHON -m moe_lib.bench $*" | tee -a "$LOG"
  timeout --kill-after=20 "$limit" "$PYTHON" -m moe_lib.bench --out "$RESULTS" "$@" 2>>"$LOG" | tee -a "$LOG" >>"$TABLES"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$LOG" "$TABLES"
  echo >>"$TABLES"
  [ "$status" -eq 0 ] || failures=$((failures + 1))
}

case " $RUNS " in *" p1 "*)
  bench "P1 swiglu_down_backward" "${P1_SECONDS:-240}" --problem swiglu_down_backward --suite ${P1_IMPLS:+--impl "$P1_IMPLS"}
esac
case " $RUNS " in *" p2_fp32 "*)
  bench "P2 moe_experts_backward fp32" "${P2_FP32_SECONDS:-150}" --problem moe_experts_backward \
    "${P2_FP32_CASES[@]}" --impl "$P2_FP32_IMPLS"
esac
case " $RUNS " in *" p2_bf16 "*)
  bench "P2 moe_experts_backward_bf16" "${P2_BF16_SECONDS:-150}" --problem moe_experts_backward_bf16 \
    --tokens 2048,8192,32768 --impl "$P2_BF16_IMPLS"
esac

case " $RUNS " in *" models_warm "*)
  # one process a P1 model, each case checked and replayed once, into a throwaway folder: the caches are what stays
  start=$SECONDS
  echo "=== model suite warm-up (P1, one process a model)" | tee -a "$LOG"
  for model in $("$PYTHON" -c 'from moe_lib.bench.models import MODEL_SHAPES; print(" ".join(m.name for m in MODEL_SHAPES))'); do
    timeout --kill-after=20 "${MODELS_WARM_SECONDS:-300}" "$PYTHON" -m moe_lib.bench --models \
      --problem swiglu_down_backward --model "$model" --warmup 0 --reps 1 --out /tmp/models-warm >>"$LOG.$model" 2>&1 &
  done
  wait
  cat "$LOG".* >>"$LOG" 2>/dev/null
  echo "=== model suite warm-up: done after $((SECONDS - start)) s" | tee -a "$LOG" "$TABLES"
esac
MODEL_ARGS=(--models ${MODELS:+--model "$MODELS"} ${MODELS_TAG:+--tag "$MODELS_TAG"})
case " $RUNS " in *" models_p1 "*)
  bench "Model suite, P1" "${MODELS_P1_SECONDS:-540}" "${MODEL_ARGS[@]}" --problem swiglu_down_backward
esac
case " $RUNS " in *" models_p2_bf16 "*)
  bench "Model suite, P2 bf16" "${MODELS_P2_SECONDS:-540}" "${MODEL_ARGS[@]}" --problem moe_experts_backward_bf16
esac
case " $RUNS " in *" models_p2_fp32 "*)
  bench "Model suite, P2 fp32" "${MODELS_P2_SECONDS:-540}" "${MODEL_ARGS[@]}" --problem moe_experts_backward
esac
case " $RUNS " in *" p1_layer "*)
  bench "P1 swiglu_expert layer, forward + backward" "${P1_LAYER_SECONDS:-240}" --problem swiglu_down_backward \
    --mode forward_backward --suite --impl "${P1_LAYER_IMPLS:-triton,torch_compile}"
esac
case " $RUNS " in *" p2_layer "*)
  bench "P2 moe_experts layer (bf16), forward + backward" "${P2_LAYER_SECONDS:-420}" --problem moe_experts_backward_bf16 \
    --mode forward_backward --tokens 2048,8192,32768 --impl "${P2_LAYER_IMPLS:-triton,triton_saved,grouped_mm,sonicmoe}"
esac
case " $RUNS " in *" p2_layer_models "*)
  bench "P2 moe_experts layer (bf16), forward + backward, at the models' shapes" "${P2_LAYER_MODELS_SECONDS:-540}" \
    --models --mode forward_backward --problem moe_experts_backward_bf16 \
    --model "${P2_LAYER_MODELS:-Qwen3-30B-A3B,DeepSeek-V2-Lite}" --tokens "${P2_LAYER_MODELS_TOKENS:-8192,32768}" \
    --impl "${P2_LAYER_MODELS_IMPLS:-triton_engine_saved,triton_saved,grouped_mm,sonicmoe}" \
    ${P2_LAYER_MODELS_TAG:+--tag "$P2_LAYER_MODELS_TAG"}
esac
case " $RUNS " in *" p1_official "*)
  start=$SECONDS
  echo "=== P1 in NVIDIA's harness: $PYTHON -m moe_lib.bench.official run --problem swiglu_down_backward --impl triton" | tee -a "$LOG"
  timeout --kill-after=20 "${P1_OFFICIAL_SECONDS:-300}" "$PYTHON" -m moe_lib.bench.official run \
    --problem swiglu_down_backward --impl "${P1_OFFICIAL_IMPL:-triton}" --results "$RESULTS" 2>>"$LOG" | tee -a "$LOG" >>"$TABLES"
  status=${PIPESTATUS[0]}
  echo "=== P1 in NVIDIA's harness: exit $status after $((SECONDS - start)) s" | tee -a "$LOG" "$TABLES"
  [ "$status" -eq 0 ] || failures=$((failures + 1))
esac

case " $RUNS " in *" p2_official "*)
  start=$SECONDS
  P2_OFFICIAL_PROBLEM=${P2_OFFICIAL_PROBLEM:-moe_experts_backward}
  echo "=== P2 in NVIDIA's harness: $P2_OFFICIAL_PROBLEM ${P2_OFFICIAL_TOKENS:+tokens $P2_OFFICIAL_TOKENS}" | tee -a "$LOG"
  timeout --kill-after=20 "${P2_OFFICIAL_SECONDS:-540}" "$PYTHON" -m moe_lib.bench.official run \
    --problem "$P2_OFFICIAL_PROBLEM" --impl triton ${P2_OFFICIAL_TOKENS:+--tokens "$P2_OFFICIAL_TOKENS"} \
    --results "$RESULTS" 2>>"$LOG" | tee -a "$LOG" >>"$TABLES"
  status=${PIPESTATUS[0]}
  echo "=== P2 in NVIDIA's harness: exit $status after $((SECONDS - start)) s" | tee -a "$LOG" "$TABLES"
  [ "$status" -eq 0 ] || failures=$((failures + 1))
esac

TUNING=${OUT:-/tmp}/tuning
check() {  # check NAME SECONDS SCRIPT ARGS...: one tuning script, its printed table kept for the end
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  mkdir -p "$TUNING"
  echo "=== $name: $PYTHON $*" | tee -a "$LOG"
  OUT="$TUNING" timeout --kill-after=20 "$limit" "$PYTHON" "$@" 2>>"$LOG" | tee -a "$LOG" >>"$TABLES"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$LOG" "$TABLES"
  echo >>"$TABLES"
  [ "$status" -eq 0 ] || failures=$((failures + 1))
}

case " $RUNS " in *" p1_chain "*)
  # the two launches chained into one (chained.py) against the faithful path's default designs, by graph replay
  # and in NVIDIA's method
  mkdir -p "$TUNING/p1_chain"
  check "P1 chained launch, graph replay" "${P1_CHAIN_SECONDS:-240}" scripts/p1/p1_tune.py --precision faithful \
    --out "$TUNING/p1_chain" --tokens "${P1_CHAIN_TOKENS:-64,128,512,1087,1321,2767,4093}" \
    --configs "${P1_CHAIN_CONFIGS:-chained,chained_wide,chained_wide_dwd_last}"
  check "P1 chained launch, host gap" "${P1_CHAIN_GAP_SECONDS:-180}" scripts/p1/p1_host_gap.py --precision faithful \
    --tokens "${P1_CHAIN_GAP_TOKENS:-128,512,1087,2767}" --configs "default,${P1_CHAIN_GAP_CONFIGS:-chained,chained_wide}"
esac
case " $RUNS " in *" p1_pass "*)
  # the fast path's dSwiGLU pass alone, by [tokens, I] blocks of several shapes beside Inductor's fused kernel
  check "P1 dSwiGLU pass alone" "${P1_PASS_SECONDS:-180}" scripts/p1/p1_pass_bench.py
esac
case " $RUNS " in *" p1_few "*)
  # shellcheck disable=SC2086  # the arguments are words
  check "P1 few-token candidates" "${P1_FEW_SECONDS:-240}" scripts/p1/p1_few_tokens_check.py \
    ${P1_FEW_ARGS:---tokens 1,2,4,8,16}
  check "The floor of a launch" "${P1_FLOOR_SECONDS:-120}" scripts/p1/launch_floor_probe.py
esac
case " $RUNS " in *" p1_lib "*)
  # the fast path's design on cuBLAS GEMMs: its candidates by graph replay, then their host side in NVIDIA's method
  mkdir -p "$TUNING/p1_lib"
  check "P1 design on cuBLAS GEMMs" "${P1_LIB_SECONDS:-240}" scripts/p1/p1_tune.py --precision fast \
    --configs "${P1_LIB_CONFIGS:-library_gemms_fast,library_gemms_fast_many,library_gemms_faithful}" --out "$TUNING/p1_lib"
  check "P1 host side of the designs" "${P1_GAP_SECONDS:-120}" scripts/p1/p1_host_gap.py --precision fast \
    --configs default,library_gemms_fast,library_gemms_fast_many --tokens "${P1_GAP_TOKENS:-128,512,1087,2767}"
esac
case " $RUNS " in *" p1_probe "*)
  # where the time goes: the few-token launch's programs stamped at each step, and each kernel of the fast
  # path's designs on cuBLAS GEMMs beside torch.compile's
  check "P1 few-token launch, traced" "${P1_TRACE_SECONDS:-120}" scripts/p1/p1_few_tokens_trace.py \
    --tokens "${P1_TRACE_TOKENS:-1,16}"
  check "P1 kernels of a call" "${P1_KERNELS_SECONDS:-180}" scripts/p1/p1_kernel_times.py \
    --tokens "${P1_KERNELS_TOKENS:-128,1321}" --configs "${P1_KERNELS_CONFIGS:-library_gemms_fast,library_gemms_fast_many}"
  check "The floor of a launch" "${P1_FLOOR_SECONDS:-120}" scripts/p1/launch_floor_probe.py
esac
case " $RUNS " in *" p1_gluon1 "*)
  # the forms of the two Gluon launches (gluon_launch1.py, gluon_launch2.py), both paths, by graph replay and in
  # NVIDIA's method
  mkdir -p "$TUNING/p1_gluon1_faithful" "$TUNING/p1_gluon1_fast"
  for precision in faithful fast; do
    check "P1 Gluon forms, $precision, graph replay" "${P1_GLUON1_SECONDS:-150}" scripts/p1/p1_tune.py \
      --precision "$precision" --out "$TUNING/p1_gluon1_$precision" \
      --tokens "${P1_GLUON1_TOKENS:-128,512,1087,1200,1321,1571,2447,4093,8192}" \
      --configs "${P1_GLUON1_CONFIGS:-gluon_narrow,gluon_tall,gluon_tall_dx_first_dwd2,gluon_wide_da_first,gluon_wide_da_first_tall,gluon_wide,gluon_wide_tall,gluon_wide_da256_dwd2}"
  done
  check "P1 Gluon launches, host gap" "${P1_GLUON1_GAP_SECONDS:-150}" scripts/p1/p1_host_gap.py --precision faithful \
    --tokens "${P1_GLUON1_GAP_TOKENS:-1571,2447,4093,8192}" --configs default,gluon_wide_tall
esac
case " $RUNS " in *" p2_tune "*)
  check "P2 kernel configs" "${P2_TUNE_SECONDS:-300}" scripts/p2/p2_tune.py \
    --cases "${P2_TUNE_CASES:-bf16:2048,bf16:32768,fp32:2048}" --out "$TUNING/p2_tune.json" \
    --configs "${P2_TUNE_CONFIGS:-default;a_s2:stages_a=2;a_m32:block_m=32}"
esac

echo "finished $(date -u +%Y-%m-%dT%H:%M:%SZ), $failures failed run(s); full log: $LOG" | tee -a "$LOG" "$TABLES"
echo
cat "$TABLES"
rm -f "$TABLES"
exit "$failures"
