#!/usr/bin/env bash
# Session 4 GPU call F: correctness of the final code (NOTES item 24's row step at its new defaults):
# gpu_check and the whole 240-case fuzz, then the interleaved gap study at T = 1024 and 8192.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run fuzz 330 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
run gap 100 python3 benchmarks/gap_study.py --tokens 1024 8192 --json $R/gap.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
