#!/usr/bin/env bash
# Everything that needs two GPUs of one host, in one command from the repository root:
#
#     bash benchmarks/two_gpus.sh OUT_DIR
#
# the loss on a second GPU while the first is current (tests/gpu, both soft terms and the FP8 teacher), every rank
# of a vocabulary split raising where the ranks' calls differ or one rank raises on its own (a stale FP8 copy
# among them; tests/distributed over NCCL), Hugging Face models split for tensor parallelism against the whole
# models (tests/distributed/test_tensor_parallel_hf.py over NCCL; needs transformers) and their example's training
# steps (examples/tensor_parallel_hf.py), the vocabulary-parallel heads against the
# unsplit loss and their scaling over NCCL for both soft terms, and a few training steps of DDP and FSDP2 with
# each, and FSDP2's gradients and per-GPU peak memory against one process on the whole batch (benchmarks/fsdp2_parity.py).
# Logs and the vocabulary-parallel reports go to OUT_DIR.
set -euo pipefail
out=${1:?usage: bash benchmarks/two_gpus.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python -m pytest -m gpu -q tests/gpu/test_gpu_check.py -k second_gpu 2>&1 | tee "$out/second_gpu.log"
TRITON_INTERPRET=0 COSDISTILL_DISTRIBUTED_BACKEND=nccl python -m pytest -q tests/distributed/test_vocab_parallel.py \
  -k "refuses or stale_cached" -rs 2>&1 | tee "$out/every_rank_raises_nccl.log"
TRITON_INTERPRET=0 COSDISTILL_DISTRIBUTED_BACKEND=nccl python -m pytest -q tests/distributed/test_tensor_parallel_hf.py \
  -rs 2>&1 | tee "$out/tensor_parallel_hf_nccl.log"
for loss in cosine jsd; do
  torchrun --standalone --nproc_per_node 2 benchmarks/vocab_parallel_bench.py --loss "$loss" \
    --out "$out/vocab_parallel_$loss" --ledger "$out/results.csv" 2>&1 | tee "$out/vocab_parallel_$loss.log"
  torchrun --standalone --nproc_per_node 2 examples/tensor_parallel_hf.py --loss "$loss" 2>&1 \
    | tee "$out/tensor_parallel_hf_$loss.log"
  for sharding in "" --fsdp2; do
    torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py --loss "$loss" $sharding 2>&1 \
      | tee "$out/torchrun_${loss}${sharding:+_fsdp2}.log"
  done
done
torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2_parity.py --ledger "$out/results.csv" 2>&1 \
  | tee "$out/fsdp2_parity.log"
