#!/usr/bin/env bash
# Every check that needs a CUDA device, in one run of at most 570 s of wall time on one H200 with a cold Triton
# cache. Reads the repository; writes ONE results directory, $OUT/gpu_check (OUT defaults to ./gpu_out), holding
# summary.json (every part's record and results), summary.md (the same for people) and logs.tar.gz (every part's
# and every run's output): three files, as the device tool returns at most eight. Scratch runs go to a temporary
# directory under $GPU_CHECK_WORK (default build/, a real disk: O_DIRECT and checkpoints), removed at the end.
#
#     bash bench/gpu_check.sh                  # on the GPU machine: OUT=$OUT bash bench/gpu_check.sh
#     GPU_CHECK_DRY=1 bash bench/gpu_check.sh  # the plan: each part, its cap, and that the caps sum to 570
#
# The parts, in the order of what they prove (correctness first, timings last), each under `timeout` at its cap:
# SIGTERM to its whole process group at cap - grace, SIGKILL at the cap, grace = cap/10 within [1, 10] s. A part
# that fails or is cut is recorded (exit 124/137: cut at its cap) and the next one starts on time. The caps add
# up to the budget, so the run does too; the plan below is the one place they are set.
#   env            the Python that sees the GPU (GPU_CHECK_PYTHON, .venv/bin/python, python3: nothing is installed;
#                  the image's packages are the ones used), versions, nvidia-smi, which modules import.
#   kernels        (1) TRITON_INTERPRET=0 pytest tests/unit/kernels, less the CPU-only compile check (test_compile.py):
#                  every kernel compiled for CUDA against its reference on the presets' shapes and dtypes
#                  (attention at T 256 / 1024 and head dim 64 in fp32/bf16/fp16 by the FlashAttention 2x rule,
#                  AdamW vs torch.optim.AdamW, cross-entropy, LayerNorm, RMSNorm, rotary, Muon, bit-identical reruns).
#   train          (2) bench/gpu_train.py: the real `andrea train` on CUDA, andrea-12m then andrea-120m: tokens/s
#                  from its ledger, MFU (andrea/control/observe/mfu.py), peak memory vs `andrea info`, one SIGUSR1 checkpoint,
#                  SIGTERM's exit 0, bit-exact resume.
#   kernels_bench  (3) bench/kernels.py --only attention adamw rms_norm rotary muon: attention vs SDPA's flash
#                  backend (bf16, causal, the presets' head dim 64 at T 256, 1024, 4096), AdamW's GB/s (both
#                  presets' sizes) vs torch's fused AdamW and the HBM peak; the modern recipe's RMSNorm, rotary and
#                  Muon elementwise kernels at andrea-120m-modern's shapes vs torch.
#   ckpt120        (4) bench/checkpoint.py --preset andrea-120m: the checkpoint's stall from GPU memory vs a
#                  memcpy into pinned memory and the O_DIRECT write floor.
#   peer           (5) bench/peer.py: a nanoGPT-style loop (SDPA, fused AdamW, bf16, torch.compile) on the same
#                  model and batch, tokens/s beside andrea's; where the peer is faster, the gap by kernel
#                  (torch.profiler).
#   modern         (6) bench/gpu_train.py on the 2026 recipe, andrea-12m-modern then andrea-120m-modern (NorMuon,
#                  value embeddings, smear): the same figures and checks as part 2, the resume bit-exact through
#                  NorMuon's state. Last of the parts: the newest, so a lease cut short loses it first.
#   report         bench/gpu_report.py (stdlib only): summary.json, summary.md, logs.tar.gz.
# Exit status: 0 iff every part passed; 1 otherwise; 2 when no Python here sees a CUDA device (nothing runs).
#
# Knobs: OUT; GPU_CHECK_PYTHON; GPU_CHECK_WORK; GPU_CHECK_XDIST (pytest workers for part 1, default 12: compiling
# the kernels' specialisations is CPU work); GPU_CHECK_PARTS (a subset of the six, comma-separated; env and
# report always run); GPU_CHECK_CAP_<part>=SECONDS (overrides a cap; the plan says when the sum leaves 570);
# GPU_CHECK_DRY=1 (print the plan, run nothing); GPU_CHECK_SELFTEST=1 (the same choreography on a CPU with tiny
# shapes and steps: tests/e2e/test_gpu_check.py; GPU_CHECK_SELFTEST_HANG=<part> replaces that part by a process that
# never ends, to prove the cut).

set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUDGET=570
PLAN=(env kernels train kernels_bench ckpt120 peer modern report)
declare -A CAP=([env]=20 [kernels]=95 [train]=115 [kernels_bench]=55 [ckpt120]=40 [peer]=150 [modern]=90 [report]=5)
declare -A PROVES=(
    [env]="which Python sees the GPU; versions; what imports"
    [kernels]="(1) kernels compiled for CUDA vs references, presets' shapes and dtypes"
    [train]="(2) real andrea train, both presets: tokens/s, MFU, peak vs estimate, signals, resume"
    [kernels_bench]="(3) attention vs SDPA flash, AdamW vs fused and the HBM peak; RMSNorm, rotary, Muon vs torch"
    [ckpt120]="(4) 120M checkpoint stall from GPU memory vs memcpy and O_DIRECT"
    [peer]="(5) nanoGPT-style compiled peer, tokens/s side by side, the gap by kernel"
    [modern]="(6) real andrea train, both modern presets (NorMuon): tokens/s, MFU, peak, signals, resume"
    [report]="summary.json, summary.md, logs.tar.gz")
for part in "${PLAN[@]}"; do
    override=GPU_CHECK_CAP_$part
    [[ -n ${!override:-} ]] && CAP[$part]=${!override}
done
SELFTEST=${GPU_CHECK_SELFTEST:-0}
SELECTED=",${GPU_CHECK_PARTS:-kernels,train,kernels_bench,ckpt120,peer,modern},env,report,"
SELECTED=${SELECTED// /,}

plan() {
    local sum=0
    printf '%-14s %6s  %s\n' part "cap s" proves
    for part in "${PLAN[@]}"; do
        [[ $SELECTED == *",$part,"* ]] || continue
        printf '%-14s %6d  %s\n' "$part" "${CAP[$part]}" "${PROVES[$part]}"
        sum=$((sum + CAP[$part]))
    done
    if ((sum == BUDGET)); then
        printf '%-14s %6d  == budget %d s\n' sum "$sum" "$BUDGET"
    else
        printf '%-14s %6d  != budget %d s (caps overridden or parts left out)\n' sum "$sum" "$BUDGET"
    fi
}
if [[ ${GPU_CHECK_DRY:-0} == 1 ]]; then
    plan
    exit 0
fi

START=$SECONDS
export GPU_CHECK_T0=$EPOCHREALTIME  # the report's total wall time counts from here
say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
RES=$OUT/gpu_check
rm -rf "$RES"
mkdir -p "$RES/parts" "$RES/logs" "${GPU_CHECK_WORK:-$ROOT/build}"
WORK=$(mktemp -d "${GPU_CHECK_WORK:-$ROOT/build}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PARTS_DIR=$RES/parts
LOGS=$RES/logs
export ROOT WORK PARTS_DIR LOGS SELFTEST PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT
plan >"$RES/parts/plan.txt"
for part in "${PLAN[@]}"; do  # the same, for the report: part, cap, what it proves
    [[ $SELECTED == *",$part,"* ]] && printf '%s\t%s\t%s\n' "$part" "${CAP[$part]}" "${PROVES[$part]}"
done >"$RES/parts/plan.tsv"
say "plan (budget $BUDGET s):"
cat "$RES/parts/plan.txt" >&2

# --- what each part runs, on the GPU and in the self-test (tiny shapes and steps on a CPU) ---------------------
if [[ $SELFTEST == 1 ]]; then
    export TRITON_INTERPRET=1 KT_K="two_runs_are_bit_identical and adamw" XDIST=0
    export TRAIN_ARGS="--presets andrea-tiny --device cpu --kernels torch --warmup-steps 3 --measure-steps 10
        --set data.max_bytes_per_arm=30000 --set data.tokenizer_sample_bytes=30000 --set train.batch_size=2"
    export MODERN_ARGS="$TRAIN_ARGS --set model.arch=\"modern\" --set model.value_embeds=true --set model.smear=true
        --set train.optimizer=\"normuon\""
    export KB_ARGS="--device cpu --seq-lens 17 --head-dims 16 --tokens 34 --model-dim 32 --adamw-params 1000
        --rms-shapes 7x100xfp32 --rotary-shapes 1x2x17x16 --muon-params 1000"
    export CK_ARGS="--synthetic-params 200000 --device cpu --repeats 1"
    export PEER_ARGS="--presets andrea-tiny --device cpu --compile eager --warmup 1 --steps 2 --profile-steps 1
        --batch-size 2"
else
    export TRITON_INTERPRET=0 KT_K="" XDIST=${GPU_CHECK_XDIST:-12}
    # Smaller corpora than the presets' (8 MB an arm, a 16 MB tokenizer sample): preparation is CPU work the
    # throughput does not depend on (windows are drawn at random from any size).
    export TRAIN_ARGS="--set data.max_bytes_per_arm=2000000 --set data.tokenizer_sample_bytes=2000000"
    export MODERN_ARGS="--presets andrea-12m-modern andrea-120m-modern $TRAIN_ARGS"
    export KB_ARGS="--seq-lens 256 1024 4096 --head-dims 64 --adamw-params 12723200 120445440"
    export CK_ARGS="--preset andrea-120m --device cuda --repeats 2 --steps 2"
    export PEER_ARGS=""
fi

part_env() {
    local candidate rc
    nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >"$LOGS/nvidia-smi.txt"
    # One torch import per candidate (a cold disk makes the first one slow): the probe writes env.json itself.
    for candidate in ${GPU_CHECK_PYTHON:-} .venv/bin/python python3; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        "$candidate" - "$PARTS_DIR/env.json" "$SELFTEST" <<'EOF'
"""The environment the parts run in. Exit 3: no torch or no CUDA here (the next candidate is tried); 1: CUDA, but
a module a part imports is missing (the parts run and fail on their own, the summary names it); 0: all there."""
import importlib, json, os, sys
try:
    import torch
except ImportError:
    sys.exit(3)
if not torch.cuda.is_available() and sys.argv[2] != "1":
    sys.exit(3)
env = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
       "cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda, "gpus": torch.cuda.device_count(),
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
       "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
       "cpus": os.cpu_count(), "imports": {}}
needed = ("triton", "numpy", "tokenizers", "tqdm", "matplotlib", "tomli_w", "pytest", "hypothesis", "andrea.cli",
          "andrea.control.run.trainer", "andrea.kernels")
for name in needed + ("xdist", "uvloop"):  # the last two are optional: fewer pytest workers, asyncio's own loop
    try:
        module = importlib.import_module(name)
        env["imports"][name] = getattr(module, "__version__", "ok")
    except Exception as e:  # noqa: BLE001 - reported, not raised: the parts that need it will fail on their own
        env["imports"][name] = f"MISSING: {type(e).__name__}: {e}"
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
sys.exit(1 if any(str(env["imports"][n]).startswith("MISSING") for n in needed) else 0)
EOF
        rc=$?
        if ((rc != 3)); then
            echo "$candidate" >"$WORK/python"
            return "$rc"
        fi
    done
    echo '{"python": null, "cuda": false}' >"$PARTS_DIR/env.json"
    return 3
}

part_kernels() {
    local xdist=""
    if ((XDIST > 1)) && "$PY" -c "import xdist" 2>/dev/null; then xdist="-n $XDIST"; fi
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    "$PY" -m pytest -q -rs -p no:cacheprovider $xdist tests/unit/kernels --ignore=tests/unit/kernels/test_compile.py \
        --junitxml="$PARTS_DIR/kernels.xml" ${KT_K:+-k "$KT_K"}
}

part_train() {
    # shellcheck disable=SC2086
    "$PY" bench/gpu_train.py --json "$PARTS_DIR/train.json" --work "$WORK/train" --logs "$LOGS/train" $TRAIN_ARGS
}

part_kernels_bench() {
    # shellcheck disable=SC2086
    "$PY" bench/kernels.py --json "$PARTS_DIR/kernels_bench.json" --only attention adamw rms_norm rotary muon \
        $KB_ARGS
}

part_ckpt120() {
    # shellcheck disable=SC2086
    "$PY" bench/checkpoint.py --json "$PARTS_DIR/ckpt120.json" --dir "$WORK" --methods andrea memcpy \
        "O_DIRECT write" $CK_ARGS
}

part_peer() {
    # shellcheck disable=SC2086
    "$PY" bench/peer.py --json "$PARTS_DIR/peer.json" --andrea-json "$PARTS_DIR/train.json" $PEER_ARGS
}

part_modern() {
    # shellcheck disable=SC2086
    "$PY" bench/gpu_train.py --json "$PARTS_DIR/modern.json" --work "$WORK/modern" --logs "$LOGS/modern" $MODERN_ARGS
}

part_report() {
    "${PY:-python3}" bench/gpu_report.py --res "$RES" --budget "$BUDGET" --selftest "$SELFTEST"
}

part_hang() {  # the self-test's overrun: a child that never ends, its pid kept to show it was killed
    sleep 3600 &
    echo $! >"$LOGS/hang.pid"
    wait
}
export -f part_env part_kernels part_train part_kernels_bench part_ckpt120 part_peer part_modern part_report part_hang

FAILED=0
run_part() {
    local name=$1 cap=${CAP[$1]} fn=part_$1 grace rc t0=$EPOCHREALTIME
    grace=$((cap / 10)); ((grace < 1)) && grace=1; ((grace > 10)) && grace=10
    [[ $SELFTEST == 1 && ${GPU_CHECK_SELFTEST_HANG:-} == "$name" ]] && fn=part_hang
    say "$name: start (cap ${cap} s)"
    timeout -k "$grace" "$((cap - grace))" bash -c "$fn" >"$PARTS_DIR/$name.out" 2>"$LOGS/$name.log"
    rc=$?
    [[ -d $PARTS_DIR ]] &&  # gone after a report that succeeded: it archived them
        printf '%s %s %s\n' "$rc" "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')" \
            "$cap" >"$PARTS_DIR/$name.status"
    case $rc in
        0) say "$name: ok" ;;
        124 | 137) say "$name: CUT at its cap of ${cap} s (exit $rc)" ;;
        *) say "$name: failed (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    return "$rc"
}

run_part env
PY=$(cat "$WORK/python" 2>/dev/null || true)
if [[ -z $PY && -f $PARTS_DIR/env.status && $(cut -d' ' -f1 "$PARTS_DIR/env.status") =~ ^(124|137)$ ]]; then
    PY=${GPU_CHECK_PYTHON:-python3}  # the probe was cut, not refused: the one shot goes on with the image's Python
    say "env cut before it chose a Python: using $PY"
fi
export PY
if [[ -z $PY ]]; then
    echo "no CUDA device: nothing to run"
    FAILED=2
else
    for part in kernels train kernels_bench ckpt120 peer modern; do
        [[ $SELECTED == *",$part,"* ]] && run_part "$part"
    done
fi
export RES BUDGET
run_part report || say "the report failed: $RES/parts and $RES/logs are left as they are"
[[ -f $RES/summary.md ]] && cat "$RES/summary.md"
[[ -n $PY ]] || exit 2
exit "$FAILED"
