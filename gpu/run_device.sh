#!/usr/bin/env bash
# The one command run on a lent GPU machine: install the kit, record the machine, run the GPU checks in order of value,
# and leave logs + a summary in $OUT/results/.
#
#   On the GPU machine (the device tool's run, from the repository root, with carry [".kit"]):
#       bash gpu/run_device.sh
#   Before it, here: PYTHONPATH=. .venv/bin/python gpu/build_kit.py  (builds .kit/ and stamps .kit/COMMIT)
#   Dry run on a machine without a GPU (no kit install: the repository's .venv python; $OUT a temporary folder
#   unless set; smaller benchmarks; the CUDA-only steps skip or run on the CPU as they do without CUDA):
#       SNIP_DEVICE_DRY_RUN=1 bash gpu/run_device.sh
#
# Environment:
#   SNIP_DEVICE_DEADLINE_S  seconds from the start after which no step is launched (default 540 = 9 minutes);
#                           a step's own timeout is cut to what is left, the summary is written in any case
#   SNIP_DEVICE_STEPS       comma-separated steps to run, in this order (default: all, as listed below), e.g. to
#                           rerun what a first call did not reach: SNIP_DEVICE_STEPS=bench_train,bench_scale
#   SNIP_DEVICE_PYTHON      the interpreter (default: python3 on the device, .venv/bin/python in a dry run)
#   SNIP_DEVICE_DRY_RUN=1   the dry run above
#   SNIP_DEVICE_TIMEOUT_FACTOR  multiplies every step's timeout (default 1; e.g. 3 for a dry run on a slow, shared CPU)
#   SNIP_DEVICE_TEST_WORKERS    pytest-xdist workers for kernel_tests where xdist is installed (default 8)
#   SNIP_DEVICE_GPU_TESTS_K     a pytest -k expression selecting gpu_tests (default: all of tests/test_gpu.py)
#   SNIP_DEVICE_BENCH_TRAIN_PLANS  bench_train's --plans (default all four: bf16 fp8 fp4 adaptive; bf16 first)
#
# Steps (each under `timeout -k 10`; pass / fail / skip / timeout / not run in the summary):
#   env                  kit installed and importable, versions, requirement checks, a tiny CBC solve
#   gpu_tests            pytest -m gpu tests/test_gpu.py (own process, junit XML)
#   compile_tests        pytest -m gpu tests/test_gpu_compile.py: no synchronisation in a layer step (sync debug
#                        mode), a layer step captured in a CUDA graph, inductor through the custom ops and triton_ops
#   mx_gemm_check        gpu/mx_gemm_check.py: whether a BF16-output cuBLAS GEMM equals the FP32-output one rounded to
#                        BF16, bit for bit, with reduced-precision BF16 reductions off and on (may the MX GEMMs skip
#                        their cast to BF16?); JSON in bench/mx_gemm_check.json
#   kernel_tests         pytest tests/test_kernels.py tests/test_torch_backend_kernels.py (own process, junit XML;
#                        compiled Triton kernels, and the torch backend through them against the emulated reference)
#   train                launch/train.py through the deepspeed launcher, ds_configs/zero3.json, 20 steps (FusedAdam
#                        JIT-built by DeepSpeed with nvcc); plan.json, stats.json and TensorBoard kept, checkpoints not
#   bench_layer          benchmarks/bench_layer_gpu.py: fp8_hybrid / mxfp8 / nvfp4 / mxfp4 and torchao float8
#                        (tensorwise, the kit's wheel) against BF16 nn.Linear, eager and compiled, 4096^3 and the
#                        Llama-7B/70B layer shapes at 4096 and 16384 tokens: CUDA-event wall time, kernel-table time,
#                        launches, host time, peak memory; stops starting configurations 40 s before its timeout
#   bench_layer_host     benchmarks/bench_layer_host.py --device cuda: per step of one linear and of one Llama decoder
#                        block, every recipe and torchao float8, eager then compiled: device kernels launched, host
#                        time to issue, host reads, bytes kept for backward, peak memory; starts no row in the last 40 s
#   bench_gpu_gemm       benchmarks/bench_gpu_gemm.py --tokens 4096 --repeats 10
#   bench_quant_kernels  benchmarks/bench_quant_kernels.py --repeats 20
#   profile_gemm         benchmarks/profile_gpu_gemm.py (one 4096^3 SnipLinear fwd+bwd per recipe under torch.profiler:
#                        GEMM / quantize / other shares, launches per step, the top kernels)
#   bench_train          benchmarks/bench_train.py --device cuda --steps 8 --replan_every 4 (bf16/fp8/fp4/adaptive,
#                        one after another in one process)
#   bench_train_compiled (only when named in SNIP_DEVICE_STEPS) bench_train's runs compiled: launch/train.py
#                        --torch_compile (inductor) under ds_configs/zero1.json, --plans as bench_train's; results in
#                        bench/bench_train_cuda_compiled.{json,md}
#   bench_scale          benchmarks/bench_scale.py (two Llama-70B-wide blocks, ZeRO-3, one collection; profiled, and
#                        again with the CPU's 3 Mi-element statistics slices and with collect_tf32 off)
#   plan_study           (only when named in SNIP_DEVICE_STEPS, e.g. SNIP_DEVICE_STEPS=plan_study) one piece of the
#                        plan study on the GPU: launch/plan_study.py --regime gpu for one model seed
#                        (SNIP_DEVICE_STUDY_SEEDS, default: the first of 0-3 not finished in
#                        benchmarks/results/plan_study/gpu/cells.json), resumed from the committed cells.json and
#                        stopping 90 s before its timeout; cells.json, plans.json and the summary come back in
#                        logs.tar.gz (bench/plan_study_gpu/), to be copied to benchmarks/results/plan_study/gpu/
#
# What comes back ($OUT/results/, at most 8 files): summary.md, summary.json, env.json, pip_list.txt,
# steps.log (every step's log, the last 400 lines each), logs.tar.gz (full logs, junit XML, benchmark JSON/MD,
# the training run's plan/stats/TensorBoard).
set -u
START=$(date +%s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
DEADLINE_S=${SNIP_DEVICE_DEADLINE_S:-540}
ALL_STEPS="env,gpu_tests,compile_tests,mx_gemm_check,kernel_tests,train,bench_layer,bench_layer_host,bench_gpu_gemm,bench_quant_kernels,profile_gemm,bench_train,bench_scale"
STEPS=${SNIP_DEVICE_STEPS:-$ALL_STEPS}
DRY=${SNIP_DEVICE_DRY_RUN:-0}
FACTOR=${SNIP_DEVICE_TIMEOUT_FACTOR:-1}
SUMMARY_RESERVE_S=25  # kept back at the end for the summary and the archive
OPTIONAL_STEPS="plan_study,bench_train_compiled"  # run only when SNIP_DEVICE_STEPS names them

for s in ${STEPS//,/ }; do
    case ",$ALL_STEPS,$OPTIONAL_STEPS," in *",$s,"*) ;; *) echo "run_device: error: SNIP_DEVICE_STEPS names '$s'; steps are $ALL_STEPS (and, by name only, $OPTIONAL_STEPS)" >&2; exit 2;; esac
done
case "$DEADLINE_S" in ''|*[!0-9]*) echo "run_device: error: SNIP_DEVICE_DEADLINE_S must be whole seconds, got '$DEADLINE_S'" >&2; exit 2;; esac
case "$FACTOR" in ''|*[!0-9]*|0) echo "run_device: error: SNIP_DEVICE_TIMEOUT_FACTOR must be a positive whole number, got '$FACTOR'" >&2; exit 2;; esac

if [ "$DRY" = "1" ]; then
    OUT=${OUT:-$(mktemp -d /tmp/snip_device_out.XXXXXX)}
    PY=${SNIP_DEVICE_PYTHON:-$REPO/.venv/bin/python}
    [ -x "$PY" ] || PY=/work/main/.venv/bin/python
else
    if [ -z "${OUT:-}" ]; then echo "run_device: error: OUT is not set (the device tool sets it; SNIP_DEVICE_DRY_RUN=1 for a dry run)" >&2; exit 2; fi
    PY=${SNIP_DEVICE_PYTHON:-python3}
fi
RESULTS="$OUT/results"
WORK=$(mktemp -d /tmp/snip_device_work.XXXXXX)
mkdir -p "$RESULTS" "$WORK/logs" "$WORK/bench" "$WORK/train"
STEPS_JSONL="$WORK/steps.jsonl"
: > "$STEPS_JSONL"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# JIT-built ops (DeepSpeed's FusedAdam, snip_ds's CPU kernels) in one cache for every step of the call; a dry run
# keeps the usual cache (~/.cache/torch_extensions), where earlier builds are
[ "$DRY" = "1" ] || export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
export MAX_JOBS=${MAX_JOBS:-16}
export SNIP_DEVICE_WORK="$WORK" SNIP_DEVICE_DRY_RUN="$DRY"

log() { echo "[run_device +$(( $(date +%s) - START ))s] $*"; }

# ---------------------------------------------------------------- kit and snip_ds
INSTALL_NOTE="dry run: no kit installed, $PY's own packages"
if [ "$DRY" != "1" ]; then
    if ls .kit/*.whl > /dev/null 2>&1; then
        if timeout -k 10 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .kit/*.whl > "$WORK/logs/kit_install.log" 2>&1; then
            INSTALL_NOTE="kit installed: $(ls .kit/*.whl | wc -l) wheels into /tmp/site (PYTHONPATH)"
        else
            INSTALL_NOTE="kit install FAILED (see logs/kit_install.log)"
        fi
        export PATH="/tmp/site/bin:$PATH"
    else
        INSTALL_NOTE="no .kit/*.whl here: carry .kit (the device tool's carry [\".kit\"]) after gpu/build_kit.py"
    fi
    export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    # the kit's peer (torchao) where gpu/build_kit.py made the kit: bench_layer's torchao rows run on the CPU too
    if ls .kit/torchao-*.whl > /dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --target "$WORK/peer_site" .kit/torchao-*.whl > "$WORK/logs/peer_install.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$WORK/peer_site"
        INSTALL_NOTE="$INSTALL_NOTE; the kit's torchao wheel in $WORK/peer_site"
    fi
fi
# the interpreter's own bin (ninja for DeepSpeed's and snip_ds's JIT builds, the deepspeed script's python)
PY_BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)' 2>/dev/null || echo /usr/bin/python3)")
export PATH="$PY_BIN:$PATH"
log "$INSTALL_NOTE"
export SNIP_DEVICE_INSTALL_NOTE="$INSTALL_NOTE"

# The commit: git where .git travelled, else .kit/COMMIT (stamped by gpu/build_kit.py here, carried with .kit).
# A machine kept from an earlier call can hold an older .git than the working tree sent: where tracked files differ
# from git's HEAD, the kit's stamp (made here right before the call) names the working tree.
COMMIT=$(git rev-parse HEAD 2>/dev/null) && COMMIT_SOURCE="git rev-parse HEAD" && \
    { [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || {
        if [ -f .kit/COMMIT ] && [ "$(head -1 .kit/COMMIT)" != "$COMMIT" ]; then
            COMMIT_SOURCE=".kit/COMMIT ($(sed -n 2p .kit/COMMIT)); the machine's .git says $COMMIT with tracked files modified"
            COMMIT=$(head -1 .kit/COMMIT)
        else
            COMMIT_SOURCE="$COMMIT_SOURCE (tracked files modified)"
        fi; }; }
if [ -z "$COMMIT" ]; then
    if [ -f .kit/COMMIT ]; then
        COMMIT=$(head -1 .kit/COMMIT); COMMIT_SOURCE=".kit/COMMIT, stamped when the kit was built ($(sed -n 2p .kit/COMMIT)); .git did not travel"
    else
        COMMIT=unknown; COMMIT_SOURCE=".git did not travel and .kit/COMMIT is absent"
    fi
fi
export SNIP_DEVICE_COMMIT="$COMMIT" SNIP_DEVICE_COMMIT_SOURCE="$COMMIT_SOURCE"
log "commit $COMMIT ($COMMIT_SOURCE)"

# ---------------------------------------------------------------- steps
# run_step NAME TIMEOUT_S SKIP_PATTERN COMMAND: runs COMMAND (bash) under timeout -k 10, its output in logs/NAME.log.
# rc 0 is pass (skip when SKIP_PATTERN, if not empty, is in the log); 124/137 timeout; 5 from pytest: no tests.
run_step() {
    local name=$1 limit=$(( $2 * FACTOR )) skip_pattern=$3 cmd=$4
    case ",$STEPS," in *",$name,"*) ;; *) return 0;; esac
    local now left status rc detail t0 t1
    now=$(date +%s)
    left=$(( DEADLINE_S - (now - START) - SUMMARY_RESERVE_S ))
    if [ "$left" -lt 20 ]; then
        log "$name: not run (deadline: ${left}s left)"
        "$PY" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "status": "not run", "detail": "global deadline reached", "seconds": 0, "command": sys.argv[2]}))' "$name" "$cmd" >> "$STEPS_JSONL"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "$name: start (timeout ${limit}s): $cmd"
    t0=$(date +%s.%N)
    SNIP_DEVICE_STEP_LIMIT_S=$limit timeout -k 10 "$limit" bash -c "$cmd" > "$WORK/logs/$name.log" 2>&1 < /dev/null
    rc=$?
    t1=$(date +%s.%N)
    # A step killed while JIT-building an op leaves the build folder's `lock`; the next load of that op would wait on
    # it for ever. Between steps no build runs, so a lock left in this call's own extensions folder is stale.
    if [ "$DRY" != "1" ] && [ -d "${TORCH_EXTENSIONS_DIR:-}" ]; then
        find "$TORCH_EXTENSIONS_DIR" -maxdepth 3 -name lock -type f -delete 2>/dev/null
    fi
    case $rc in
        0) status=pass; if [ -n "$skip_pattern" ] && grep -q -- "$skip_pattern" "$WORK/logs/$name.log"; then status=skip; fi;;
        124|137) status=timeout;;
        5) status=skip;;
        *) status=fail;;
    esac
    detail=$(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -1 | cut -c1-300)
    "$PY" -c 'import json,sys; a=sys.argv; print(json.dumps({"step": a[1], "status": a[2], "rc": int(a[3]), "seconds": round(float(a[5]) - float(a[4]), 1), "timeout_s": int(a[6]), "detail": a[7], "command": a[8]}))' \
        "$name" "$status" "$rc" "$t0" "$t1" "$limit" "$detail" "$cmd" >> "$STEPS_JSONL"
    log "$name: $status (rc $rc, $(awk "BEGIN {printf \"%.0f\", $t1 - $t0}")s)"
}

# a free port for the deepspeed launcher (its default, 29500, may be taken by another job on a shared machine)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 29500)
if [ "$DRY" = "1" ]; then
    TRAIN_ARGS="--max_steps 6 --eval_steps 3 --save_steps 6"
    GEMM_ARGS="--device cpu --tokens 64 --repeats 1"
    QUANT_ARGS="--repeats 2"
    TRAIN_BENCH="benchmarks/bench_train.py --plumbing --plans bf16 fp8"   # the GPU code path, in-process, tiny model
    LAYER_ARGS="--device cpu"
    LAYER_HOST_ARGS="--steps 5 --modes eager --no_python_profile --output_dir $WORK/bench"   # the CUDA path on CPU tensors
    SCALE_ARGS="--scale 64 --block_size 128 --steps 2 --profile --chunk_elements 786432 --ieee_collection"
    PROFILE_ARGS="--device cpu --tokens 64 --k 256 --n 256 --steps 2"
    STUDY_ARGS="--device cpu --workers 1 --blocks 2 --data_seeds 0,1 --warmup_steps 20 --steps 4 --eval_batches 2 --stat_batches 2"
else
    TRAIN_ARGS="--max_steps 20 --eval_steps 10 --save_steps 20"
    GEMM_ARGS="--tokens 4096 --repeats 10"
    QUANT_ARGS="--repeats 20"
    TRAIN_BENCH="benchmarks/bench_train.py --device cuda --steps 8 --replan_every 4 --output_dir $WORK/bench"
    [ -n "${SNIP_DEVICE_BENCH_TRAIN_PLANS:-}" ] && TRAIN_BENCH="$TRAIN_BENCH --plans ${SNIP_DEVICE_BENCH_TRAIN_PLANS//[^a-z0-9 ]/}"
    SCALE_ARGS="--steps 3 --profile --chunk_elements 786432 --ieee_collection"   # where it goes; CPU-sized slices; IEEE FP32
    PROFILE_ARGS="--output_dir $WORK/bench"
    LAYER_ARGS="--output_dir $WORK/bench"
    LAYER_HOST_ARGS="--device cuda --steps 100 --output_dir $WORK/bench"
    STUDY_ARGS=""
fi

run_step env 90 "" "'$PY' gpu/device_env.py --output '$WORK/env.json' --pip_list '$WORK/pip_list.txt'"
GPU_TESTS_K=""
[ -n "${SNIP_DEVICE_GPU_TESTS_K:-}" ] && GPU_TESTS_K="-k '${SNIP_DEVICE_GPU_TESTS_K//\'/}'"
run_step gpu_tests 180 "" "'$PY' -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu.py $GPU_TESTS_K --junitxml '$WORK/junit_gpu_tests.xml'"
run_step compile_tests 180 "" "'$PY' -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu_compile.py --junitxml '$WORK/junit_compile_tests.xml'"
run_step mx_gemm_check 60 "" "'$PY' gpu/mx_gemm_check.py --output '$WORK/bench/mx_gemm_check.json'"
# Each (recipe, axis, dtype, layout) is a kernel of its own, compiled on first use: one process compiled 101 of
# the 166 tests' kernels in 240 s on an H100 machine. pytest-xdist (on the GPU image) compiles in parallel.
XDIST=""
"$PY" -c "import xdist" > /dev/null 2>&1 && XDIST="-n ${SNIP_DEVICE_TEST_WORKERS:-8}"
run_step kernel_tests 240 "" "'$PY' -m pytest -q -rA -p no:cacheprovider $XDIST tests/test_kernels.py tests/test_torch_backend_kernels.py --junitxml '$WORK/junit_kernel_tests.xml'"
run_step train 300 "" "'$PY' -m deepspeed.launcher.runner --num_gpus 1 --master_port $PORT launch/train.py \
    --deepspeed ds_configs/zero3.json $TRAIN_ARGS --output_dir '$WORK/run_gpu' --no_progress; rc=\$?; \
    mkdir -p '$WORK/train'; cp '$WORK/run_gpu'/plan.json '$WORK/run_gpu'/stats.json '$WORK/train/' 2>/dev/null; \
    cp -r '$WORK/run_gpu'/tensorboard '$WORK/train/' 2>/dev/null; ls -R '$WORK/run_gpu' > '$WORK/train/files.txt' 2>&1; \
    rm -rf '$WORK/run_gpu'; exit \$rc"
# bench_layer: as many configurations as fit (most valuable first), each shape's results written as it finishes
run_step bench_layer 330 "" "'$PY' benchmarks/bench_layer_gpu.py $LAYER_ARGS --deadline_s \$(( SNIP_DEVICE_STEP_LIMIT_S > 80 ? SNIP_DEVICE_STEP_LIMIT_S - 40 : 40 ))"
run_step bench_layer_host 240 "" "'$PY' benchmarks/bench_layer_host.py $LAYER_HOST_ARGS --deadline_s \$(( SNIP_DEVICE_STEP_LIMIT_S > 80 ? SNIP_DEVICE_STEP_LIMIT_S - 40 : 40 ))"
run_step bench_gpu_gemm 150 "" "'$PY' benchmarks/bench_gpu_gemm.py $GEMM_ARGS --output_dir '$WORK/bench'"
run_step bench_quant_kernels 120 "needs a CUDA GPU" "'$PY' benchmarks/bench_quant_kernels.py $QUANT_ARGS --output_dir '$WORK/bench'"
run_step profile_gemm 120 "" "'$PY' benchmarks/profile_gpu_gemm.py $PROFILE_ARGS"
# Four launch/train.py runs of a 1B model, about 130 s each on an H100 (two fitted in 264 s): run it alone, or
# with SNIP_DEVICE_BENCH_TRAIN_PLANS (e.g. "bf16 fp4 adaptive"); its results are rewritten after every plan.
run_step bench_train 520 "" "'$PY' $TRAIN_BENCH"
run_step bench_train_compiled 520 "" "'$PY' $TRAIN_BENCH --torch_compile"
run_step bench_scale 240 "" "'$PY' benchmarks/bench_scale.py $SCALE_ARGS --output '$WORK/bench'"
# One model seed of the GPU plan study per loan, resumed from the committed cells (its warm-up checkpoints stay here).
STUDY_SEEDS=${SNIP_DEVICE_STUDY_SEEDS:-$("$PY" gpu/next_study_seed.py benchmarks/results/plan_study/gpu 2>/dev/null || echo 0)}
run_step plan_study 480 "" "mkdir -p '$WORK/bench/plan_study_gpu';     cp benchmarks/results/plan_study/gpu/cells.json benchmarks/results/plan_study/gpu/plans.json '$WORK/bench/plan_study_gpu/' 2>/dev/null;     '$PY' launch/plan_study.py --regime gpu --model_seeds '${STUDY_SEEDS//[^0-9,]/}' $STUDY_ARGS     --output_dir '$WORK/bench/plan_study_gpu' --checkpoint_dir '$WORK/study_checkpoints'     --max_minutes \$(( SNIP_DEVICE_STEP_LIMIT_S > 150 ? (SNIP_DEVICE_STEP_LIMIT_S - 90) / 60 : 1 ))"

# ---------------------------------------------------------------- summary and what comes back
log "summary"
timeout -k 5 60 "$PY" gpu/device_summary.py --work "$WORK" --results "$RESULTS" --started "$START" \
    --deadline "$DEADLINE_S" > "$WORK/logs/summary.log" 2>&1 || {
    # the summary script itself failed: still say what ran
    { echo "# run_device summary (fallback: gpu/device_summary.py failed, see steps.log)"; echo; cat "$STEPS_JSONL"; } > "$RESULTS/summary.md"
    cp "$STEPS_JSONL" "$RESULTS/summary.json" 2>/dev/null
}
[ -f "$WORK/env.json" ] && cp "$WORK/env.json" "$RESULTS/"
[ -f "$WORK/pip_list.txt" ] && cp "$WORK/pip_list.txt" "$RESULTS/"
for f in "$WORK"/logs/*.log; do
    echo "===================== $(basename "$f") (last 400 lines)"; tail -n 400 "$f"
done > "$RESULTS/steps.log"
tar -C "$WORK" -czf "$RESULTS/logs.tar.gz" logs bench train steps.jsonl $(cd "$WORK" && ls junit_*.xml env.json 2>/dev/null)
ls -la "$RESULTS"
cat "$RESULTS/summary.md"
[ "$DRY" = "1" ] && rm -rf "$WORK"
log "done; results in $RESULTS"
exit 0
