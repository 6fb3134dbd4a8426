#!/usr/bin/env bash
# Session 3 GPU call A: gpu_check (incl. the split kernels' final form), the L2 study of the row step,
# and the study of where the seed step's time goes beyond the floor.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -4 $R/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
run gpu_check 120 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run l2_study 200 python3 benchmarks/l2_study.py --json $R/l2_study.json
run gap_study 200 python3 benchmarks/gap_study.py --json $R/gap_study.json
cd $OUT && tar czf results.tgz r && rm -rf r
