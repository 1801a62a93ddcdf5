#!/usr/bin/env bash
# One prepared GPU check of the captured step, the frame transfer and the Triton reductions,
# for a bare one-GPU machine (an H100 or H200, no network) with a 10-minute limit. Run from
# anywhere inside the repository:
#
#     bash scripts/device-check.sh            # on the GPU machine
#     bash scripts/device-check.sh --dry-run  # on a CPU: the same plumbing, small sizes
#
# The whole run ends inside 8 minutes: every step gets its own timeout, cut to what is left
# of the budget, and a step that would start with under 10 seconds left is skipped. Steps,
# in order of importance (the first kernel compiles take about a minute; Triton caches them):
#   1. a fresh venv; its CUDA torch + triton come from the machine's image via a .pth file
#      (GPU machines here have no network), otherwise they are installed explicitly: from
#      carried wheels in .whl/ when present, else from the package index. The checkout is
#      imported through a temporary helios_logprobs/ namespace of links to its five folders
#      (no pip install, no build backend);
#   2. checkpoint: a random Qwen2 checkpoint with vocabulary 151,936 (scripts/device_check.py);
#   3. frame-transfer: tests/gpu/test_captured_step_gpu.py's FrameExecutor tests (pooled
#      pinned frames, memory_allocated flat over 1,000 copies, payload prefixes bit-equal to
#      the device frame, the copy stream after the producing event, the first read after the
#      transfer event, graph-pool bytes);
#   4. cuda-graphs: tests/gpu/test_cuda_graphs_gpu.py without --compile (the captured reduce
#      phase: served run equal to eager with no Triton compile after start-up, one graph
#      pool in the memory report, 1,000 replays flat, served frame copies only of the
#      requesting prefixes);
#   5. decode: tokens/s at batch 1 and 16, K=20 against none, eager and graphs, on the
#      step-2 checkpoint;
#   6. bench: python bench/reduction.py --backend triton (times, achieved bandwidth against a
#      device copy of the same bytes);
#   7. gpu-tests: the rest of tests/gpu (serving shapes against the reference, capture of the
#      prepared launches, the served reduce phase replayed 1,000 times, batch invariance,
#      weight broadcast);
#   8. --compile with graphs (the compiled forward's decode buckets and the compiled reduce
#      region captured; Inductor compiles first): its GPU test, then decode tokens/s;
#   9. select: the two GPU selection networks at 256 x 151,936 bf16 against
#      log_softmax+topk;
#  10. unit-triton-gpu: tests/unit/kernels/test_triton_reduction.py compiled for the GPU, in
#      whatever time is left (many small shapes, each its own compile).
# It ends with one table: each step, its status, its seconds and its figure. Everything
# printed also goes to $OUT/device-check.log ($OUT defaults to ./device-check-out). The exit
# status is non-zero if any step failed (a step skipped for time is not a failure).
#
# --dry-run (no GPU): the image's interpreter need not see a GPU and nothing is installed;
# the checkpoint has vocabulary 1,000, the GPU tests are collected (and skip), the bench runs
# the torch backend at one small shape, select runs under the Triton interpreter, decode
# replays the captured callables on the CPU; the --compile steps and the interpreter unit
# suite are skipped.

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        *) echo "helios: error: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-$ROOT/device-check-out}
rm -rf "$OUT/figures" "$OUT/steps"
mkdir -p "$OUT/figures" "$OUT/steps"
LOG="$OUT/device-check.log"
BUDGET_S=${BUDGET_S:-470}

main() {
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
START=$(date +%s)
FAILED=()
SUMMARY=()
step() { echo; echo "=== [$(($(date +%s) - START))s] $*"; }
record() { # record NAME STATUS SECONDS: the figure is the step's own, else pytest's
    local fig=""  # count line, else the last line the step printed
    if [ -f "$OUT/figures/$1" ]; then
        fig=$(head -n 1 "$OUT/figures/$1")
    elif [ -f "$OUT/steps/$1.log" ]; then
        fig=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$OUT/steps/$1.log" | tail -n 1)
        [ -z "$fig" ] && fig=$(grep -v '^\s*$' "$OUT/steps/$1.log" | tail -n 1)
    fi
    fig=$(printf '%s' "$fig" | sed -E 's/^[= ]+|[= ]+$//g')
    fig=${fig:0:110}
    SUMMARY+=("$(printf '%-16s %-12s %5ss  %s' "$1" "$2" "$3" "$fig")")
}
run() { # run NAME TIMEOUT_S CMD...: a failure is recorded, never stops the script
    local name=$1 limit=$2 began left
    shift 2
    left=$((BUDGET_S - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "--- $name skipped: ${left}s left of the ${BUDGET_S}s budget"
        record "$name" "skipped" 0
        return 0
    fi
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/steps/$name.log"
    local rc=${PIPESTATUS[0]}
    local status=ok
    if [ "$rc" -ne 0 ]; then
        echo "!!! $name failed (exit $rc)"
        FAILED+=("$name")
        status="FAILED ($rc)"
        [ "$rc" -eq 124 ] && status="TIMEOUT"
    fi
    record "$name" "$status" "$(($(date +%s) - began))"
    return 0
}

step "machine (dry run: $DRY_RUN)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
    || echo "no nvidia-smi"
uname -m

# ------------------------------------------------------------------------------ 1. venv
BASE_PY=${BASE_PY:-python3}
VENV=${VENV:-/tmp/helios-device-venv}
step "1. environment: venv $VENV (base interpreter: $(command -v "$BASE_PY"))"
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV" || { echo "cannot create a venv"; exit 2; }
PY="$VENV/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pip_install() { # the explicit install step: carried wheels first, else the index
    if [ -d "$ROOT/.whl" ]; then
        "$PY" -m pip install -q --no-index --find-links "$ROOT/.whl" "$@"
    else
        "$PY" -m pip install -q "$@"
    fi
}
if [ "$DRY_RUN" = 1 ] || "$BASE_PY" -c \
    'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    # The image's interpreter already holds torch and triton (a CUDA build on the GPU
    # machine): expose its site-packages to the venv, since nothing can be fetched there.
    "$BASE_PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$SITE/_image.pth"
    echo "using the image's torch/triton via $SITE/_image.pth"
else
    echo "installing a CUDA torch and triton into the venv"
    pip_install torch triton || { echo "could not install torch/triton"; exit 2; }
fi
# module:package (the step's engine and its random checkpoints need the rest)
for pair in numpy:numpy pytest:pytest hypothesis:hypothesis safetensors:safetensors \
        msgpack:msgpack zmq:pyzmq tokenizers:tokenizers transformers:transformers; do
    mod=${pair%%:*} pkg=${pair#*:}
    "$PY" -c "import $mod" 2>/dev/null || { [ "$DRY_RUN" = 0 ] && pip_install "$pkg"; } \
        || echo "missing $pkg"
done
"$PY" - "$DRY_RUN" <<'EOF' || { echo "no usable torch"; exit 2; }
import sys

import torch
import triton

print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if sys.argv[1] == "0":
    assert torch.cuda.is_available(), "torch does not see a GPU"
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
EOF
# The import namespace without an install: helios_logprobs/<folder> links to the checkout's
# five folders. The CPU native extension is not built; the GPU path does not use it.
PKG_ROOT=$(mktemp -d)
mkdir -p "$PKG_ROOT/helios_logprobs"
for folder in runtime ranks collectives kernels launch; do
    ln -s "$ROOT/$folder" "$PKG_ROOT/helios_logprobs/$folder"
done
export PYTHONPATH="$PKG_ROOT:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import helios_logprobs.ranks.step.cuda_graphs as m; print("imports from", m.__file__)' \
    || { echo "the helios_logprobs namespace does not import"; exit 2; }

CHECK=("$PY" scripts/device_check.py)
DRY=()
VOCAB=151936
if [ "$DRY_RUN" = 1 ]; then DRY=(--dry-run); VOCAB=1000; fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

# ------------------------------------------------------------------------------ 2-9
CKPT="$OUT/checkpoint-$VOCAB"
step "2. a random checkpoint with vocabulary $VOCAB"
run checkpoint 90 "${CHECK[@]}" --figures "$OUT/figures/checkpoint" checkpoint "$CKPT" --vocab "$VOCAB"

step "3. the frame transfer"
FRAME_TESTS="frame_cop or producing_event or graph_pool"
run frame-transfer 90 "${PYTEST[@]}" tests/gpu/test_captured_step_gpu.py -k "$FRAME_TESTS"

step "4. the captured decode step"
run cuda-graphs 120 "${PYTEST[@]}" tests/gpu/test_cuda_graphs_gpu.py --durations=5 \
    -k "not compiled"

step "5. decode tokens/s, K=20 against none: eager and graphs"
run decode 120 "${CHECK[@]}" --figures "$OUT/figures/decode" decode --model "$CKPT" \
    --modes eager,graphs "${DRY[@]}"

step "6. bench/reduction.py"
if [ "$DRY_RUN" = 1 ]; then
    run bench 60 "$PY" bench/reduction.py --backend torch --rows 4 --vocab 1000 --repeat 2 \
        --figures "$OUT/figures/bench"
else
    run bench 60 "$PY" bench/reduction.py --backend triton --figures "$OUT/figures/bench"
fi

step "7. the rest of tests/gpu"
run gpu-tests 200 "${PYTEST[@]}" tests/gpu --durations=10 \
    --ignore=tests/gpu/test_cuda_graphs_gpu.py -k "not ($FRAME_TESTS)"

step "8. --compile with graphs: the GPU test and decode tokens/s"
if [ "$DRY_RUN" = 1 ]; then
    echo "--- skipped in a dry run (a CPU compile of the forward takes minutes)"
    record graphs-compiled "skipped" 0
    record decode-compiled "skipped" 0
else
    run graphs-compiled 150 "${PYTEST[@]}" tests/gpu/test_cuda_graphs_gpu.py -k compiled
    run decode-compiled 150 "${CHECK[@]}" --figures "$OUT/figures/decode-compiled" decode \
        --model "$CKPT" --modes compiled-graphs
fi

step "9. selection networks"
run select 60 "${CHECK[@]}" --figures "$OUT/figures/select" select "${DRY[@]}"

step "10. unit Triton tests compiled for the GPU (no interpreter)"
if [ "$DRY_RUN" = 1 ]; then
    echo "--- skipped in a dry run (the interpreter suite is the CPU's own)"
    record unit-triton-gpu "skipped" 0
else
    run unit-triton-gpu 400 "${PYTEST[@]}" tests/unit/kernels/test_triton_reduction.py -x \
        --durations=5
fi

# ------------------------------------------------------------------------------ summary
step "summary"
printf '%-16s %-12s %6s  %s\n' step status time figure
printf '%s\n' "${SUMMARY[@]}"
echo "total $(($(date +%s) - START))s of a ${BUDGET_S}s budget"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "device check: all steps passed"
    exit 0
fi
echo "device check: FAILED steps: ${FAILED[*]}"
exit 1
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
