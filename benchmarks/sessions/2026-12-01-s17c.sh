#!/usr/bin/env bash
# Session 17 GPU call C: item 74 (the first GEMM before the rest of the set-up, the autograd Function after the
# chunk loop): gpu_check, then call by call against 3c5c7f1 (bf16 T = 1024 / 2048 full and no-grad forward, FP8
# T = 2048 / 8192), the host's lead again, and the prologue's cProfile (host_path_study).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_3c5c7f1.tar -C /tmp/old
TAIL=3 run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head -20
TAIL=8 run ab_bf16 150 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full forward --pairs 40 --json $R/ab_bf16.json
TAIL=8 run ab_fp8 120 python3 benchmarks/ab_study.py --old /tmp/old/src --fp8 --tokens 2048 8192 --modes full --pairs 30 --json $R/ab_fp8.json
TAIL=8 run host_lead 120 python3 benchmarks/host_lead_study.py --tokens 1024 2048 --providers ours ours-fp8 floor --calls 30 --json $R/host_lead.json
TAIL=60 run host_path_fp8 60 python3 benchmarks/host_path_study.py --tokens 2048 --fp8
tar czf $OUT/results.tgz -C $R . && rm -rf $R
