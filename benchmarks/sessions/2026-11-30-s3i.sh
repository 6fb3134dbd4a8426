#!/usr/bin/env bash
# Session 3 GPU call I: fp16 with the last chunk's scaled-down correction moved into backward (NOTES
# item 20): gpu_check, the fuzz, the fp16 bench.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 180 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run fuzz 200 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
run bench_fp16 120 python3 -m cosdistill bench --device cuda --dtype fp16 --providers ours,naive,liger,floor --tokens 1024,4096 --markdown $R/bench_fp16.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
