#!/usr/bin/env bash
# Session 13 GPU call D: item 62 (the first GEMM before the other buffers) against 8e819e9, call by call at
# T = 1024; then the final bench, all five providers, full and no-grad forward, two rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_8e819e9.tar -C /tmp/old
TAIL=5 run ab_first_gemm 110 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 --modes full forward --pairs 100 --json $R/ab_first_gemm.json
run bench 420 python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
