#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_twoexp.py (not committed; carried): this commit's
# row_step_triton.py with the statistics pass's two-exp online sum of exps put back (as in 7f089a7).
# Session 5 GPU call B: s5a found the one-exp pass slower at stages 1 (0.400 against 0.349 ms) and
# faster at stages 4 (0.334); this sweeps both forms over stages 3-6 to pick the form and the stages.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run row_step_bench 420 python3 benchmarks/row_step_bench.py --stages 3 4 5 6 --configs 2048:4 2048:8 1024:4 4096:8 \
    --other benchmarks/sessions/old_row_step_triton_twoexp.py
sort -t: -k2 -n $R/row_step_bench.log | head -40
tar czf $OUT/results.tgz -C $R . && rm -rf $R
