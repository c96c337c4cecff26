#!/usr/bin/env bash
# The GPU checks that CI cannot run, in one call on the lent GPU machine: the cuda-marked
# tests, the differential padding fuzzer and the fp32 model zoo, run side by side (the GPU
# is shared by correctness jobs only; nothing here is timed). Logs and JSON go to
# $OUT/verify.tgz; the summary is printed.
#
#   OUT=/tmp/out bash benchmarks/gpu_verify.sh [seconds per job, default 500]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the logs}
LIMIT=${1:-500}
LOGS=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1

job() {  # job NAME COMMAND...: run in the background under the time limit, log to $LOGS/NAME.log
  local name=$1; shift
  (timeout "$LIMIT" "$@" >"$LOGS/$name.log" 2>&1; echo "$name exit $?" >>"$LOGS/status.txt") &
}

# The cuda tests in three shards, so that none outlasts the limit (the 2-GPU tests skip on one GPU).
PYTEST=(python3 -m pytest -q -m cuda -p no:cacheprovider)
SHARD_HF=(tests/test_cuda_hf.py tests/test_cuda_breakable_hf.py tests/test_hf_full_graph.py
          tests/test_hf_generate.py tests/test_breakable_hf.py)
SHARD_GRAPHS=(tests/test_cuda_backend.py tests/test_cuda_full_graph.py tests/test_cuda_recovery.py
              tests/test_cuda_compile_sizes.py)
job pytest_hf "${PYTEST[@]}" "${SHARD_HF[@]}"
job pytest_graphs "${PYTEST[@]}" "${SHARD_GRAPHS[@]}"
job pytest_rest "${PYTEST[@]}" tests --ignore=tests/test_model_zoo.py --ignore=tests/test_padding_fuzz.py \
  $(printf -- '--ignore=%s ' "${SHARD_HF[@]}" "${SHARD_GRAPHS[@]}")
job fuzz_eager python3 -m cgcompile.fuzz --cases 400 --seed 1000 --device cuda --compiler eager
job fuzz_inductor python3 -m cgcompile.fuzz --cases 40 --seed 2000 --device cuda --compiler inductor
job fuzz_full python3 -m cgcompile.fuzz --cases 200 --seed 3000 --device cuda --padding none --full-graph pieces
job fuzz_whole python3 -m cgcompile.fuzz --cases 20 --seed 4000 --device cuda --padding none --compiler inductor \
  --full-graph whole
job fuzz_fused python3 -m cgcompile.fuzz --cases 300 --seed 5000 --device cuda --padding none --full-graph pieces \
  --fuse-sibling-linears
job fuzz_breakable python3 -m cgcompile.fuzz --cases 400 --seed 6000 --device cuda --padding none --path breakable
# Walks of 8 sizes that return to earlier ones, on programs that keep state (views of what a call made)
# across calls: twice the calls of a plain case, so 250 cases a job to stay within the limit.
job fuzz_sequence_a python3 -m cgcompile.fuzz --cases 250 --seed 7000 --device cuda --compiler eager --sequence
job fuzz_sequence_b python3 -m cgcompile.fuzz --cases 250 --seed 7250 --device cuda --compiler eager --sequence
job fuzz_sequence_inductor python3 -m cgcompile.fuzz --cases 30 --seed 8000 --device cuda --compiler inductor \
  --sequence
job example_sq python3 examples/hf_static_generate.py --device cuda --compiler inductor --small-query-attention \
  --batch 3 --new-tokens 32
job zoo_a python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_a.json" \
  --models llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3,phi,phi3,stablelm
job zoo_b python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_b.json" \
  --models olmo2,cohere,granite,starcoder2,gpt2,gptj,gpt_neox,opt,falcon,bloom
job zoo_c python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_c.json" --models moe,seq2seq
job zoo_d python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_d.json" --models encoder,vision
# Fused linears in two halves: as one job it outlasted the limit on a slow host.
job zoo_fused_a python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_fused_a.json" --fuse-sibling-linears \
  --models llama,qwen2,gemma2,phi3,olmo2,granite
job zoo_fused_b python3 benchmarks/model_zoo.py --device cuda --json "$LOGS/zoo_fused_b.json" --fuse-sibling-linears \
  --models gptj,opt,moe,encoder,vision
wait
sort "$LOGS/status.txt"
# cgcompile never launches an empty graph and says so at INFO; torch's warning means one slipped through.
echo "torch 'The CUDA Graph is empty' warnings in the logs: $(cat "$LOGS"/*.log | grep -c 'The CUDA Graph is empty')"
for log in "$LOGS"/*.log; do echo "== $(basename "$log")"; tail -n 4 "$log"; done
tar -czf "$OUT/verify.tgz" -C "$LOGS" .
