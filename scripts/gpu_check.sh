#!/usr/bin/env bash
# GPU calibration and validation in one command (Libra sec. 3.3 / Figure 5, sec. 6.7).
#
#   bash scripts/gpu_check.sh [--budget-s N] [OUTPUT_DIR]   # from the repository root on a CUDA machine
#
# Output folder: the argument, else $OUT, else results/gpu/<device-slug>/ (e.g. results/gpu/nvidia-h200/).
# The whole run fits --budget-s seconds (default 300): each step runs in its own time box, cut to
# what is left of the budget, and writes its output folder when it finishes, so a step that runs out
# of time loses only itself. Steps (typical times on one H200):
#   0. install (pip install --no-deps -e . keeps the image's CUDA torch; no network) + environment
#      record (env.txt: versions, varlen_attn's signature)                              ~15 s, box 60 s
#   1. preflight: every CUDA kernel backend (flash-attn, aten-flash, torch-varlen) against plain
#      PyTorch on a tiny bottom-right causal GQA batch; the first that agrees runs every step
#      (falls back to --backend math, with smaller sizes, if none does, and says so)   ~10 s, box 45 s
#   2. libra-bench calibrate    (Figure 5 + measured profile.json)                       ~40 s, box 100 s
#   3. libra-bench kernel-sweep (per-call time over lengths 512..256K x 1,2,4,8,32 heads per call,
#      single / packed / mixed calls; its own --budget-s 110 skips what would not fit)  ~70 s, box 130 s
#   4. libra-bench sim-check    (cost model with the measured profile vs measured tile batches) box 60 s
#   5. libra-bench fidelity     (bf16 tiles vs a float64 reference, ratio to bf16 PyTorch), once per
#      backend that passed the preflight: fidelity/ (the chosen one), fidelity-<backend>/ box 45 s each
#   6. libra-bench tile-overhead (one 256K-setting worker's tiles as the runtime runs them vs one
#      varlen call, libra and libra-adaptive, planned with the measured profile)            box 60 s
#   7. summary.md              (every figure above, versions)
# Planning runs on the numpy paths (numba is hidden from the steps: its first-use JIT compilation
# would cost device time, and the image's numba is not the pinned one; the compiled kernels compute
# the same plans). A failed, timed-out or skipped step is recorded and the next one still runs; the
# script exits non-zero if any step failed. Without CUDA it refuses to run (exit 3) before doing
# anything. --cpu-smoke runs the same pipeline on CPU with tiny sizes (for CI-style checks of this
# script; the figures are NOT GPU figures).
set -euo pipefail

PY="${PYTHON:-python3}"
CPU_SMOKE=0
ARG_OUT=""
BUDGET=300
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) CPU_SMOKE=1 ;;
    --budget-s)
      if [ $# -lt 2 ] || ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$2" -lt 60 ]; then
        echo "gpu_check.sh: --budget-s needs a whole number of seconds >= 60" >&2; exit 2
      fi
      BUDGET="$2"; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) ARG_OUT="$1" ;;
  esac
  shift
done

if [ ! -f experiments/cli.py ] || [ ! -d libra ]; then
  echo "gpu_check.sh: run from the repository root (experiments/cli.py not found in $(pwd))" >&2
  exit 2
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

# ---- CUDA or refuse -------------------------------------------------------------------------
if [ "$CPU_SMOKE" = 0 ]; then
  CUDA_INFO="$("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo "torch not importable")"
  case "$CUDA_INFO" in
    *"devices 0"|"torch not importable") HAVE_CUDA=0 ;;
    *) HAVE_CUDA=1 ;;
  esac
  if [ "$HAVE_CUDA" = 0 ]; then
    echo "gpu_check.sh: CUDA is not available to $PY ($CUDA_INFO)." >&2
    echo "gpu_check.sh: this script needs a CUDA device; for a CPU smoke run use: bash scripts/gpu_check.sh --cpu-smoke DIR" >&2
    exit 3
  fi
  DEVICE=cuda
else
  DEVICE=cpu
fi

SLUG="$("$PY" -c "
import torch
from experiments.measured.gpu_common import device_info, device_slug
print(device_slug(device_info(torch.device('$DEVICE'))))" 2>/dev/null || echo unknown)"
if [ "$CPU_SMOKE" = 1 ]; then SLUG=cpu-smoke; fi
OUT_DIR="${ARG_OUT:-${OUT:-results/gpu/$SLUG}}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$(date +%s)
say "output folder: $OUT_DIR (device $DEVICE, slug $SLUG)"

# ---- install what is missing (never from the network) ---------------------------------------
if ! "$PY" -c 'import libra, experiments.cli' 2>/dev/null || ! "$PY" -m pip show libra-bench >/dev/null 2>&1; then
  say "installing the project: pip install --no-deps --no-build-isolation --no-index -e ."
  timeout 90 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
    || say "pip install failed (see log); running from the source tree via PYTHONPATH instead"
fi
MISSING="$("$PY" - <<'EOF'
import importlib.util
need = ["numpy", "pandas", "seaborn", "matplotlib", "click", "rich"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)"
if [ -n "$MISSING" ]; then
  say "missing Python packages: $MISSING"
  if [ -n "${WHEELHOUSE:-}" ] && [ -d "$WHEELHOUSE" ]; then
    say "installing them from WHEELHOUSE=$WHEELHOUSE (no index)"
    # shellcheck disable=SC2086
    timeout 90 "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" $MISSING >>"$LOG" 2>&1 || say "wheelhouse install failed"
  fi
  if ! "$PY" -c 'import rich' 2>/dev/null; then
    # rich only draws progress bars (every step runs with --no-progress); a no-op stand-in keeps
    # experiments.common.progress importable. Recorded in summary.md.
    SHIM="$OUT_DIR/.shim"
    mkdir -p "$SHIM/rich"
    : > "$SHIM/rich/__init__.py"
    cat > "$SHIM/rich/progress.py" <<'EOF'
"""No-op stand-in for rich.progress written by scripts/gpu_check.sh (rich is not installed)."""
class _Col:
    def __init__(self, *a, **k): pass
BarColumn = MofNCompleteColumn = TextColumn = TimeElapsedColumn = _Col
class Progress:
    def __init__(self, *a, **k): pass
    def __enter__(self): return self
    def __exit__(self, *exc): return False
    def add_task(self, *a, **k): return 0
    def advance(self, *a, **k): pass
EOF
    export PYTHONPATH="$PYTHONPATH:$(cd "$SHIM" && pwd)"
    say "rich missing: progress bars replaced by a no-op stand-in ($SHIM)"
  fi
fi

# ---- environment ------------------------------------------------------------------------------
{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  timeout 30 "$PY" - <<'EOF'
import inspect, platform, torch
print("python:", platform.python_version())
print("torch:", torch.__version__, "cuda:", torch.version.cuda)
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
try:
    from torch.nn.attention import varlen
    print("varlen_attn signature:", inspect.signature(varlen.varlen_attn))
    print("AuxRequest:", getattr(varlen, "AuxRequest", None))
except Exception as exc:  # recorded, not fatal: the backend resolution decides
    print("torch.nn.attention.varlen:", type(exc).__name__, exc)
try:
    import flash_attn
    print("flash_attn:", flash_attn.__version__)
except Exception as exc:
    print("flash_attn: not importable (", type(exc).__name__, ")")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
} > "$OUT_DIR/env.txt" 2>&1 || true
cat "$OUT_DIR/env.txt" | tee -a "$LOG"

# planning on the numpy paths (see the header): a stand-in module makes `import numba` fail
if [ "$CPU_SMOKE" = 0 ]; then
  NONUMBA="$OUT_DIR/.shim-nonumba"
  mkdir -p "$NONUMBA"
  echo 'raise ImportError("numba hidden by scripts/gpu_check.sh: planning runs on the numpy paths")' > "$NONUMBA/numba.py"
  export PYTHONPATH="$(cd "$NONUMBA" && pwd):$PYTHONPATH"
  say "numba hidden from the steps (planning on the numpy paths)"
fi

declare -A STATUS
FAILED=0
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run_step() {  # name, time box (s), command...: the box is cut to what is left of the budget
  local name="$1" box="$2"; shift 2
  local remain; remain=$(left)
  if [ "$remain" -lt 15 ]; then
    STATUS[$name]="SKIPPED: ${remain}s of the ${BUDGET}s budget left"; FAILED=1
    say "step $name: ${STATUS[$name]}"; return
  fi
  [ "$box" -gt "$remain" ] && box="$remain"
  local t0 rc=0
  t0=$(date +%s)
  say "step $name (time box ${box}s): $*"
  timeout --signal=TERM --kill-after=10 "$box" "$@" >>"$LOG" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then STATUS[$name]="ok (${dt}s)";
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then STATUS[$name]="TIMED OUT after ${dt}s (box ${box}s)"; FAILED=1;
  else STATUS[$name]="FAILED rc=$rc after ${dt}s (see gpu_check.log)"; FAILED=1; fi
  say "step $name: ${STATUS[$name]}"
}

# ---- 1. preflight: which kernel backends agree with plain PyTorch? ----------------------------------
PREFLIGHT="$(timeout 45 "$PY" - "$DEVICE" 2>>"$LOG" <<'EOF' || echo "preflight crashed or timed out"
import sys, torch
from libra.runtime.kernels import CUDA_BACKENDS, Segments, get_backend, resolve_backend_name
dev = torch.device(sys.argv[1])
names = list(CUDA_BACKENDS) if dev.type == "cuda" else [resolve_backend_name("auto", dev)]
dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
# bottom-right causal pieces (q_len < kv_len), whole samples, GQA 8 q / 2 kv heads
seg = Segments([96, 64, 200], [96, 160, 200])
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(seg.total_q, 8, 64, generator=g, device=dev).to(dt)
k, v = (torch.randn(seg.total_k, 2, 64, generator=g, device=dev).to(dt) for _ in range(2))
do = torch.randn_like(q)
ref = get_backend("math", dev)
ro, rl = ref.forward(*(x.float() for x in (q, k, v)), seg)
rgrads = ref.backward(*(x.float() for x in (do, q, k, v)), ro, rl, seg)
for name in names:
    try:
        be = get_backend(name, dev)
        o, l = be.forward(q, k, v, seg)
        grads = be.backward(do, q, k, v, o, l, seg)
        # relative max error: bf16 rounding gives ~1e-2, a wrong mask or head mapping gives ~1
        errs = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip((o, *grads), (ro, *rgrads))]
        lse = float((l.float().reshape(rl.shape) - rl).abs().max()) if l.numel() == rl.numel() else float("nan")
        ok = max(errs) < 0.05 and lse < 0.05
        print(f"{name} {'ok' if ok else 'bad'} rel_err(out,dq,dk,dv)={[round(e, 4) for e in errs]} lse_err={lse:.4f}")
    except Exception as exc:
        print(f"{name} broken {type(exc).__name__}: {str(exc)[:200]}")
EOF
)"
echo "$PREFLIGHT" > "$OUT_DIR/preflight.txt"
say "preflight: $(echo "$PREFLIGHT" | tr '\n' ';')"
GOOD="$(echo "$PREFLIGHT" | awk '$2 == "ok" {print $1}')"
BACKEND="$(echo "$GOOD" | head -n 1)"
if [ -n "$BACKEND" ]; then
  STATUS[preflight]="ok: $(echo "$GOOD" | tr '\n' ' ')agree with plain PyTorch; every step runs $BACKEND"
else
  BACKEND=math; GOOD=math; FAILED=1
  STATUS[preflight]="no fast backend agrees ($(echo "$PREFLIGHT" | tr '\n' ';')); falling back to --backend math"
fi

# ---- 2-6. the experiments ----------------------------------------------------------------------
CLI=("$PY" -m experiments.cli)
if [ "$CPU_SMOKE" = 1 ]; then
  CAL_ARGS=(--device cpu --quick)
  SWEEP_ARGS=(--device cpu --quick)
  SIM_ARGS=(--device cpu --quick)
  FID_ARGS=(--device cpu --quick)
  TILE_ARGS=(--device cpu --quick)
else
  CAL_ARGS=(--device cuda --lengths 1024,2048,4096,8192,16384,32768,65536 --heads 1,2,4,8,16,32 --q-heads 32
            --kv-heads 4 --head-dim 128 --heads-length 16384 --warmup 3 --repeats 10 --rotate 4 --copy-mb 2048)
  SWEEP_ARGS=(--device cuda --budget-s 110)
  SIM_ARGS=(--device cuda --seq-len 65536 --pool-size 2 --cp 4 --block-size 4096 --head-split 2 --pipeline-chunks 4
            --q-heads 32 --kv-heads 4 --head-dim 128 --windows 4 --warmup 2 --repeats 5 --rotate 2)
  FID_ARGS=(--device cuda --ref-dtype fp64 --seq-len 8192 --pool-size 2 --cp 2 --block-size 1024 --head-split 2
            --q-heads 16 --kv-heads 4 --head-dim 128 --windows 2)
  TILE_ARGS=(--device cuda --setting 256k --methods libra,libra-adaptive)
fi
if [ "$BACKEND" = math ] && [ "$CPU_SMOKE" = 0 ]; then
  # plain PyTorch materialises (heads, L, L) scores: keep whole documents at <= 8K tokens
  CAL_ARGS=(--device cuda --lengths 512,1024,2048,4096,8192 --heads 1,2,4,8,16,32 --q-heads 32 --kv-heads 4
            --head-dim 128 --heads-length 4096 --warmup 2 --repeats 5 --rotate 2 --copy-mb 2048)
  SWEEP_ARGS=(--device cuda --budget-s 60 --lengths 512,1024,2048,4096,8192 --packed-tokens 8192 --mixed-lengths 8192)
  SIM_ARGS=(--device cuda --seq-len 32768 --pool-size 2 --cp 4 --block-size 2048 --head-split 2 --pipeline-chunks 4
            --q-heads 32 --kv-heads 4 --head-dim 128 --windows 2 --warmup 1 --repeats 3 --rotate 1)
  TILE_ARGS=(--device cuda --dp 8 --cp 4 --seq-len 32768 --gbs 8 --methods libra,libra-adaptive)
fi
run_step calibrate 100 "${CLI[@]}" calibrate "${CAL_ARGS[@]}" --backend "$BACKEND" --no-progress --overwrite --out "$OUT_DIR/calibrate"
PROFILE="$OUT_DIR/calibrate/profile.json"
if [ ! -f "$PROFILE" ]; then
  PROFILE=h100-roce-v1
  say "no measured profile: sim-check and tile-overhead use the built-in $PROFILE (sim-check's errors then say little)"
fi
run_step kernel-sweep 130 "${CLI[@]}" kernel-sweep "${SWEEP_ARGS[@]}" --backend "$BACKEND" --no-progress --overwrite --out "$OUT_DIR/kernel-sweep"
run_step sim-check 60 "${CLI[@]}" sim-check "${SIM_ARGS[@]}" --backend "$BACKEND" --profile "$PROFILE" --no-progress --overwrite --out "$OUT_DIR/sim-check"
FID_STEPS=""
for be in $GOOD; do
  folder=fidelity; [ "$be" != "$BACKEND" ] && folder="fidelity-$be"
  FID_STEPS="$FID_STEPS $folder"
  run_step "$folder" 45 "${CLI[@]}" fidelity "${FID_ARGS[@]}" --backend "$be" --no-progress --overwrite --out "$OUT_DIR/$folder"
done
run_step tile-overhead 60 "${CLI[@]}" tile-overhead "${TILE_ARGS[@]}" --backend "$BACKEND" --profile "$PROFILE" --no-progress --overwrite --out "$OUT_DIR/tile-overhead"

# ---- 7. summary -----------------------------------------------------------------------------------
STATUS[total]="$(( $(date +%s) - START ))s wall of a ${BUDGET}s budget"
STATUS_FILE="$OUT_DIR/steps.tsv"
: > "$STATUS_FILE"
for k in preflight calibrate kernel-sweep sim-check $FID_STEPS tile-overhead total; do
  printf '%s\t%s\n' "$k" "${STATUS[$k]:-not run}" >> "$STATUS_FILE"
done
TITLE="GPU check ($SLUG)"
if [ "$CPU_SMOKE" = 1 ]; then TITLE="CPU smoke of scripts/gpu_check.sh (NOT GPU figures)"; fi
"${CLI[@]}" gpu-summary "$OUT_DIR" --title "$TITLE" >>"$LOG" 2>&1 || { say "summary failed"; FAILED=1; }
[ -f "$OUT_DIR/summary.md" ] && cat "$OUT_DIR/summary.md"
say "done in $(( $(date +%s) - START ))s; summary: $OUT_DIR/summary.md"
if [ "$FAILED" != 0 ]; then
  say "at least one step failed, was skipped or fell back; see $OUT_DIR/summary.md and $LOG"
  exit 1
fi
