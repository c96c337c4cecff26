#!/usr/bin/env bash
# The GPU checks that CI cannot run, in one call on the lent GPU machine: the cuda-marked
# tests, the differential padding fuzzer and the model zoos (transformers: fp32, and bf16 for
# the language models; models that are not transformers: fp32 and bf16), run side by side
# (the GPU is shared by correctness jobs only; nothing here is timed). Logs and JSON go to
# $OUT/verify.tgz; the summary is printed.
#
#   OUT=/tmp/out bash benchmarks/gpu_verify.sh [seconds per job, default 500]
#   ONLY="pytest_graphs zoo_a" OUT=/tmp/out bash benchmarks/gpu_verify.sh 240   # named jobs only
#
# Every job at once is about 40 processes: on a 16-core host most outlast a 440 s limit. Within
# one 10-minute call, name at most about 15 jobs with ONLY, or spread the jobs over several GPUs
# of one machine with GPUS (device ids; the jobs take them in turn, in the order below), whose
# logs then still come back as one archive:
#   GPUS="0 1 2 3" OUT=/tmp/out bash benchmarks/gpu_verify.sh 400
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the logs}
mkdir -p "$OUT"
LIMIT=${1:-500}
LOGS=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# SKIP_INSTALL=1: installed already (several instances at once, one per GPU, must not race).
[[ -n ${SKIP_INSTALL:-} ]] || python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1
# timm and diffusers for the second zoo: the GPU machine has no network, so their wheels come
# in .whl/ (downloaded beside the checkout, carried with it); without them those rows skip.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-index .whl/*.whl >>"$LOGS/install.log" 2>&1
fi

read -ra DEVICES <<<"${GPUS:-}"
STARTED=0
job() {  # job NAME COMMAND...: run in the background under the time limit, log to $LOGS/NAME.log
  local name=$1; shift
  if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then return; fi
  local env=()
  if ((${#DEVICES[@]})); then  # the next GPU in turn
    local device=${DEVICES[STARTED % ${#DEVICES[@]}]}
    env=(env CUDA_VISIBLE_DEVICES="$device")
    echo "$name gpu $device" >>"$LOGS/devices.txt"
  fi
  STARTED=$((STARTED + 1))
  (timeout "$LIMIT" "${env[@]}" "$@" >"$LOGS/$name.log" 2>&1; echo "$name exit $?" >>"$LOGS/status.txt") &
}

# The cuda tests in shards, so that none outlasts the limit (the 2-GPU tests skip on one GPU).
PYTEST=(python3 -m pytest -q -m cuda -p no:cacheprovider)
SHARD_HF=(tests/test_hf_generate.py tests/test_hf_full_graph.py tests/breakable/test_transformers.py)
SHARD_GRAPHS=(tests/test_backend.py tests/run/test_full_graph.py tests/run/test_recovery.py tests/build/test_compile_sizes.py)
# The cuda tests that each fix of a model family brings (training, host tensors, split symbols, plans),
# in two shards: as one, they outlasted a 460 s limit on a 2-GPU host beside the other jobs.
SHARD_MODELS_A=(tests/test_training.py tests/test_host_tensors.py tests/test_padding.py tests/test_output_aliases.py)
SHARD_MODELS_B=(tests/passes tests/run/test_replay_plan.py)
job pytest_hf "${PYTEST[@]}" "${SHARD_HF[@]}"
job pytest_graphs "${PYTEST[@]}" "${SHARD_GRAPHS[@]}"
job pytest_models_a "${PYTEST[@]}" "${SHARD_MODELS_A[@]}"
job pytest_models_b "${PYTEST[@]}" "${SHARD_MODELS_B[@]}"
job pytest_rest "${PYTEST[@]}" tests --ignore=tests/test_model_zoo.py --ignore=tests/test_fuzz.py \
  $(printf -- '--ignore=%s ' "${SHARD_HF[@]}" "${SHARD_GRAPHS[@]}" "${SHARD_MODELS_A[@]}" "${SHARD_MODELS_B[@]}")
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
# The model zoo: every architecture runs batch 1, 3, 4, 1 (encoders 1, 3, 8, 1 items) on one
# compiled model. About 7 language models a job (each compiles 3 sizes), state-space
# decoders 5 (their scans unroll into many pieces).
ZOO=(python3 benchmarks/model_zoo.py --device cuda)
job zoo_a "${ZOO[@]}" --json "$LOGS/zoo_a.json" --models llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3
job zoo_b "${ZOO[@]}" --json "$LOGS/zoo_b.json" --models phi,phi3,stablelm,olmo2,cohere,granite,starcoder2
job zoo_c "${ZOO[@]}" --json "$LOGS/zoo_c.json" --models gpt2,gptj,gpt_neox,opt,falcon,bloom,cohere2,lfm2
job zoo_moe_a "${ZOO[@]}" --json "$LOGS/zoo_moe_a.json" --models mixtral,qwen2_moe,qwen3_moe,olmoe,granitemoe
job zoo_moe_b "${ZOO[@]}" --json "$LOGS/zoo_moe_b.json" --models phimoe,deepseek_v3,llama4,gpt_oss,qwen3_next
job zoo_ssm_a "${ZOO[@]}" --json "$LOGS/zoo_ssm_a.json" --models mamba,mamba2,falcon_mamba,jamba,zamba
job zoo_ssm_b "${ZOO[@]}" --json "$LOGS/zoo_ssm_b.json" \
  --models zamba2,bamba,falcon_h1,recurrent_gemma,granitemoehybrid
job zoo_seq2seq "${ZOO[@]}" --json "$LOGS/zoo_seq2seq.json" --models seq2seq
job zoo_encoders "${ZOO[@]}" --json "$LOGS/zoo_encoders.json" --models encoder,vision,audio
# The same zoo in float32 with the eager piece compiler (FX code in the CUDA graphs): the split
# and the graphs alone, without Inductor's rounding.
ZOO_EAGER=("${ZOO[@]}" --compiler eager)
job zoo_eager_decoder "${ZOO_EAGER[@]}" --json "$LOGS/zoo_eager_decoder.json" --models decoder
job zoo_eager_moe_ssm "${ZOO_EAGER[@]}" --json "$LOGS/zoo_eager_moe_ssm.json" --models moe,ssm
job zoo_eager_encoders "${ZOO_EAGER[@]}" --json "$LOGS/zoo_eager_encoders.json" --models seq2seq,encoder,vision,audio
# The language models in bfloat16 with the eager piece compiler (FX code in the CUDA graphs).
ZOO_BF16=("${ZOO[@]}" --dtype bfloat16 --compiler eager)
job zoo_bf16_decoder "${ZOO_BF16[@]}" --json "$LOGS/zoo_bf16_decoder.json" --models decoder
job zoo_bf16_moe "${ZOO_BF16[@]}" --json "$LOGS/zoo_bf16_moe.json" --models moe
job zoo_bf16_ssm "${ZOO_BF16[@]}" --json "$LOGS/zoo_bf16_ssm.json" --models ssm
# Fused linears in three parts: as one job it outlasted the limit on a slow host.
job zoo_fused_a "${ZOO[@]}" --json "$LOGS/zoo_fused_a.json" --fuse-sibling-linears \
  --models llama,qwen2,gemma2,phi3,olmo2,granite
job zoo_fused_b "${ZOO[@]}" --json "$LOGS/zoo_fused_b.json" --fuse-sibling-linears \
  --models gptj,opt,mixtral,qwen2_moe,qwen3_moe
job zoo_fused_c "${ZOO[@]}" --json "$LOGS/zoo_fused_c.json" --fuse-sibling-linears \
  --models olmoe,granitemoe,phimoe,deepseek_v3,encoder,vision
# One-row linears as Inductor reductions (Config.matvec_as_reduction): bf16 decoders, Inductor pieces.
ZOO_MATVEC=("${ZOO[@]}" --dtype bfloat16 --compiler inductor --matvec-as-reduction)
job zoo_matvec_a "${ZOO_MATVEC[@]}" --json "$LOGS/zoo_matvec_a.json" --models llama,mistral,qwen2,qwen3,gemma2,phi3,olmo2
job zoo_matvec_b "${ZOO_MATVEC[@]}" --json "$LOGS/zoo_matvec_b.json" --models gpt2,opt,falcon,mixtral,qwen3_moe
# bf16 through Inductor under the default Config: batch-1 linears take cgcompile::skinny_linear.
ZOO_SKINNY=("${ZOO[@]}" --dtype bfloat16 --compiler inductor)
job zoo_skinny_a "${ZOO_SKINNY[@]}" --json "$LOGS/zoo_skinny_a.json" --models llama,mistral,qwen2,qwen3,gemma2,phi3,olmo2
job zoo_skinny_b "${ZOO_SKINNY[@]}" --json "$LOGS/zoo_skinny_b.json" --models gpt2,opt,falcon,mixtral,qwen3_moe
# The zoo of models that are not transformers (benchmarks/model_zoo_beyond.py): 1, 3, 8, 1 items
# on one compiled model. The ResNet-50 detectors compile slowly (about 100 s for the four
# sizes), so two detectors a job. The GNNs also run plain torch.compile (--reference inductor):
# errors it shares are "upstream" rows (docs/upstream.md), not failures.
BEYOND=(python3 benchmarks/model_zoo_beyond.py --device cuda)
job zoo_beyond_images "${BEYOND[@]}" --json "$LOGS/zoo_beyond_images.json" \
  --models classification,video,optical_flow
job zoo_beyond_segmentation "${BEYOND[@]}" --json "$LOGS/zoo_beyond_segmentation.json" --models segmentation
job zoo_beyond_detect_a "${BEYOND[@]}" --json "$LOGS/zoo_beyond_detect_a.json" \
  --models fasterrcnn_mobilenet,maskrcnn_resnet50 --reference inductor  # Mask R-CNN: docs/upstream.md
job zoo_beyond_detect_b "${BEYOND[@]}" --json "$LOGS/zoo_beyond_detect_b.json" --models retinanet_resnet50,ssdlite320
job zoo_beyond_audio "${BEYOND[@]}" --json "$LOGS/zoo_beyond_audio.json" --models torchaudio
job zoo_beyond_graph "${BEYOND[@]}" --json "$LOGS/zoo_beyond_graph.json" --models torch_geometric \
  --reference inductor
job zoo_beyond_timm_diffusers "${BEYOND[@]}" --json "$LOGS/zoo_beyond_timm_diffusers.json" --models timm,diffusers
# In bfloat16 with eager pieces, as the transformers zoo; not the detectors (near-tied scores
# reorder their boxes at bfloat16's precision).
BEYOND_BF16=("${BEYOND[@]}" --dtype bfloat16 --compiler eager)
job zoo_beyond_bf16_images "${BEYOND_BF16[@]}" --json "$LOGS/zoo_beyond_bf16_images.json" \
  --models classification,segmentation,video,optical_flow
job zoo_beyond_bf16_rest "${BEYOND_BF16[@]}" --json "$LOGS/zoo_beyond_bf16_rest.json" \
  --models torchaudio,torch_geometric,timm,diffusers
wait
sort "$LOGS/status.txt"
# cgcompile never launches an empty graph and says so at INFO; torch's warning means one slipped through.
echo "torch 'The CUDA Graph is empty' warnings in the logs: $(cat "$LOGS"/*.log | grep -c 'The CUDA Graph is empty')"
for log in "$LOGS"/*.log; do echo "== $(basename "$log")"; tail -n 4 "$log"; done
tar -czf "$OUT/verify.tgz" -C "$LOGS" .
