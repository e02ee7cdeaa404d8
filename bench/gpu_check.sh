#!/usr/bin/env bash
# Every check that needs a CUDA device, in one run that fits ~9 minutes of wall time on an H200 (cold Triton
# cache included). Run from anywhere:  bash bench/gpu_check.sh   (OUT defaults to ./gpu_out)
#
# Checks, in order of what they prove (correctness first, timings last), each under `timeout`, each recorded
# with its exit code; one failing never stops the next:
#   kernels_tests  TRITON_INTERPRET=0 pytest tests/kernels: the kernels compiled for CUDA against torch
#                  (fp32/bf16/fp16 attention by the FlashAttention 2x rule, AdamW vs torch.optim.AdamW,
#                  cross-entropy, bit-identical reruns); the CPU cases skip (no interpreter).
#   cuda_paths     bench/cuda_paths.py (issue #27): executor threads on the rank's device (torch and Triton's
#                  driver); the staging image registered at its exact size vs PyTorch's pinned allocator (bytes,
#                  D2H GB/s, the copy intact); O_DIRECT from each (EFAULT here or not); CPU burnt by a default vs
#                  a blocking event's synchronize(); SDPA's bf16 backward rerun bit for bit, with and without
#                  torch.use_deterministic_algorithms. Fails only on a correctness probe.
#   train_smoke    the real trainer on CUDA (andrea-12m, --kernels triton): ready line, SIGUSR1 checkpoint
#                  while training, SIGTERM clean exit, verify, resume +20 steps; two identical 60-step runs
#                  give the same step_000060.bin (GPU determinism); a run stopped at 30 and resumed to 60
#                  gives it too (bit-exact resume on GPU). Two more 60-step runs with --kernels torch (SDPA):
#                  whether their bytes match is reported (SMOKE torch_kernels_bytes_equal), never a failure:
#                  docs/architecture.md (Determinism) promises the curve, not the bytes, there.
#   dist_two_ranks torchrun --nproc_per_node=2 (ZeRO-1, NCCL) for 30 steps with a checkpoint every 10, then
#                  verify: rank 1 on cuda:1 is where the thread-device bug (issue #27, item 1) showed (Triton
#                  launching into GPU 0's context with cuda:1 pointers, step records fenced on GPU 0's stream).
#                  Needs 2 GPUs: one GPU cannot host it (device index 1 does not exist, and NCCL refuses two
#                  ranks on one GPU: "Duplicate GPU detected"), so there it is reported as skipped; on one GPU
#                  the cuda_paths probe and tests/test_cuda_paths.py (fakes, rank 1 of 2) carry the check.
#   kernels_bench  bench/kernels.py: attention vs SDPA flash (bf16), AdamW vs torch fused, GB/s vs peak,
#                  fused cross-entropy and LayerNorm vs torch (time, GB/s, the cross-entropy's extra memory).
#   train_bench    bench/train.py: andrea-12m and andrea-120m, andrea (torch / triton) vs a plain-torch loop.
#   ckpt120_bench  bench/checkpoint.py --preset andrea-120m --repeats 3: snapshot stall and commit GB/s.
#
# Writes at most 8 files under $OUT (the device tool returns no more): summary.md (exit codes + key figures,
# the cuda_paths table and the dist_two_ranks lines included), env.txt, kernels_tests.txt, train_smoke.txt,
# kernels.md, train.md, ckpt120.md, and details.tar.gz (kernels.json, train.json, ckpt120.json, cuda_paths.json
# and every raw log). Exit status: 0 iff every check passed, 1 otherwise, 2 when there is
# no CUDA device (nothing is run).
#
# Python: GPU_CHECK_PYTHON if set; else .venv/bin/python, else python3, whichever sees a CUDA device; else
# `make venv` (needs the network: on a CUDA machine PyPI's torch==2.13.0 is a CUDA build). A module the chosen
# Python lacks (the offline H200 image has no tomli-w) is installed from the wheels in GPU_CHECK_WHEELS
# (default build/gpu_wheels: `make gpu-wheels` fills it; carry that folder) into a scratch directory, never into
# the interpreter.
#
# Stacks: the pins (torch 2.13, Triton 3.9) and the GPU image's (Python 3.12, torch 2.11, Triton 3.6); nothing here
# depends on which (env.txt records it). Triton 3.6's *interpreter* fails 61 kernel tests with NumPy >= 2.4
# (it int()s shape-(1,) arrays, which NumPy 2.4 refuses; 3.9 squeezes first): compiled kernels never meet it,
# and `make kernels-gpu-triton` runs the CPU kernel tests under Triton 3.6 (with NumPy < 2.4) on any machine.
#
# Knobs: OUT, GPU_CHECK_BUDGET (seconds for all checks, default 540), GPU_CHECK_DRY=1 (find Python and CUDA,
# print the plan, run nothing; exit 2 without CUDA), GPU_CHECK_XDIST (pytest workers, default 8: compiling
# ~100 kernel specialisations serially takes minutes), GPU_CHECK_SELFTEST=1 (tests this script on a CPU: runs
# train_smoke alone on the tiny preset with --device cpu --kernels torch; proves the choreography, not the GPU).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-./gpu_out}
BUDGET=${GPU_CHECK_BUDGET:-540}
DRY=${GPU_CHECK_DRY:-0}
WHEELS=${GPU_CHECK_WHEELS:-build/gpu_wheels}
XDIST=${GPU_CHECK_XDIST:-8}
START=$SECONDS

say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }

# --- the interpreter ---------------------------------------------------------------------------------------
sees_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY=""
if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
    PY=$GPU_CHECK_PYTHON
else
    for candidate in .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 && sees_cuda "$candidate"; then PY=$candidate; break; fi
    done
fi
if [[ -z $PY ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [[ $DRY != 1 ]]; then
    say "no Python here sees the GPU: make venv (pip, needs the network)"
    timeout -k 10 600 make venv || say "make venv failed (rc $?)"
    [[ -x .venv/bin/python ]] && PY=.venv/bin/python
fi
if [[ ${GPU_CHECK_SELFTEST:-0} == 1 ]]; then
    PY=${GPU_CHECK_PYTHON:-.venv/bin/python}  # tests this script on a CPU: the smoke alone, tiny preset
    export SMOKE_ARGS="--preset andrea-tiny --device cpu --kernels torch"
elif [[ -z $PY ]] || ! sees_cuda "$PY"; then
    echo "no CUDA device: nothing to run"
    exit 2
fi
if [[ $DRY == 1 ]]; then
    echo "dry run: $PY sees a CUDA device; would run kernels_tests, cuda_paths, train_smoke, dist_two_ranks," \
         "kernels_bench, train_bench, ckpt120_bench into $OUT within ${BUDGET}s"
    exit 0
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS"
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
if ! "$PY" -c 'import tomli_w, tokenizers, tqdm, numpy, matplotlib, pytest, hypothesis' 2>/dev/null; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl \
            && export PYTHONPATH=$WORK/site:$ROOT
    fi
    "$PY" -c 'import tomli_w, tokenizers, tqdm, numpy, matplotlib, pytest, hypothesis' \
        || say "WARNING: $PY lacks a dependency (above); the checks that import andrea will fail"
fi

TRAINER_PID=""
finish() {
    [[ -n $TRAINER_PID ]] && kill -KILL "$TRAINER_PID" 2>/dev/null || true
    for f in kernels.json train.json ckpt120.json cuda_paths.json cuda_paths.md; do
        [[ -f $WORK/$f ]] && cp "$WORK/$f" "$LOGS/"
    done
    tar -czf "$OUT/details.tar.gz" -C "$WORK" logs 2>/dev/null || true
    rm -rf "$WORK"
}
trap finish EXIT

{
    echo "# $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi || true
    "$PY" - <<'EOF'
import sys, torch, triton
print(f"python {sys.version.split()[0]} ({sys.executable})")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
import numpy
print(f"numpy {numpy.__version__}, {torch.cuda.device_count()} CUDA device(s)")
print(f"device {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
EOF
} >"$OUT/env.txt" 2>&1 || true
cat "$OUT/env.txt" >&2

# --- running one check -------------------------------------------------------------------------------------
declare -a RESULTS=()
# run_check NAME CAP_SECONDS FUNCTION: FUNCTION under `timeout` (the cap, or what is left of the budget);
# records "NAME rc seconds". rc 124/137: timed out; 125: not started, the budget was spent.
run_check() {
    local name=$1 cap=$2 fn=$3 left limit rc t0=$SECONDS
    left=$((BUDGET - (SECONDS - START) - 10))
    limit=$((cap < left ? cap : left))
    if ((limit < 20)); then
        say "$name: skipped, budget spent"
        RESULTS+=("$name 125 0")
        return 0
    fi
    say "$name: start (limit ${limit}s)"
    set +e
    timeout -k 15 "$limit" bash -c "$fn" >"$LOGS/$name.log" 2>&1
    rc=$?
    set -e
    say "$name: rc $rc in $((SECONDS - t0))s"
    RESULTS+=("$name $rc $((SECONDS - t0))")
}
SMOKE_ARGS=${SMOKE_ARGS:---preset andrea-12m --device cuda --kernels triton}
export PY OUT WORK LOGS XDIST SMOKE_ARGS

# --- the checks (each a bash -c body: set -euo pipefail is re-established inside) ----------------------------
kernels_tests='set -euo pipefail
xdist=()
if [[ $XDIST -gt 1 ]] && "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n "$XDIST"); fi
TRITON_INTERPRET=0 "$PY" -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" tests/kernels 2>&1 \
    | tee "$OUT/kernels_tests.txt"'

train_smoke='set -uo pipefail
exec > >(tee "$OUT/train_smoke.txt") 2>&1
fails=0
note() { echo "SMOKE $1=$2"; [[ $2 == ok ]] || fails=$((fails + 1)); }
train() { "$PY" -m andrea train $SMOKE_ARGS "$@"; }
newest() { ls "$1"/step_*.bin 2>/dev/null | sort | tail -1 | sed -E "s/.*step_0*([0-9]+)\.bin/\1/"; }
commits() { grep -c "committed in" "$1" || true; }
wait_for() {  # wait_for SECONDS COMMAND...: poll COMMAND every 0.2 s until it succeeds
    local deadline=$((SECONDS + $1)); shift
    until "$@"; do ((SECONDS < deadline)) || return 1; sleep 0.2; done
}
seed() { mkdir -p "$1" && cp "$WORK/prep/tokenizer.json" "$1/" && cp -r "$WORK/prep/data" "$1/"; }

# First start: tokenizer and token files (CPU work), made once and copied into each run as tests/runs.py does.
train --run-dir "$WORK/prep" --steps 0 >"$LOGS/smoke_prep.log" 2>&1 && note prep ok || note prep fail

# Signals. A long --steps so only the signals end the run (60 steps take ~2 s on an H200: SIGTERM would land
# after the end); cadence 1000 so the checkpoint after SIGUSR1 can only be the one it asked for.
run=$WORK/run; log=$LOGS/smoke_signals.log; seed "$run"
# Started directly, not through train(): $! must be the trainer itself, not a subshell that a signal would kill.
"$PY" -m andrea train $SMOKE_ARGS --run-dir "$run" --steps 100000 --checkpoint-every 1000 >"$log" 2>&1 &
pid=$!; echo "$pid" >"$WORK/trainer.pid"
if wait_for 120 grep -q "^ready " "$log"; then note ready ok; grep "^ready " "$log"; else note ready fail; fi
sleep 3  # some steps in, the kernels compiled
before=$(commits "$log")
kill -USR1 "$pid"
more_commits() { (($(commits "$log") > before)); }
if wait_for 60 more_commits; then note usr1_checkpoint ok; else note usr1_checkpoint fail; fi
kill -0 "$pid" 2>/dev/null && note usr1_keeps_training ok || note usr1_keeps_training fail
sleep 1
kill -TERM "$pid"
if wait_for 90 eval "! kill -0 $pid 2>/dev/null"; then wait "$pid"; rc=$?; else kill -KILL "$pid"; rc=timeout; fi
note sigterm_exit_0 "$([[ $rc == 0 ]] && echo ok || echo "fail(rc=$rc)")"
grep -E "SIGUSR1 received|SIGTERM received|committed in|stopped at|Error|error" "$log" | tail -20
stop=$(newest "$run"); echo "newest checkpoint after SIGTERM: step ${stop:-none}"
"$PY" -m andrea verify "$run" && note verify ok || note verify fail
if [[ -n $stop ]]; then
    train --run-dir "$run" --steps $((stop + 20)) >"$LOGS/smoke_resume.log" 2>&1 && note resume ok || note resume fail
    [[ $(newest "$run") == $((stop + 20)) ]] && note resume_reaches_target ok || note resume_reaches_target fail
    "$PY" -m andrea verify "$run" && note verify_after_resume ok || note verify_after_resume fail
fi

# Determinism on the GPU: two identical runs, and a run stopped at 30 and resumed to 60, write the same bytes.
for name in a b c d e; do seed "$WORK/det_$name"; done
# a, b and the first half of c run side by side (deterministic kernels do not care who shares the GPU).
det() { train --run-dir "$WORK/det_$1" --steps "$2" --checkpoint-every 20 >"$LOGS/smoke_det_$1$2.log" 2>&1; }
det a 60 & pa=$!; det b 60 & pb=$!; det c 30 & pc=$!
wait $pa || note run_a fail; wait $pb || note run_b fail; wait $pc || note run_c30 fail
det c 60 || note run_c60 fail
sha256sum "$WORK"/det_?/step_000060.bin
cmp "$WORK/det_a/step_000060.bin" "$WORK/det_b/step_000060.bin" && note determinism_two_runs ok \
    || note determinism_two_runs fail
cmp "$WORK/det_a/step_000060.bin" "$WORK/det_c/step_000060.bin" && note resume_bit_exact ok \
    || note resume_bit_exact fail
# --kernels torch (the SDPA backward): reported, never counted. Equal here: docs/architecture.md may say so for this
# stack; different: its "curve, not the bytes" stands (cuda_paths says whether use_deterministic_algorithms would help).
torch_det() { train --run-dir "$WORK/det_$1" --steps 60 --checkpoint-every 20 --kernels torch \
    >"$LOGS/smoke_det_torch_$1.log" 2>&1; }
torch_det d & pd=$!; torch_det e & pe=$!
wait $pd && wait $pe && cmp -s "$WORK/det_d/step_000060.bin" "$WORK/det_e/step_000060.bin" \
    && echo "SMOKE torch_kernels_bytes_equal=yes" || echo "SMOKE torch_kernels_bytes_equal=no"
echo "SMOKE failures=$fails"
exit $((fails > 0))'

cuda_paths='set -uo pipefail
"$PY" bench/cuda_paths.py --json "$WORK/cuda_paths.json" --dir "$WORK" | tee "$WORK/cuda_paths.md"'

# Two ranks (ZeRO-1, NCCL) on two GPUs; skipped (exit 0, said in the log) on one. Rank 1 drives cuda:1 from the
# executor threads: the run ends 0 with every checkpoint valid only if they launch and fence on cuda:1.
dist_two_ranks='set -uo pipefail
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if ((gpus < 2)); then
    echo "DIST skipped: $gpus GPU (rank 1 needs cuda:1; NCCL refuses two ranks on one GPU)"
    exit 0
fi
run=$WORK/dist; mkdir -p "$run" && cp "$WORK/prep/tokenizer.json" "$run/" && cp -r "$WORK/prep/data" "$run/"
"$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m andrea train $SMOKE_ARGS --run-dir "$run" \
    --steps 30 --checkpoint-every 10 >"$LOGS/dist_torchrun.log" 2>&1
rc=$?
echo "DIST exit=$rc"
grep -E "rank [01] of 2|committed in|stopped at|Error|error" "$LOGS/dist_torchrun.log" | tail -12
"$PY" -m andrea verify "$run" && echo "DIST verify=ok" || { echo "DIST verify=fail"; rc=1; }
ls "$run"/step_*.bin 2>/dev/null | wc -l | sed "s/^/DIST checkpoints=/"
exit $rc'

kernels_bench='set -euo pipefail
"$PY" bench/kernels.py --json "$WORK/kernels.json" | tee "$OUT/kernels.md"'

train_bench='set -euo pipefail
"$PY" bench/train.py --json "$WORK/train.json" | tee "$OUT/train.md"'

ckpt120_bench='set -euo pipefail
"$PY" bench/checkpoint.py --preset andrea-120m --repeats 3 --json "$WORK/ckpt120.json" | tee "$OUT/ckpt120.md"'

# Caps sum past the budget on purpose: each takes what is left, so a slow early check costs the benchmarks
# at the end, never the correctness checks at the start.
[[ ${GPU_CHECK_SELFTEST:-0} == 1 ]] || run_check kernels_tests 240 "$kernels_tests"
[[ ${GPU_CHECK_SELFTEST:-0} == 1 ]] || run_check cuda_paths 90 "$cuda_paths"
run_check train_smoke 240 "$train_smoke"
[[ -f $WORK/trainer.pid ]] && TRAINER_PID=$(cat "$WORK/trainer.pid") && kill -KILL "$TRAINER_PID" 2>/dev/null || true
[[ ${GPU_CHECK_SELFTEST:-0} == 1 ]] || run_check dist_two_ranks 150 "$dist_two_ranks"
if [[ ${GPU_CHECK_SELFTEST:-0} != 1 ]]; then
    run_check kernels_bench 150 "$kernels_bench"
    run_check train_bench 200 "$train_bench"
    run_check ckpt120_bench 150 "$ckpt120_bench"
fi

# --- summary -----------------------------------------------------------------------------------------------
failed=0
{
    echo "# GPU check: $(sed -n 's/^device //p' "$OUT/env.txt" | head -1)"
    grep -E "^(torch|python) " "$OUT/env.txt" || true
    echo
    echo "| check | exit code | seconds |"
    echo "|---|---|---|"
    for row in "${RESULTS[@]}"; do
        read -r name rc secs <<<"$row"
        echo "| $name | $rc | $secs |"
        [[ $rc == 0 ]] || failed=1
    done
    echo
    echo "exit codes: 124/137 timed out, 125 not started (budget spent). Total $((SECONDS - START)) s."
    echo
    echo "## kernels_tests"
    tail -n 1 "$OUT/kernels_tests.txt" 2>/dev/null || echo "(no output)"
    grep -E "^(FAILED|ERROR) " "$OUT/kernels_tests.txt" 2>/dev/null | head -20 || true
    echo
    echo "## cuda_paths"
    cat "$WORK/cuda_paths.md" 2>/dev/null || echo "(no output)"
    echo
    echo "## train_smoke"
    grep "^SMOKE " "$OUT/train_smoke.txt" 2>/dev/null || echo "(no output)"
    echo
    echo "## dist_two_ranks"
    grep "^DIST " "$LOGS/dist_two_ranks.log" 2>/dev/null || echo "(no output)"
    echo
    "$PY" - "$WORK" <<'EOF' || echo "(figures unavailable)"
import json, os, sys
work = sys.argv[1]
def load(name):
    path = os.path.join(work, name)
    return json.load(open(path)) if os.path.exists(path) else None
k = load("kernels.json")
if k:
    print(f"## kernels_bench ({k['device']}, peak {k['peak_bandwidth_gbs']:.0f} GB/s, {k['bandwidth_source']})")
    rows = {(r["T"], r["D"], r["pass"], r["impl"]): r for r in k["attention"]}
    print("| T | D | pass | andrea TFLOP/s | SDPA flash TFLOP/s | ratio | fwd max err vs SDPA |")
    print("|---|---|---|---|---|---|---|")
    for (T, D, p, impl), r in sorted(rows.items()):
        if impl == "andrea" and (T, D, p, "sdpa-flash") in rows:
            s = rows[(T, D, p, "sdpa-flash")]
            print(f"| {T} | {D} | {p} | {r['tflops']:.0f} | {s['tflops']:.0f} | {r['tflops'] / s['tflops']:.2f} "
                  f"| {r['max_err']:.2e} |")
    print("\n| AdamW params | impl | ms | GB/s | % of peak |\n|---|---|---|---|---|")
    for r in k["adamw"]:
        print(f"| {r['params']:,} | {r['impl']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['pct_of_peak']:.0f}% |")
    print("\n| cross-entropy N x V | impl | ms fwd+bwd | GB/s | extra MiB | loss err |\n|---|---|---|---|---|---|")
    for r in k.get("cross_entropy", []):
        print(f"| {r['N']} x {r['V']} | {r['impl']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['extra_mib']:.0f} "
              f"| {r['max_err']:.1e} |")
    print("\n| LayerNorm N x C | impl | ms fwd+bwd | GB/s | max err |\n|---|---|---|---|---|")
    for r in k.get("layer_norm", []):
        print(f"| {r['N']} x {r['C']} | {r['impl']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['max_err']:.1e} |")
    print()
t = load("train.json")
if t:
    print("## train_bench\n| preset | subject | tokens/s | vs reference | MFU | first loss |\n|---|---|---|---|---|---|")
    for res in t["results"]:
        for r in res["rows"]:
            mfu = r.get("mfu")
            mfu = "-" if "mfu" not in r else ("unknown" if mfu is None else f"{100 * mfu:.1f}%")
            print(f"| {r['preset']} | {r['subject']} | {r['tokens_per_s']:,.0f} | {r['vs_reference']:.2f}x | {mfu} "
                  f"| {r['first_loss']:.5f} |")
    print()
EOF
    echo "## ckpt120_bench"
    grep -E "^\| (andrea|raw write|memcpy) |stall <=|throughput >=|overhead <=" "$OUT/ckpt120.md" 2>/dev/null \
        || echo "(no output)"
} >"$OUT/summary.md"
cat "$OUT/summary.md"
exit "$failed"
