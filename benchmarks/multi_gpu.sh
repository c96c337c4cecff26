#!/usr/bin/env bash
# The multi-GPU checks of docs/parallel.md on N local GPUs (N=2 or 4), within one time budget:
#   N=2 OUT=/tmp/out bash benchmarks/multi_gpu.sh
#   N=4 OUT=/tmp/out bash benchmarks/multi_gpu.sh
# Steps, most important first (STEPS="a b ..." picks some; the default is every step for N):
#   tests          pytest -m cuda tests/parallel (2 ranks each)
#   all_reduce     one captured all-reduce on N ranks, NCCL against the fast path
#   tp_8b_n2_auto  8B decode step, TP=2 and TP=1 (rank 0), batch 1 and 8, fast all-reduce
#   tp_8b_n2_unfused  the TP=2 step with Config.fuse_all_reduce_norm off (each all-reduce, residual
#                  add and RMS norm apart), beside tp_8b_n2_auto's fused one
#   tp_8b_n2_cublas  the TP=2 and TP=1 steps with Config.skinny_linears off (one-row linears on
#                  cuBLAS), beside tp_8b_n2_auto's
#   tp_8b_n2_mmattn  the TP=2 and TP=1 steps with Config.decode_attention_kernel off (full-sq's
#                  attention as batched matmuls), beside tp_8b_n2_auto's decode attention kernel
#   tp_8b_n4_auto  (N=4) the same at TP=4: with the step above, TP=1/2/4 side by side
#   tp_8b_n2_fold, tp_8b_n4_fold (N=4)  the TP=N steps with Config.fuse_linear_all_reduce on (the
#                  product before each fused all-reduce publishes its row itself), beside the auto
#                  steps' unfolded ones
#   tp_8b_n4_heads (N=4) the TP=4 steps with the LM head split by vocabulary and replicated, side by
#                  side in one run (--tp-head both), and TP=1
#   tp_8b_n4_mmattn  (N=4) the TP=4 and TP=1 steps with Config.decode_attention_kernel off
#   tp_8b_n4_unfused  (N=4) the TP=4 step unfused
#   tp_8b_n4_cublas  (N=4) the TP=4 and TP=1 steps with Config.skinny_linears off
#   tp_70b_n4      (N=4) 70B-class shape at TP=4 (each rank builds its shard), against the
#                  per-rank weight-bytes floor
#   hf_tp_n2       transformers tp_plan="auto" Llama of the 8B shape, 8 layers (a 32-layer
#                  checkpoint takes minutes to save and load), bf16: TP=2 with
#                  Config.all_reduce auto and nccl against the same model on one GPU
#   tp_8b_n2_matvec  the TP=2 full graph and TP=1 at batch 1 with Config.matvec_as_reduction
#                  (one-row linears as Inductor reductions; plain-tensor shards)
#   tp_8b_n4_matvec, tp_70b_n4_matvec  (N=4) the same at TP=4, and the 70B class's full graph
#   tp_8b_n4_pdl   (N=4) tp_8b_n4_matvec with TORCHINDUCTOR_ENABLE_PDL=1
#   hf_fold_n2     the same with Config.fuse_linear_all_reduce on and off side by side (fast
#                  all-reduce, spec guards dropped; FOLD_ORDER="off,on" runs the default, unfolded variant first)
#   hf_kernels_n2  the same model's decode step by kernel class on each rank, TP=2 and one GPU
#   hf_profile_n2  the same, with cProfile's top functions of the compiled decode calls at TP=2 and on
#                  one GPU (where a DTensor model's extra host time per call goes)
#   hf_check_n2    the same at a small shape in fp32: tokens match eager (torch.nn's module guards kept
#                  and skipped)
#   hf_guards_n2   the same model with Dynamo's guards on torch.nn's own modules kept and skipped
#                  (--module-guards both; skipping is torch's unsafe guard filter), TP=2 and one GPU
#   tp_kernels_n2, tp_kernels_n4 (N=4), tp_kernels_70b_n4 (N=4)  the `TensorParallelDecoder` full graph's
#                  step (small-query attention, batch 1) by kernel class on every rank, against the
#                  rank's floor, with the GPU's idle time between kernels (tp_profile.py --classes)
#   tp_8b_n2_nccl  the TP=2 step with Config.all_reduce="nccl"
#   hf_tp_n4, tp_8b_n4_nccl   (N=4) the tp_plan benchmark at TP=4; the TP=4 step on NCCL
#   pp_8b_n2       8B pipeline, 2 stages, each micro-batch the batch one GPU runs best (of
#                  16..128), against that GPU alone
#   tppp_8b_n4     (N=4) the same pipeline with each stage tensor parallel over 2 GPUs
# The TP steps time the piecewise default and the full graph with small-query attention
# (--tp-variants full-sq), TP=N and TP=1 side by side.
# BUDGET (seconds, default 540) bounds the whole run: each step runs under `timeout` of its
# own limit or of what is left, and is skipped with less than 45 s left, so one invocation
# ends within about 9 minutes; cold compiles make the later steps of a full list fall off,
# so split the list over invocations with STEPS (same OUT). Logs and JSON go to $OUT; a
# summary table ends the output. NVLink multicast stays off.
set -u
N=${N:-2}
OUT=${OUT:-/tmp/cgcompile-multi-gpu}
PY=${PY:-python}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
declare -A STATUS
ORDER=()

TORCHRUN=("$PY" -m torch.distributed.run --standalone)
TP8B=(benchmarks/distributed_bench.py --models 8b --batches 1,8 --parts tp --tp-variants cgcompile,full-sq,tp1
      --steps 20 --warmup 3)
TP8B_TP=(benchmarks/distributed_bench.py --models 8b --batches 1,8 --parts tp --tp-variants cgcompile,full-sq
         --steps 20 --warmup 3 --all-reduce auto)  # TP=N only
PP8B=(benchmarks/distributed_bench.py --models 8b --pp-batches 16,32,64,128 --steps 20 --warmup 3)
# One-row linears as Inductor reductions: batch 1 only (batch 8 keeps cuBLAS), the full graph
# at TP=N beside TP=1's piecewise and full graph.
TP8B_MATVEC=(benchmarks/distributed_bench.py --models 8b --batches 1 --parts tp --tp-variants full-sq,tp1
             --steps 20 --warmup 3 --all-reduce auto --matvec-as-reduction)
HF=(benchmarks/hf_tp_bench.py --shape 8b --layers 8 --tokens 32 --repeats 3 --spec-guards both)

run() {  # run NAME LIMIT COMMAND...: under min(LIMIT, budget left) seconds, output to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  ORDER+=("$name")
  local left=$((BUDGET - SECONDS))
  if ((left < 45)); then STATUS[$name]="skipped: ${left}s of the budget left"; echo "== $name: ${STATUS[$name]}"; return; fi
  ((limit > left)) && limit=$left
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - start))s$( ((rc == 124 || rc == 137)) && echo " (timed out at ${limit}s)")"
  echo "== $name: ${STATUS[$name]}"
  tail -n 8 "$OUT/$name.log"
}

step() {  # step NAME: run it if STEPS names it (or STEPS is unset)
  [[ -z "${STEPS:-}" || " $STEPS " == *" $1 "* ]]
}

step tests && run tests 400 "$PY" -m pytest -q -m cuda tests/parallel -p no:cacheprovider
step all_reduce && run all_reduce 90 "${TORCHRUN[@]}" --nproc-per-node "$N" benchmarks/all_reduce_bench.py \
    --json "$OUT/all_reduce.json"
step tp_8b_n2_auto && run tp_8b_n2_auto 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B[@]}" --all-reduce auto \
    --json "$OUT/tp_8b_n2_auto.json"
step tp_8b_n2_unfused && run tp_8b_n2_unfused 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B_TP[@]}" \
    --no-fuse-norm --json "$OUT/tp_8b_n2_unfused.json"
step tp_8b_n2_fold && run tp_8b_n2_fold 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B_TP[@]}" \
    --fuse-linear --json "$OUT/tp_8b_n2_fold.json"
step tp_8b_n2_cublas && run tp_8b_n2_cublas 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B[@]}" --all-reduce auto \
    --no-skinny --json "$OUT/tp_8b_n2_cublas.json"
step tp_8b_n2_mmattn && run tp_8b_n2_mmattn 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B[@]}" --all-reduce auto \
    --no-decode-attention-kernel --json "$OUT/tp_8b_n2_mmattn.json"
step tp_8b_n2_matvec && run tp_8b_n2_matvec 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B_MATVEC[@]}" \
    --json "$OUT/tp_8b_n2_matvec.json"
if ((N >= 4)); then
  step tp_8b_n4_auto && run tp_8b_n4_auto 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B[@]}" --all-reduce auto \
      --json "$OUT/tp_8b_n4_auto.json"
  step tp_8b_n4_fold && run tp_8b_n4_fold 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B_TP[@]}" \
      --fuse-linear --json "$OUT/tp_8b_n4_fold.json"
  step tp_8b_n4_heads && run tp_8b_n4_heads 240 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B[@]}" --all-reduce auto \
      --tp-head both --json "$OUT/tp_8b_n4_heads.json"
  step tp_8b_n4_unfused && run tp_8b_n4_unfused 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B_TP[@]}" \
      --no-fuse-norm --json "$OUT/tp_8b_n4_unfused.json"
  step tp_8b_n4_cublas && run tp_8b_n4_cublas 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B[@]}" --all-reduce auto \
      --no-skinny --json "$OUT/tp_8b_n4_cublas.json"
  step tp_8b_n4_mmattn && run tp_8b_n4_mmattn 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B[@]}" --all-reduce auto \
      --no-decode-attention-kernel --json "$OUT/tp_8b_n4_mmattn.json"
  step tp_70b_n4 && run tp_70b_n4 240 "${TORCHRUN[@]}" --nproc-per-node 4 benchmarks/distributed_bench.py \
      --models 70b --batches 1,8 --parts tp --tp-variants cgcompile,full-sq --steps 20 --warmup 3 \
      --json "$OUT/tp_70b_n4.json"
  step tp_8b_n4_matvec && run tp_8b_n4_matvec 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B_MATVEC[@]}" \
      --json "$OUT/tp_8b_n4_matvec.json"
  step tp_70b_n4_matvec && run tp_70b_n4_matvec 240 "${TORCHRUN[@]}" --nproc-per-node 4 benchmarks/distributed_bench.py \
      --models 70b --batches 1 --parts tp --tp-variants full-sq --steps 20 --warmup 3 --matvec-as-reduction \
      --json "$OUT/tp_70b_n4_matvec.json"
  # Programmatic dependent launch between Inductor's kernels (Hopper): a kernel's launch and
  # prologue overlap the previous kernel's tail; cuBLAS and collective kernels take no part.
  step tp_8b_n4_pdl && run tp_8b_n4_pdl 200 env TORCHINDUCTOR_ENABLE_PDL=1 "${TORCHRUN[@]}" --nproc-per-node 4 \
      "${TP8B_MATVEC[@]}" --json "$OUT/tp_8b_n4_pdl.json"
fi
step pp_8b_n2 && run pp_8b_n2 240 "${TORCHRUN[@]}" --nproc-per-node 2 "${PP8B[@]}" --parts pp --json "$OUT/pp_8b_n2.json"
if ((N >= 4)); then
  step tppp_8b_n4 && run tppp_8b_n4 240 "${TORCHRUN[@]}" --nproc-per-node 4 "${PP8B[@]}" --parts tppp --tp 2 \
      --json "$OUT/tppp_8b_n4.json"
fi
step hf_tp_n2 && run hf_tp_n2 300 "${TORCHRUN[@]}" --nproc-per-node 2 "${HF[@]}" --json "$OUT/hf_tp_n2.json"
step hf_fold_n2 && run hf_fold_n2 300 "${TORCHRUN[@]}" --nproc-per-node 2 "${HF[@]}" --all-reduce auto \
    --spec-guards dropped --fuse-linear "${FOLD_ORDER:-both}" --json "$OUT/hf_fold_n2.json"
step hf_profile_n2 && run hf_profile_n2 300 "${TORCHRUN[@]}" --nproc-per-node 2 "${HF[@]}" --all-reduce auto --profile --guard-probe \
    --repeats 1
step hf_kernels_n2 && run hf_kernels_n2 240 "${TORCHRUN[@]}" --nproc-per-node 2 "${HF[@]}" --all-reduce auto --kernels \
    --spec-guards dropped --repeats 1
step hf_check_n2 && run hf_check_n2 150 "${TORCHRUN[@]}" --nproc-per-node 2 benchmarks/hf_tp_bench.py \
    --shape small --check --tokens 24 --repeats 1 --module-guards both --json "$OUT/hf_check_n2.json"
step tp_8b_n2_nccl && run tp_8b_n2_nccl 200 "${TORCHRUN[@]}" --nproc-per-node 2 "${TP8B[@]}" --all-reduce nccl \
    --json "$OUT/tp_8b_n2_nccl.json"
step hf_guards_n2 && run hf_guards_n2 300 "${TORCHRUN[@]}" --nproc-per-node 2 benchmarks/hf_tp_bench.py \
    --shape 8b --layers 8 --tokens 32 --repeats 3 --all-reduce auto --spec-guards dropped --module-guards both \
    --json "$OUT/hf_guards_n2.json"
step tp_kernels_n2 && run tp_kernels_n2 200 "${TORCHRUN[@]}" --nproc-per-node 2 benchmarks/tp_profile.py \
    --model 8b --batch 1 --variant full-sq --classes
if ((N >= 4)); then
  step tp_kernels_n4 && run tp_kernels_n4 200 "${TORCHRUN[@]}" --nproc-per-node 4 benchmarks/tp_profile.py \
      --model 8b --batch 1 --variant full-sq --classes
  step tp_kernels_70b_n4 && run tp_kernels_70b_n4 240 "${TORCHRUN[@]}" --nproc-per-node 4 benchmarks/tp_profile.py \
      --model 70b --batch 1 --variant full-sq --classes
  step hf_tp_n4 && run hf_tp_n4 300 "${TORCHRUN[@]}" --nproc-per-node 4 "${HF[@]}" --json "$OUT/hf_tp_n4.json"
  step tp_8b_n4_nccl && run tp_8b_n4_nccl 200 "${TORCHRUN[@]}" --nproc-per-node 4 "${TP8B[@]}" --all-reduce nccl \
      --json "$OUT/tp_8b_n4_nccl.json"
fi

echo
echo "== summary (N=$N, ${SECONDS}s of a ${BUDGET}s budget, logs in $OUT)"
for name in "${ORDER[@]}"; do printf '%-14s %s\n' "$name" "${STATUS[$name]}"; done
for name in "${ORDER[@]}"; do
  log="$OUT/$name.log"
  [[ -f $log ]] || continue
  echo "-- $name"
  case $name in
    tests) grep -h "passed\|failed" "$log" | tail -n 1 ;;
    all_reduce) sed -n '/^group choice/,$p' "$log" | head -n 12 ;;
    tp_kernels_*) grep -h -A 8 "^per step" "$log" ;;
    tp_*) grep -h "batch\|device_copy_gbs" "$log" | grep -v '^{"model' | tail -n 8 ;;
    pp_*|tppp_*) grep -h "tok/s" "$log" | tail -n 4 ;;
    hf_profile_*) grep -h "== replay" "$log"; grep -h -A 14 "== profile" "$log" | cut -c1-160 ;;
    hf_kernels_*) grep -h "ms/token"  "$log"; grep -h -A 9 "== kernels" "$log" ;;
    hf_*) grep -h "ms/token\|tokens match\|all-reduce \|saved" "$log" | tail -n 9 ;;
  esac
done
