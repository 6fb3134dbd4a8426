#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_7f089a7.py (not committed; carried, see s5a).
# Session 5 GPU call C: the code with NOTES items 27 and 28 at the swept defaults (row step block 2048,
# 8 warps, 6 stages; loss only 2048 / 8 / 4; two-exp statistics pass). Correctness first (gpu_check,
# the 240-case fuzz), the row step against 7f089a7's, then the seed bench with every provider
# (two rounds) and its plot.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 120 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run row_step_bench 90 python3 benchmarks/row_step_bench.py --configs 2048:4 2048:8 --other benchmarks/sessions/old_row_step_triton_7f089a7.py
grep -E "defaults|copy" $R/row_step_bench.log
run fuzz 200 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
run bench 170 python3 -m cosdistill bench --device cuda --rounds 2 --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
