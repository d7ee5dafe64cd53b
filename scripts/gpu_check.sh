#!/usr/bin/env bash
# GPU calibration and validation in one command (issue #7; Libra sec. 3.3 / Figure 5, sec. 6.7).
#
#   bash scripts/gpu_check.sh [OUTPUT_DIR]        # run from the repository root on a CUDA machine
#
# Output folder: the argument, else $OUT, else results/gpu/<device-slug>/ (e.g. results/gpu/nvidia-h200/).
# Steps and their time boxes (sized for one H200; the boxes add up to < 8 minutes including
# setup, and the expected run is about 2-3 minutes):
#   0. install (pip install --no-deps -e . keeps the image's CUDA torch; no network) + environment
#      record (env.txt: versions, varlen_attn's signature)                             ~30 s, box 30 s
#   1. preflight: the auto kernel backend against plain PyTorch on a tiny batch (falls back to
#      --backend math, with smaller sizes, if the fast backend is broken, and says so)  box  45 s
#   2. libra-bench calibrate   (Figure 5 + measured profile.json)                         box 120 s
#   3. libra-bench sim-check   (cost model with that profile vs measured tile batches)    box 120 s
#   4. libra-bench fidelity    (bf16 tiles vs fp32 reference, ratio to bf16 PyTorch)       box  90 s
#   5. summary.md              (Figure 5's curves, sim error, fidelity ratios, versions)
# A failed or timed-out step is recorded and the next one still runs; the script exits non-zero
# if any step failed. Without CUDA it refuses to run (exit 3) before doing anything.
# --cpu-smoke runs the same pipeline on CPU with tiny sizes (for CI-style checks of this script;
# the figures are NOT GPU figures).
set -euo pipefail

PY="${PYTHON:-python3}"
CPU_SMOKE=0
ARG_OUT=""
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) CPU_SMOKE=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) ARG_OUT="$arg" ;;
  esac
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
from experiments.gpu_common import device_info, device_slug
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
    # experiments.progress importable. Recorded in summary.md.
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

declare -A STATUS
FAILED=0
run_step() {  # name, time box (s), command...
  local name="$1" box="$2"; shift 2
  local t0=$(date +%s) rc=0
  say "step $name (time box ${box}s): $*"
  timeout --signal=TERM --kill-after=10 "$box" "$@" >>"$LOG" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then STATUS[$name]="ok (${dt}s)";
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then STATUS[$name]="TIMED OUT after ${dt}s (box ${box}s)"; FAILED=1;
  else STATUS[$name]="FAILED rc=$rc after ${dt}s (see gpu_check.log)"; FAILED=1; fi
  say "step $name: ${STATUS[$name]}"
}

# ---- 1. preflight: does the fast backend agree with plain PyTorch? ------------------------------
BACKEND=auto
PREFLIGHT="$(timeout 45 "$PY" - "$DEVICE" 2>>"$LOG" <<'EOF' || echo "preflight crashed or timed out"
import sys, torch
from libra.runtime.kernels import Segments, get_backend, resolve_backend_name
dev = torch.device(sys.argv[1])
name = resolve_backend_name("auto", dev)
dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
seg = Segments([96, 64, 200], [96, 160, 200])
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(seg.total_q, 8, 64, generator=g, device=dev).to(dt)
k, v = (torch.randn(seg.total_k, 2, 64, generator=g, device=dev).to(dt) for _ in range(2))
do = torch.randn_like(q)
try:
    be, ref = get_backend(name, dev), get_backend("math", dev)
    o, l = be.forward(q, k, v, seg)
    ro, rl = ref.forward(*(x.float() for x in (q, k, v)), seg)
    grads = be.backward(do, q, k, v, o, l, seg)
    rgrads = ref.backward(*(x.float() for x in (do, q, k, v)), ro, rl, seg)
    # relative max error: bf16 rounding gives ~1e-2, a wrong mask or head mapping gives ~1
    errs = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip((o, *grads), (ro, *rgrads))]
    ok = max(errs) < 0.05
    # lse is only handed back to the same backend's backward, so its layout is reported, not gated
    lf = l.float()
    lse = "n/a"
    for cand, lay in ((lf, "(heads, tokens)"), (lf.transpose(0, 1) if lf.dim() == 2 else lf, "(tokens, heads)")):
        if cand.shape == rl.shape:
            lse = f"{lay} err {float((cand - rl).abs().max()):.4f}"
            break
    print(f"{name} {'ok' if ok else 'bad'} rel_err(out,dq,dk,dv)={[round(e, 4) for e in errs]} lse {lse}")
except Exception as exc:
    print(f"{name} broken {type(exc).__name__}: {str(exc)[:300]}")
EOF
)"
say "preflight: $PREFLIGHT"
case "$PREFLIGHT" in
  *" ok "*) STATUS[preflight]="ok: $PREFLIGHT" ;;
  *) BACKEND=math; STATUS[preflight]="fast backend unusable ($PREFLIGHT); falling back to --backend math"; FAILED=1 ;;
esac

# ---- 2-4. the three experiments ------------------------------------------------------------------
CLI=("$PY" -m experiments.cli)
if [ "$CPU_SMOKE" = 1 ]; then
  CAL_ARGS=(--device cpu --quick)
  SIM_ARGS=(--device cpu --quick)
  FID_ARGS=(--device cpu --quick)
else
  CAL_ARGS=(--device cuda --lengths 1024,2048,4096,8192,16384,32768,65536 --heads 1,2,4,8,16,32 --q-heads 32
            --kv-heads 4 --head-dim 128 --heads-length 16384 --warmup 3 --repeats 10 --rotate 4 --copy-mb 2048)
  SIM_ARGS=(--device cuda --seq-len 65536 --pool-size 2 --cp 4 --block-size 4096 --head-split 2 --pipeline-chunks 4
            --q-heads 32 --kv-heads 4 --head-dim 128 --windows 4 --warmup 2 --repeats 5 --rotate 2)
  FID_ARGS=(--device cuda --seq-len 8192 --pool-size 2 --cp 2 --block-size 1024 --head-split 2 --q-heads 16
            --kv-heads 4 --head-dim 128 --windows 2)
fi
if [ "$BACKEND" = math ] && [ "$CPU_SMOKE" = 0 ]; then
  # plain PyTorch materialises (heads, L, L) scores: keep whole documents at <= 8K tokens
  CAL_ARGS=(--device cuda --lengths 512,1024,2048,4096,8192 --heads 1,2,4,8,16,32 --q-heads 32 --kv-heads 4
            --head-dim 128 --heads-length 4096 --warmup 2 --repeats 5 --rotate 2 --copy-mb 2048)
  SIM_ARGS=(--device cuda --seq-len 32768 --pool-size 2 --cp 4 --block-size 2048 --head-split 2 --pipeline-chunks 4
            --q-heads 32 --kv-heads 4 --head-dim 128 --windows 2 --warmup 1 --repeats 3 --rotate 1)
fi
run_step calibrate 120 "${CLI[@]}" calibrate "${CAL_ARGS[@]}" --backend "$BACKEND" --no-progress --overwrite --out "$OUT_DIR/calibrate"
PROFILE="$OUT_DIR/calibrate/profile.json"
if [ ! -f "$PROFILE" ]; then
  PROFILE=h100-roce-v1
  say "no measured profile: sim-check predicts with the built-in $PROFILE (its errors then say little)"
fi
run_step sim-check 120 "${CLI[@]}" sim-check "${SIM_ARGS[@]}" --backend "$BACKEND" --profile "$PROFILE" --no-progress --overwrite --out "$OUT_DIR/sim-check"
run_step fidelity 90 "${CLI[@]}" fidelity "${FID_ARGS[@]}" --backend "$BACKEND" --no-progress --overwrite --out "$OUT_DIR/fidelity"

# ---- 5. summary -----------------------------------------------------------------------------------
STATUS[total]="$(( $(date +%s) - START ))s wall"
STATUS_FILE="$OUT_DIR/steps.tsv"
: > "$STATUS_FILE"
for k in preflight calibrate sim-check fidelity total; do
  printf '%s\t%s\n' "$k" "${STATUS[$k]:-not run}" >> "$STATUS_FILE"
done
TITLE="GPU check ($SLUG)"
if [ "$CPU_SMOKE" = 1 ]; then TITLE="CPU smoke of scripts/gpu_check.sh (NOT GPU figures)"; fi
"$PY" - "$OUT_DIR" "$STATUS_FILE" "$TITLE" <<'EOF' || { say "summary failed"; FAILED=1; }
import sys
from pathlib import Path
from experiments.gpu_common import gpu_summary_markdown
out, title = Path(sys.argv[1]), sys.argv[3]
status = dict(line.split("\t", 1) for line in Path(sys.argv[2]).read_text().splitlines() if "\t" in line)
text = gpu_summary_markdown(out, status, title)
if (out / ".shim").exists():
    text += "\nNote: rich was not installed; a no-op progress stand-in was used.\n"
env = (out / "env.txt")
if env.exists():
    text += "\n## env.txt\n\n```\n" + env.read_text() + "```\n"
(out / "summary.md").write_text(text)
print(text)
EOF
say "done in $(( $(date +%s) - START ))s; summary: $OUT_DIR/summary.md"
if [ "$FAILED" != 0 ]; then
  say "at least one step failed or fell back; see $OUT_DIR/summary.md and $LOG"
  exit 1
fi
