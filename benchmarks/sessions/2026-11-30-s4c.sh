#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_c94ac5b.py, made before the call (not committed):
#   git show c94ac5b:src/cosdistill/row_step_triton.py | sed 's/from .row_step import/from cosdistill.row_step import/' > benchmarks/sessions/old_row_step_triton_c94ac5b.py
# Session 4 GPU call C: the sliced row step streaming its span twice (NOTES item 23). Its microbench against the two-pass
# per-row kernel of c94ac5b (the code it ran is commit f459454; reverted after), then gpu_check, then the seed bench.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -4 $R/$name.log; }
run row_step_bench 200 python3 benchmarks/row_step_bench.py --other benchmarks/sessions/old_row_step_triton_c94ac5b.py
grep -E "defaults|copy" $R/row_step_bench.log; sort -t: -k2 -n $R/row_step_bench.log | grep "row step sliced" | head -5
run gpu_check 180 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run bench 150 python3 -m cosdistill bench --device cuda --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
tar czf $OUT/results.tgz -C $R . && rm -rf $R
