#!/usr/bin/env bash
# One prepared GPU check of the Triton reductions, for a bare one-GPU machine (an H200) with
# a 10-minute limit. Run from anywhere inside the repository:
#
#     bash scripts/device-check.sh
#
# Steps (each with its own timeout so the whole script ends inside 8 minutes; the first
# kernel compiles take about a minute, Triton caches them for the later steps):
#   1. a fresh venv; its CUDA torch + triton come from the machine's image when that has a
#      working one (GPU machines here have no network), otherwise they are installed
#      explicitly: from carried wheels in .whl/ when present, else from the package index
#      (set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL to a CUDA wheel index for a CUDA build);
#   2. the frame-transfer path first (tests/gpu/test_captured_step_gpu.py: FrameExecutor's
#      pooled pinned frames, memory_allocated flat over 1,000 copies, payload prefixes
#      bit-equal to the device frame, the copy stream waiting on the producing event and the
#      first read on the transfer event, graph-pool bytes), then the rest of tests/gpu
#      (serving shapes against the reference, no allocation after the first call, CUDA-graph
#      capture, the served reduce phase replayed 1,000 times against eager with
#      memory_allocated flat, no Triton compile while serving);
#   3. python bench/reduction.py --backend triton (times, ratio vs baseline, bandwidth);
#   4. a timing of the two GPU selection networks (tl.topk vs max-extraction) at 256 x
#      151,936 bf16, against log_softmax + topk on the full row;
#   5. decode tokens/s, logprobs=20 against none, batch 1 and 16, on a random checkpoint with
#      vocabulary 151,936 that it writes itself (eager: the step is not captured yet);
#   6. tests/unit/kernels/test_triton_reduction.py compiled for the GPU (no interpreter), last, in
#      the time that is left (its many small shapes each compile their own kernels).
# It ends with one table: each step, its status and its seconds.
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
SUMMARY=()
run() { # run NAME TIMEOUT_S CMD...: record a failure instead of stopping
    local name=$1 limit=$2 began
    shift 2
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    local status=ok
    if [ $rc -ne 0 ]; then
        echo "!!! $name failed (exit $rc)"
        FAILED+=("$name")
        status="FAILED ($rc)"
    fi
    SUMMARY+=("$(printf '%-18s %-12s %5ss' "$name" "$status" "$(($(date +%s) - began))")")
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
# module:package (the step's engine and its random checkpoints need the rest)
for pair in numpy:numpy pytest:pytest hypothesis:hypothesis safetensors:safetensors \
        msgpack:msgpack zmq:pyzmq tokenizers:tokenizers transformers:transformers; do
    mod=${pair%%:*} pkg=${pair#*:}
    "$PY" -c "import $mod" 2>/dev/null || pip_install "$pkg" || echo "missing $pkg"
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
step "2. tests/gpu: the frame transfer, then the rest"
FRAME_TESTS="frame_cop or producing_event or graph_pool"
run frame-transfer 90 "$PY" -m pytest tests/gpu/test_captured_step_gpu.py -q -p no:cacheprovider \
    -k "$FRAME_TESTS"
run gpu-tests 200 "$PY" -m pytest tests/gpu -q -p no:cacheprovider --durations=10 \
    -k "not ($FRAME_TESTS)"

# ------------------------------------------------------------------------------ 3. bench
step "3. bench/reduction.py --backend triton"
if [ -f bench/reduction.py ]; then
    run bench 60 "$PY" bench/reduction.py --backend triton
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

# ------------------------------------------------------------------------------ 5. decode
step "5. decode tokens/s on a random 151,936-vocabulary checkpoint, K=20 against none"
run decode-151936 90 "$PY" - <<'EOF'
import tempfile
from pathlib import Path

from bench.decode import time_batch
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.config import RuntimeConfig
from tests.checkpoints import write_qwen2

model_dir = write_qwen2(Path(tempfile.mkdtemp()) / "qwen2-151936", vocab_size=151_936)
config = RuntimeConfig(model_dir=model_dir, device="cuda", capacity=16, max_model_len=256,
                       reduction_backend="triton")
engine = build_engine(config, load_rank(config, None)).start()
try:
    time_batch(engine, 2, 8, 20)
    print(f"{'batch':>5} {'none tok/s':>10} {'K=20 tok/s':>10} {'ratio':>6}")
    for batch in (1, 16):
        none = max(time_batch(engine, batch, 32, None) for _ in range(2))
        k20 = max(time_batch(engine, batch, 32, 20) for _ in range(2))
        print(f"{batch:>5} {none:>10.1f} {k20:>10.1f} {k20 / none:>6.3f}")
finally:
    engine.shutdown()
EOF

# ------------------------------------------------------------------------------ 6. unit
# Last, with whatever time is left of 8 minutes: many small shapes, each its own compile.
LEFT=$((470 - ($(date +%s) - START)))
[ $LEFT -lt 30 ] && LEFT=30
step "6. unit Triton tests compiled for the GPU (no interpreter), ${LEFT}s left"
run unit-triton-gpu "$LEFT" "$PY" -m pytest tests/unit/kernels/test_triton_reduction.py -q -x \
    -p no:cacheprovider --durations=5

# ------------------------------------------------------------------------------ summary
step "summary"
printf '%-18s %-12s %6s\n' step status time
printf '%s\n' "${SUMMARY[@]}"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "device check: all steps passed"
    exit 0
fi
echo "device check: FAILED steps: ${FAILED[*]}"
exit 1
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
