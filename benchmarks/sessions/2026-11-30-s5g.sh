#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_reversed.py (not committed; carried): this commit's
# row_step_triton.py with the gradient pass walking the row backwards (partial block first), so that
# the blocks the statistics pass read last may still sit in L2 (NOTES item 31's prediction).
# Session 5 GPU call G: row step alone, both files, 6 stages, wider blocks (fewer programs per SM:
# a larger share of L2 each); each setting checked against the torch row step first.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run row_step_bench 170 python3 benchmarks/row_step_bench.py --stages 6 --configs 2048:8 4096:8 4096:4 8192:8 \
    --other benchmarks/sessions/old_row_step_triton_reversed.py
grep "row step" $R/row_step_bench.log | sort -t: -k2 -n
tar czf $OUT/results.tgz -C $R . && rm -rf $R
