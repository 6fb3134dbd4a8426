#!/usr/bin/env bash
# Session 17 GPU call B: where the host lead of s17a's host_lead_study (0.26-0.36 ms per call at T <= 2048, the
# floor ~0) goes: the host path stamped and cProfiled (host_path_study), the lead at T = 8192, and the GPU's
# gaps inside one bf16 call (idle_timeline).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
TAIL=50 run host_path_fp8 60 python3 benchmarks/host_path_study.py --tokens 2048 --fp8
TAIL=50 run host_path 60 python3 benchmarks/host_path_study.py --tokens 1024
TAIL=5 run host_lead_8192 90 python3 benchmarks/host_lead_study.py --tokens 8192 --providers ours-logits ours-fp8 floor --calls 20 --json $R/host_lead_8192.json
TAIL=40 run idle_timeline 60 python3 benchmarks/idle_timeline.py --tokens 2048
tar czf $OUT/results.tgz -C $R . && rm -rf $R
