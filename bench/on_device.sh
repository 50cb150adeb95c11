#!/usr/bin/env bash
# One call on the lent GPU machine (../shared/gpu/README.md), from the repository root, with .gpu-bundle carried:
#   bash bench/on_device.sh tests [PYTEST ARGS]                    # pytest -m gpu, log in $OUT/gpu_tests.log
#   (tests: on a fresh machine the whole suite outlasts a call, FlashInfer's first builds and the stress tests'
#    servers included: send `tests tests --ignore tests/test_stress.py`, then `tests tests/test_stress.py`)
#   bash bench/on_device.sh serve NAME "lychee dense" shared 32768 # bench.gpu_serving into $OUT/NAME.json
#   bash bench/on_device.sh kernels NAME [FLAGS]                   # bench.bench_kernels into $OUT/NAME.json
#   bash bench/on_device.sh fidelity NAME 16000 "lychee-ahead off quest@512"  # bench.fidelity into $OUT/NAME.json
#   BASE=REV bash bench/on_device.sh serve ...   # the same, first at commit REV (a worktree in /tmp, installed in
#    this tree's place) into $OUT/NAME_base.json, then this tree's: one call compares two commits on one card
#   (fidelity: real Qwen2.5-Coder-0.5B, or the model MODEL names (smollm2), 50 samples per task at budget 1024 unless
#    further bench.fidelity flags say otherwise; carry .gpu-bundle and .gpu-model/whl, after earlier calls brought the
#    model's parts to /tmp/gpu-model; CALL_S, the call's timeout_s (600 unless set), sets when the samples stop, 60 s
#    before it: each run keeps the seeds every task finished, where a run the call's limit cuts returns nothing; a
#    METHOD@BUDGET:SEED word serves the rest of a run cut at SEED (`python -m docs.tables.frontier --missing 30K` names
#    them), so one call can finish runs cut at different seeds; AFTER="NAME..." (earlier calls' names on this machine)
#    starts each cell where those calls stopped it, so calls sent in one batch continue one another without a pause
#    between them (the machine is released after 30 s idle); on a fresh machine, where the model is converted and
#    every kernel compiled first, a 30K call of 60 samples with 135 s to its deadline kept nothing: a short call
#    belongs on a warm machine;
#    past 30K: add --rope-scale 2 and LENGTH 64000 (the model stretched by YaRN to 64K, its own result file);
#    the committed 16K and 30K files hold LENGTH 16000 and 30000: another length draws other samples, which
#    `python -m bench.fidelity --append RESULT FILE --commit --gpu --note` refuses to add to them)
#   (serve: METHODS, then one workload or "" for none, then the TPOT contexts and any further gpu_serving flags;
#    a resume_s.json in the tree root is resumed, so dense can follow lychee in a second call on the same machine)
# Each command stays under the call's 600 s; $OUT/gpu.txt names the card.
set -uo pipefail
source .gpu-bundle/setup.sh > /dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/gpu.txt"
install() {   # the plugin the servers load: the checkout at $1, editable
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$1" > /dev/null; }
case "$1" in
  tests)   # further words go to pytest in place of "tests": split the suite over calls on a fresh machine
    shift
    # beside the tests, on the CPU: FlashInfer's kernels for the serving model (bf16, head_dim 128), which the first
    # server of a fresh machine otherwise builds for about 4 minutes (a BASE comparison's first run lost its 285 s)
    timeout 540 python3 - > "$OUT/flashinfer_warm.log" 2>&1 <<'EOF' &
import torch
from flashinfer.jit.attention.modules import gen_batch_prefill_module
from flashinfer.jit.cascade import gen_cascade_module
from flashinfer.jit.quantization import gen_quantization_module
bf = torch.bfloat16
for spec in [gen_batch_prefill_module(b, bf, bf, bf, torch.int32, 128, 128, 0, False, False, False)
             for b in ("fa2", "fa3")] + [gen_cascade_module(), gen_quantization_module()]:
    print(spec.name, "built before" if spec.is_compiled else "building", flush=True)
    spec.build(verbose=False)
EOF
    timeout 560 python3 -m pytest -m gpu -q "${@:-tests}" -p no:cacheprovider --durations=12 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -25
    wait; tail -4 "$OUT/flashinfer_warm.log" ;;
  serve)
    name=$2; methods=$3; workload=$4; shift 4
    [ -d /tmp/m8b ] || python3 .gpu-bundle/mkmodel.py /tmp/m8b llama3-8b > /dev/null
    resume=(); [ -f resume_s.json ] && resume=(--resume resume_s.json)
    serve_at() {   # $1: the checkout whose plugin serves, $2: the result's name, then the contexts and flags
      local dir=$1 out=$2; shift 2
      export SPARSEKV_LOG_COMPILES="$OUT/$out.compiles.jsonl"   # each Triton compile of the sparse servers
      # that checkout's packages first: the tree's own sit on PYTHONPATH (for bench/), and a server's processes
      # import sgl_sparsekv through it before the editable install
      # shellcheck disable=SC2086  # METHODS and the workload are word lists
      (cd "$dir" && export PYTHONPATH="$PWD:$PYTHONPATH" && timeout "$limit" python3 -m bench.gpu_serving \
        --model /tmp/m8b --out "$OUT/$out.json" \
        --methods $methods --workloads $workload "${resume[@]}" --contexts "$@" 2>&1 | grep -v "it/s]" | tail -15)
      if [ -f "$SPARSEKV_LOG_COMPILES" ]; then
        python3 -m sgl_sparsekv.compile_log "$SPARSEKV_LOG_COMPILES" | tail -8
      fi; }
    limit=580
    if [ -n "${BASE:-}" ]; then
      limit=285
      rm -rf /tmp/base && git worktree add -f --detach /tmp/base "$BASE" > /dev/null && install /tmp/base
      serve_at /tmp/base "${name}_base" "$@"
      install .
    fi
    serve_at . "$name" "$@"
    # FlashInfer's JIT builds of this call (minutes on a fresh machine, for whichever server starts first)
    find ~/.cache/flashinfer -name "*.so" -newer "$OUT/gpu.txt" -printf "%TT %f\n" 2>/dev/null | sort \
      | tee "$OUT/$name.flashinfer_built.txt" ;;
  kernels)
    name=$2; shift 2
    timeout 560 python3 -m bench.bench_kernels --out "$OUT/$name.json" "$@" 2>&1 | tail -25 ;;
  fidelity)
    name=$2; length=$3; methods=$4; shift 4
    model=${MODEL:-qwen2.5-coder-0.5b}
    [ -d "/tmp/$model" ] || python3 .gpu-bundle/model_on_gpu.py "$model" "/tmp/$model" > /dev/null
    # shellcheck disable=SC2086  # METHODS is a word list
    after=(); for earlier in ${AFTER:-}; do after+=("/tmp/fidelity/$earlier.json"); done
    left=$(( ${CALL_S:-600} - SECONDS ))   # SECONDS: since this script started, the model's conversion included
    timeout $(( left - 15 )) python3 -m bench.fidelity --device gpu --model "$model" --model-dir "/tmp/$model" \
      --lengths "$length" --samples 50 --concurrency 32 --budgets 1024 --methods $methods --out "$OUT/$name.json" \
      --deadline $(( left - 60 )) ${after[@]:+--after "${after[@]}"} "$@" 2>&1 | tail -30
    mkdir -p /tmp/fidelity && cp "$OUT/$name.json" /tmp/fidelity/ 2>/dev/null ;;   # for a later call's AFTER
  *) echo "usage: bash bench/on_device.sh tests [PYTEST ARGS] | serve NAME METHODS WORKLOAD [CONTEXTS...]" \
          "| kernels NAME [FLAGS] | fidelity NAME LENGTH METHODS [FLAGS]" >&2
     exit 2 ;;
esac
