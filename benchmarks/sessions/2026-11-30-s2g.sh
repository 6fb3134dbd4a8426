#!/usr/bin/env bash
# Session 2 GPU call G: forward without host sync (NOTES item 14): checks, bench, overhead.py.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run bench 120 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,floor --markdown $R/bench.md --json $R/bench.json
run overhead 60 python3 benchmarks/overhead.py --tokens 1024,8192
run gpu_check 90 python3 benchmarks/gpu_check.py
