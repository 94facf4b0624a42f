#!/usr/bin/env bash
# One visit to the GPU machine: the GPU test tier, compute-sanitizer, and benchmarks.
# Usage: scripts/gpu_visit.sh [kernels] [tests[=p1,p2]] [real[=<pytest -k expr>]] [targets[=<regex>]]
#                             [startup] [mla-cascade]
#                             [sanitize[=p1,p2]] [sanitize-real=<tool>:<pytest -k expr>]
#                             [lossless[=<pytest -k expr>]] [check] [mutations-gpu]
#                             [bench=<pytest -k expr>] [bench-before=<pytest -k expr>] ...
# `kernels` installs the real attention kernels staged by scripts/gpu_kernels.sh (or finds them
# installed) and puts them on PYTHONPATH for the stages after it; once it has, a skipped
# real-kernel test fails the visit. Full logs go under $OUT (or ./.device-out); a short table is
# printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary=()
# The sharded stages' per-shard logs and junit files: outside $OUT, which brings back a limited
# number of files (a call cut short would otherwise crowd out the other stages' results); each
# such stage merges its shards into one log under $OUT.
SHARDS=${TMPDIR:-/tmp}/specmeta-shards

python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
PY

kernels=0
# The lossless loops' GPU tests: the plain model's, the hybrid model's, the MLA model's.
LOSSLESS_GPU="test_lossless_gpu or test_lossless_hybrid_gpu or test_lossless_mla_gpu"
skips() {  # skipped tests in a junit XML file
  python3 -c "import sys, xml.etree.ElementTree as E; r=E.parse(sys.argv[1]).getroot(); print(sum(int(s.get('skipped', 0)) for s in r.iter('testsuite')))" "$1" 2>/dev/null || echo "?"
}
junit() {  # "tests failed skipped" summed over junit XML files (a missing file adds nothing)
  python3 - "$@" <<'PY'
import sys, xml.etree.ElementTree as E
t = f = s = 0
for p in sys.argv[1:]:
    try:
        root = E.parse(p).getroot()
    except (OSError, E.ParseError):
        continue
    for c in root.iter("testcase"):
        t += 1
        f += c.find("failure") is not None or c.find("error") is not None
        s += c.find("skipped") is not None
print(t, f, s)
PY
}
for stage in "$@"; do
  case "$stage" in
    kernels)
      if [ ! -d "${TARGET:-/tmp/specmeta-kernels}" ]; then
        bash scripts/gpu_kernels.sh install > "$OUT/kernels_install.log" 2>&1
      fi
      eval "$(bash scripts/gpu_kernels.sh env)"
      if python3 -c "import flash_attn.cute, flashinfer" 2> "$OUT/kernels_import.log"; then
        kernels=1
        python3 - <<'PY' | tee -a "$OUT/env.txt"
from importlib.metadata import version
print("kernels: " + ", ".join(f"{p} {version(p)}" for p in ("flash-attn-4", "flashinfer-python", "nvidia-cutlass-dsl")))
PY
        summary+=("kernels: installed and importable")
      else
        tail -n 5 "$OUT/kernels_import.log"
        summary+=("kernels: FAILED to import (see kernels_import.log)")
      fi
      ;;
    real|real=*)
      sel=${stage#real}; sel=${sel#=}
      # test_real_kernels.py and every tests/metadata/test_*_real.py (one per kernel family),
      # sharded over REAL_WORKERS processes (default 1), shard w on GPU w mod (GPUs), each with
      # a few CPU threads: on one H200 host, 3 shards run the 815 tests in 5.3 min beside the
      # lossless shards.
      real_files=$(ls tests/metadata/test_real_kernels.py tests/metadata/test_*_real.py 2>/dev/null)
      ids=$(python3 -m pytest -q --collect-only $real_files ${sel:+-k "$sel"} 2>/dev/null | grep '::')
      gpus=$(nvidia-smi -L | grep -c '^GPU')
      n=${REAL_WORKERS:-1}
      rm -rf "$SHARDS"; mkdir -p "$SHARDS"  # this stage's shards only
      for w in $(seq 0 $((n - 1))); do
        shard=$(echo "$ids" | awk -v n="$n" -v w="$w" 'NR % n == w')
        [ -n "$shard" ] || continue
        CUDA_VISIBLE_DEVICES=$((w % gpus)) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
          SPECMETA_REAL_KERNEL_LOG="$SHARDS/real_errors_$w.json" timeout -s INT -k 20 "${REAL_TIMEOUT:-540}" \
          python3 -m pytest -q -rs $shard --junitxml="$SHARDS/real_$w.xml" > "$SHARDS/real_$w.log" 2>&1 &
      done
      wait
      tail -q -n 1 "$SHARDS"/real_[0-9]*.log
      read -r n_tests n_fail n_skip < <(junit "$SHARDS"/real_[0-9]*.xml)
      verdict=""
      [ "$kernels" = 1 ] && [ "$n_skip" != 0 ] && verdict=" FAILED: $n_skip real-kernel tests skipped"
      summary+=("real kernels: $(echo "$ids" | grep -c '::') collected, $n_tests finished in time, $n_fail failed, $n_skip skipped$verdict")
      cat "$SHARDS"/real_[0-9]*.log > "$OUT/real.log"
      python3 -c "import glob, json, sys; d = {}; [d.update(json.load(open(p))) for p in glob.glob(sys.argv[1])]; d and json.dump(d, open(sys.argv[2], 'w'), indent=1)" \
        "$SHARDS/real_errors_*.json" "$OUT/real_errors.json"  # the shards' kernel errors, one file
      ;;
    sanitize-real=*)
      spec=${stage#sanitize-real=}; tool=${spec%%:*}; sel=${spec#*:}
      # --report-api-errors no: CuTe DSL probes optional driver entry points
      # (cuGetProcAddress answers "invalid argument"); those are not memory errors.
      # SANITIZER_OPTS adds options, e.g. "--check-api-memory-access no" for initcheck over
      # copies of attention outputs that CuTe kernels write with TMA stores (not tracked).
      timeout 540 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        --report-api-errors no ${SANITIZER_OPTS:-} \
        python3 -m pytest -q -x tests/metadata/test_real_kernels.py -k "$sel" \
        > "$OUT/sanitize_$tool.log" 2>&1
      rc=$?
      tail -n 8 "$OUT/sanitize_$tool.log"
      summary+=("compute-sanitizer $tool ($sel): rc=$rc; $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_$tool.log" | tail -n 1) $(grep -E 'passed|failed' "$OUT/sanitize_$tool.log" | tail -n 1)")
      ;;
    tests|tests=*)
      # The lossless loops' GPU cases (the plain, hybrid and MLA models') are the `lossless`
      # stage's, sharded there; the rest of the tier fits one call.
      paths=${stage#tests}; paths=${paths#=}; paths=${paths//,/ }
      timeout 480 python3 -m pytest -q -rs ${paths:-tests} -k "not ($LOSSLESS_GPU)" \
        --junitxml="$OUT/tests.xml" 2>&1 \
        | tee "$OUT/tests.log" | tail -n 25
      n_real=$(grep -cE "SKIPPED.*(test_real_kernels|_real\.py)" "$OUT/tests.log")
      verdict=""
      [ "$kernels" = 1 ] && [ "$n_real" != 0 ] && verdict=" FAILED: real-kernel tests skipped"
      summary+=("tests: $(tail -n 1 "$OUT/tests.log")$verdict")
      ;;
    lossless|lossless=*)
      # The loops' GPU tests, sharded over LOSSLESS_WORKERS processes (default 4 a GPU: the
      # tiny models leave a GPU mostly idle and each run is host-bound), shard w on GPU
      # w mod (GPUs), each stopped after LOSSLESS_TIMEOUT seconds; each shard writes its own
      # log and junit file. A shard out of time gets SIGINT, so pytest still writes its junit
      # file and summary (the tests finished until then count); the files in C order, so the
      # plain model's tests come first.
      sel=${stage#lossless}; sel=${sel#=}
      ids=$(LC_ALL=C python3 -m pytest -q --collect-only $(LC_ALL=C; echo tests/testing/test_lossless*.py) \
        -k "($LOSSLESS_GPU)${sel:+ and ($sel)}" 2>/dev/null | grep '::')
      gpus=$(nvidia-smi -L | grep -c '^GPU')
      n=${LOSSLESS_WORKERS:-$((4 * gpus))}
      rm -rf "$SHARDS"; mkdir -p "$SHARDS"  # this stage's shards only
      for w in $(seq 0 $((n - 1))); do
        shard=$(echo "$ids" | awk -v n="$n" -v w="$w" 'NR % n == w')
        [ -n "$shard" ] || continue
        # A few threads a shard: torch's default (one per core) in every shard oversubscribes
        # the host many times over and runs all of them slower.
        CUDA_VISIBLE_DEVICES=$((w % gpus)) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
          timeout -s INT -k 20 "${LOSSLESS_TIMEOUT:-560}" \
          python3 -m pytest -q -rs -s $shard --junitxml="$SHARDS/lossless_$w.xml" \
          > "$SHARDS/lossless_$w.log" 2>&1 &
      done
      wait
      tail -q -n 1 "$SHARDS"/lossless_[0-9]*.log
      read -r n_tests n_fail n_skip < <(junit "$SHARDS"/lossless_[0-9]*.xml)
      summary+=("lossless gpu: $(echo "$ids" | grep -c '::') collected, $n_tests finished in time, $n_fail failed, $n_skip skipped")
      # One log comes back, not one per shard (a visit brings back a limited number of files).
      cat "$SHARDS"/lossless_[0-9]*.log > "$OUT/lossless.log"
      ;;
    check)
      # `specmeta check` on the GPU: every op, the runner and the builders against their
      # references, and the lossless loop through the real kernels (its MLA line through
      # FlashInfer MLA's kernel); 3 to 4 minutes on an H200.
      timeout "${CHECK_TIMEOUT:-400}" python3 -m specmeta check --device cuda > "$OUT/check.log" 2>&1
      rc=$?
      grep -A12 '^lossless_loop:' "$OUT/check.log"
      summary+=("specmeta check: rc=$rc; $(tail -n 1 "$OUT/check.log")")
      ;;
    mutations-gpu)
      # The gpu=True mutations of scripts/mutations.py, races the interpreter cannot show (the
      # move kernel without its barrier): each is planted in a copy of the tree and its GPU
      # tests run there. Every mutation "caught" (exit 0) is a pass; "missed" means the GPU
      # tier would not notice that bug. No racecheck stage: compute-sanitizer's racecheck sees
      # shared-memory hazards only, and the move's hazard is between global loads and stores.
      timeout 540 python3 scripts/mutations.py --gpu-only > "$OUT/mutations_gpu.log" 2>&1
      rc=$?
      tail -n 6 "$OUT/mutations_gpu.log"
      summary+=("mutations (gpu): rc=$rc; $(tail -n 1 "$OUT/mutations_gpu.log")")
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
    targets|targets=*)
      # The host targets (design §2.8) of this tree and of the base commit's package unpacked
      # into .before/ (carried), in one visit: two tables side by side. targets=<regex>: only
      # the rows whose names match.
      only=(); [[ $stage == targets=* ]] && only=(--only "${stage#targets=}")
      (cd .before && PYTHONPATH=$PWD timeout 280 python3 ../scripts/host_targets.py \
        --label before --out "$OUT/targets_before.json" "${only[@]}" \
        > "$OUT/targets_before.log" 2>&1)
      timeout 280 python3 scripts/host_targets.py --label after \
        --out "$OUT/targets_after.json" "${only[@]}" > "$OUT/targets_after.log" 2>&1
      python3 scripts/host_targets.py --table "$OUT/targets_before.json" \
        "$OUT/targets_after.json" | tee "$OUT/targets.md" | tail -n 45
      summary+=("host targets: $(tail -n 1 "$OUT/targets.md")")
      ;;
    mla-cascade)
      # Issue 39's production case: FlashInfer MLA's tree cascade beside per-branch lists.
      timeout 400 python3 scripts/mla_cascade.py --out "$OUT/mla_cascade.json" \
        > "$OUT/mla_cascade.log" 2>&1
      rc=$?
      tail -n 9 "$OUT/mla_cascade.log"
      summary+=("mla cascade: rc=$rc; $(grep -c '^| [0-9]' "$OUT/mla_cascade.log") steps timed")
      ;;
    startup)
      # A fresh process with empty caches, this tree and the base commit's (.before/).
      for tree in . .before; do
        (cd "$tree" && PYTHONPATH=$PWD timeout 200 python3 "$OLDPWD/scripts/startup.py" \
          --device cuda --warmup) | tee -a "$OUT/startup.jsonl"
      done
      summary+=("startup: $(tr '\n' ' ' < "$OUT/startup.jsonl")")
      ;;
    bench-before=*)
      # The same benchmarks on the package of another commit, unpacked into .before/ (carried):
      # before/after figures from one run on one machine.
      sel=${stage#bench-before=}
      name=$(echo "$sel" | tr -c 'A-Za-z0-9_' '_' | cut -c1-40)
      (cd .before && PYTHONPATH=$PWD timeout 540 python3 -m pytest -q bench/ -k "$sel" \
        --benchmark-json="$OUT/before_$name.json" --benchmark-columns=median \
        --benchmark-sort=name 2>&1 | tail -n 5 > "$OUT/before_$name.log")
      python3 -c "import json,sys; p=sys.argv[1]; d=json.load(open(p)); [b['stats'].pop('data', None) for b in d['benchmarks']]; json.dump(d, open(p, 'w'))" "$OUT/before_$name.json" 2>/dev/null
      cat "$OUT/before_$name.log"
      summary+=("bench (before) $sel: $(tail -n 1 "$OUT/before_$name.log")")
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
