#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_c94ac5b.py, made before the call (not committed):
#   git show c94ac5b:src/cosdistill/row_step_triton.py | sed 's/from .row_step import/from cosdistill.row_step import/' > benchmarks/sessions/old_row_step_triton_c94ac5b.py
# Session 4 GPU call D: the row step with fewer instructions per logit (NOTES item 24): its microbench
# against c94ac5b's kernel (benchmarks/sessions/old_row_step_triton_c94ac5b.py, a copy of that commit's
# file, not committed), then gpu_check and the 240-case fuzz on the changed kernels.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run row_step_bench 150 python3 benchmarks/row_step_bench.py --other benchmarks/sessions/old_row_step_triton_c94ac5b.py
grep -E "defaults|copy" $R/row_step_bench.log
run gpu_check 180 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run fuzz 200 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
