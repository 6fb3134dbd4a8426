#!/usr/bin/env bash
# Session 12 GPU call G: the final code (the cluster row step, launched on the tensors' device and stream):
# gpu_check, then the seed-workload bench (two settled rounds, full step and no-grad forward, plot).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
run bench 400 python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
