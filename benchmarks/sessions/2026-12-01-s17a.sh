#!/usr/bin/env bash
# Session 17 GPU call A: item 73 (the FP8 teacher's quantisation once per chunk, its buffers after the first
# GEMM): gpu_check (FP8 cases against float64 on the dequantized teacher, sub-chunk offsets at T = 2500),
# the FP8 step call by call against 2d3753d, then where the FP8 step's time goes at T = 2048: the host's lead
# before the first kernel (idle vs busy start), its kernels against the floor's, the FP8 GEMM alone by M.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_2d3753d.tar -C /tmp/old
TAIL=3 run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "fp8|FAIL" $R/gpu_check.log | head -20
TAIL=12 run ab_fp8 150 python3 benchmarks/ab_study.py --old /tmp/old/src --fp8 --tokens 2048 8192 --modes full forward --pairs 40 --json $R/ab_fp8.json
TAIL=8 run ab_bf16 60 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 2048 --modes full --pairs 40 --json $R/ab_bf16.json
TAIL=8 run host_lead 120 python3 benchmarks/host_lead_study.py --tokens 1024 2048 --providers ours ours-fp8 floor --calls 30 --json $R/host_lead.json
TAIL=40 run kernels_fp8 90 python3 benchmarks/step_vs_floor_kernels.py --fp8 --tokens 2048 --steps 5
TAIL=30 run fp8_gemm 60 python3 benchmarks/fp8_gemm_study.py --rows 512,1024,2048
tar czf $OUT/results.tgz -C $R . && rm -rf $R
