#!/usr/bin/env bash
# Session 2 GPU call A (nvidia-h200-x2): kernel checks, vocab-parallel on NCCL, DDP/FSDP2 example, fuzz, soak.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpus.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())" >> $R/gpus.txt
run() { name=$1; shift; echo "== $name"; timeout ${LIMIT:-150} "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check python3 benchmarks/gpu_check.py
run row_step_bench python3 benchmarks/row_step_bench.py
run vocab_parallel python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/vocab_parallel_bench.py --out $R
run example_ddp python3 -m torch.distributed.run --standalone --nproc_per_node 2 examples/torchrun_ddp.py --steps 3
run example_fsdp2 python3 -m torch.distributed.run --standalone --nproc_per_node 2 examples/torchrun_ddp.py --steps 3 --fsdp2
run fuzz python3 benchmarks/gpu_fuzz.py --out $R/fuzz
run soak python3 benchmarks/soak.py --out $R/soak
tar czf $OUT/results.tgz -C $R .
