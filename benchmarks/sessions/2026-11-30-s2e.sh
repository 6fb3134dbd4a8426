#!/usr/bin/env bash
# Session 2 GPU call E: grad_output read without GPU idle (NOTES item 13): bench and overhead.py.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -12 $R/$name.log; }
run bench 200 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,floor --markdown $R/bench.md --json $R/bench.json
run overhead 120 python3 benchmarks/overhead.py --tokens 1024,8192
