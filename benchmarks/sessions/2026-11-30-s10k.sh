#!/usr/bin/env bash
# Session 10 GPU call K: the row step with slices held in registers (NOTES item 51) against the library's, both
# checked against the torch step; logs straight to $OUT (the session's device time is nearly gone).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 75 python3 benchmarks/one_read_row_step_study.py --rows 2048 --configs slices:4096:4 slices:2048:2 slices:8192:8 slices:16384:16 > $OUT/seed.log 2>&1; echo "rc=$?" >> $OUT/seed.log
cat $OUT/seed.log
timeout 40 python3 benchmarks/one_read_row_step_study.py --rows 1024 --vocab 262144 --configs slices:4096:4 slices:8192:8 > $OUT/v262144.log 2>&1; echo "rc=$?" >> $OUT/v262144.log
cat $OUT/v262144.log
