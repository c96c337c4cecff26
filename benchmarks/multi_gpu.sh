#!/usr/bin/env bash
# The multi-GPU checks of docs/parallel.md on N local GPUs, each command under 8 minutes:
#   N=2 OUT=/tmp/out bash benchmarks/multi_gpu.sh
# 1. the GPU tests of tests/parallel (2 ranks each), 2. one captured all-reduce, NCCL against
# the fast path (benchmarks/all_reduce_bench.py), 3. the tensor-parallel decode step at the 8B
# shape, fast path against NCCL (Config.all_reduce) and TP=1 (benchmarks/distributed_bench.py).
# Logs and JSON go to $OUT; a short table ends the output. NVLink multicast stays off.
set -u
N=${N:-2}
OUT=${OUT:-/tmp/cgcompile-multi-gpu}
PY=${PY:-python}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
declare -A STATUS

run() {  # run NAME COMMAND...: under an 8-minute limit, output to $OUT/NAME.log
  local name=$1; shift
  local start=$SECONDS
  timeout 480 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - start))s"
  echo "== $name: ${STATUS[$name]}"
  tail -n 25 "$OUT/$name.log"
}

run tests "$PY" -m pytest -q -m cuda tests/parallel -p no:cacheprovider
run all_reduce "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/all_reduce_bench.py \
    --json "$OUT/all_reduce.json"
for AR in auto nccl; do
  run "tp_8b_$AR" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/distributed_bench.py \
      --models 8b --batches 1,8 --parts tp,allreduce --all-reduce "$AR" --json "$OUT/tp_8b_$AR.json"
done

echo
echo "== summary (N=$N, logs in $OUT)"
for name in tests all_reduce tp_8b_auto tp_8b_nccl; do printf '%-12s %s\n' "$name" "${STATUS[$name]:-not run}"; done
grep -h "passed\|failed" "$OUT/tests.log" | tail -n 1
sed -n '/^group choice/,$p' "$OUT/all_reduce.log"
for AR in auto nccl; do echo "-- TP step, all_reduce=$AR"; grep -h "/" "$OUT/tp_8b_$AR.log" | grep -v "^{" | tail -n 6; done
