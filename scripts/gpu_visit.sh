#!/usr/bin/env bash
# One visit to the GPU machine: the GPU test tier, compute-sanitizer, and benchmarks.
# Usage: scripts/gpu_visit.sh [tests[=p1,p2]] [sanitize[=p1,p2]] [bench=<pytest -k expr>] ...
# Full logs go under $OUT (or ./.device-out); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary=()

python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
PY

for stage in "$@"; do
  case "$stage" in
    tests|tests=*)
      paths=${stage#tests}; paths=${paths#=}; paths=${paths//,/ }
      timeout 480 python3 -m pytest -q ${paths:-tests} 2>&1 | tee "$OUT/tests.log" | tail -n 25
      summary+=("tests: $(tail -n 1 "$OUT/tests.log")")
      ;;
    sanitize|sanitize=*)
      paths=${stage#sanitize}; paths=${paths#=}; paths=${paths//,/ }
      # memcheck over the CPU-tier shapes running on CUDA (small, so the sanitizer is quick)
      timeout 420 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
 python3 -m pytest -q -x ${paths:-tests} -m "not gpu" -k "not property" -p no:cacheprovider \
        > "$OUT/sanitize.log" 2>&1
      rc=$?
      tail -n 15 "$OUT/sanitize.log"
      summary+=("compute-sanitizer memcheck: rc=$rc; $(grep -E 'ERROR SUMMARY' "$OUT/sanitize.log" | tail -n 1) $(grep -E 'passed|failed' "$OUT/sanitize.log" | tail -n 1)")
      ;;
    bench=*)
      sel=${stage#bench=}
      name=$(echo "$sel" | tr -c 'A-Za-z0-9_' '_' | cut -c1-40)
      timeout 540 python3 -m pytest -q bench/ -k "$sel" --benchmark-json="$OUT/bench_$name.json" \
        --benchmark-columns=median --benchmark-sort=name 2>&1 | tail -n 5 > "$OUT/bench_$name.log"
      # Raw per-round timings make the JSON too large to bring back; the medians stay.
      python3 -c "import json,sys; p=sys.argv[1]; d=json.load(open(p)); [b['stats'].pop('data', None) for b in d['benchmarks']]; json.dump(d, open(p, 'w'))" "$OUT/bench_$name.json" 2>/dev/null
      cat "$OUT/bench_$name.log"
      summary+=("bench $sel: $(tail -n 1 "$OUT/bench_$name.log")")
      ;;
  esac
done
for j in "$OUT"/bench_*.json; do
  [ -f "$j" ] && python3 -c "import sys, pathlib; from specmeta import report; print(report.markdown(report.load_rows([pathlib.Path(sys.argv[1])]), 'today'))" "$j" | tail -n 30
done
printf '%s\n' "${summary[@]}"
