#!/usr/bin/env bash
# One prepared GPU check of the Triton reductions, for a bare one-GPU machine (an H200) with
# a 10-minute limit. Run from anywhere inside the repository:
#
#     bash scripts/device-check.sh
#
# Steps (each with its own timeout so the whole script ends inside ~9.5 minutes; the first
# kernel compiles take about a minute, Triton caches them for the later steps):
#   1. a fresh venv; its CUDA torch + triton come from the machine's image when that has a
#      working one (GPU machines here have no network), otherwise they are installed
#      explicitly: from carried wheels in .whl/ when present, else from the package index
#      (set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL to a CUDA wheel index for a CUDA build);
#   2. tests/gpu (serving shapes against the reference, no allocation after the first call,
#      CUDA-graph capture);
#   3. python bench/reduction.py --backend triton (times, ratio vs baseline, bandwidth);
#   4. a timing of the two GPU selection networks (tl.topk vs max-extraction) at 256 x
#      151,936 bf16, against log_softmax + topk on the full row;
#   5. tests/unit/kernels/test_triton_reduction.py compiled for the GPU (no interpreter), last, in
#      the time that is left (its many small shapes each compile their own kernels).
# Everything printed also goes to $OUT/device-check.log ($OUT defaults to
# ./device-check-out). The exit status is non-zero if any step failed.

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT"
LOG="$OUT/device-check.log"

main() {
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
START=$(date +%s)
FAILED=()
step() { echo; echo "=== [$(($(date +%s) - START))s] $*"; }
run() { # run NAME TIMEOUT_S CMD...: record a failure instead of stopping
    local name=$1 limit=$2
    shift 2
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "!!! $name failed (exit $rc)"
        FAILED+=("$name")
    fi
    return 0
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
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
if "$BASE_PY" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
    # The image's interpreter already holds a CUDA torch and triton: expose its
    # site-packages to the venv (a .pth file), since nothing can be fetched on this machine.
    "$BASE_PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$SITE/_image.pth"
    echo "using the image's CUDA torch/triton via $SITE/_image.pth"
else
    echo "installing a CUDA torch and triton into the venv"
    pip_install torch triton || { echo "could not install torch/triton"; exit 2; }
fi
for mod in numpy pytest hypothesis; do
    "$PY" -c "import $mod" 2>/dev/null || pip_install "$mod" || echo "missing $mod"
done
"$PY" - <<'EOF' || { echo "no usable CUDA torch"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch does not see a GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
EOF
# The import namespace without an install (nothing can be fetched here, so no build
# backend): helios_logprobs/<folder> links to the checkout's five folders. The CPU native
# extension is not built; the GPU path does not use it.
PKG_ROOT=$(mktemp -d)
mkdir -p "$PKG_ROOT/helios_logprobs"
for folder in runtime ranks collectives kernels launch; do
    ln -s "$ROOT/$folder" "$PKG_ROOT/helios_logprobs/$folder"
done
export PYTHONPATH="$PKG_ROOT:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------------------ 2. GPU tests
step "2. tests/gpu"
run gpu-tests 240 "$PY" -m pytest tests/gpu -q -p no:cacheprovider --durations=10

# ------------------------------------------------------------------------------ 3. bench
step "3. bench/reduction.py --backend triton"
if [ -f bench/reduction.py ]; then
    run bench 75 "$PY" bench/reduction.py --backend triton
else
    echo "!!! bench/reduction.py is missing"
    FAILED+=(bench-missing)
fi

# ------------------------------------------------------------------------------ 4. selects
step "4. selection networks at 256 x 151,936 bf16"
run select-timing 60 "$PY" - <<'EOF'
import torch
from triton.testing import do_bench

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.triton.backend import PreparedReduction
from helios_logprobs.kernels.triton.common import SELECT_EXTRACT, SELECT_TOPK

rows, vocab = 256, 151_936
dev = torch.device("cuda")
torch.manual_seed(0)
logits = (torch.randn(rows, vocab, device=dev) * 3).to(torch.bfloat16)
chosen = torch.randint(0, vocab, (rows,), device=dev, dtype=torch.int32)
ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=dev)
counts = torch.zeros(rows, dtype=torch.int32, device=dev)
out = torch.empty(rows, PAYLOAD_WORDS, dtype=torch.int32, device=dev)
read = 2 * rows * vocab * logits.element_size()  # launches 1 and 3 each read the row
base = do_bench(lambda: torch.log_softmax(logits.float(), dim=-1).topk(20, dim=-1))
print(f"baseline log_softmax(fp32) + topk: {base * 1e3:8.1f} us")
results = {}
for name, select in (("topk", SELECT_TOPK), ("extract", SELECT_EXTRACT)):
    prepared = PreparedReduction(rows, vocab, torch.bfloat16, dev, select=select)
    for frac in (1.0, 0.125, 0.0):
        flags = (torch.arange(rows, device=dev) < int(rows * frac)).to(torch.int32)
        ms = do_bench(lambda: prepared(logits, chosen, ids, counts, flags, 20, vocab, out))
        gbs = read * frac / (ms * 1e-3) / 1e9
        print(f"select={name:8s} flagged={frac:5.3f}: {ms * 1e3:8.1f} us  "
              f"{gbs:7.1f} GB/s  x{base / ms:5.2f} vs baseline")
        results[(name, frac)] = out.clone() if frac == 1.0 else None
same = torch.equal(results[("topk", 1.0)], results[("extract", 1.0)])
print("topk and extract payloads identical:", same)
assert same
EOF

# ------------------------------------------------------------------------------ 5. unit
# Last, with whatever time is left of ~9.5 minutes: many small shapes, each its own compile.
LEFT=$((570 - ($(date +%s) - START)))
[ $LEFT -lt 60 ] && LEFT=60
step "5. unit Triton tests compiled for the GPU (no interpreter), ${LEFT}s left"
run unit-triton-gpu "$LEFT" "$PY" -m pytest tests/unit/kernels/test_triton_reduction.py -q -x \
    -p no:cacheprovider --durations=5

# ------------------------------------------------------------------------------ summary
step "summary"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "device check: all steps passed"
    exit 0
fi
echo "device check: FAILED steps: ${FAILED[*]}"
exit 1
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
