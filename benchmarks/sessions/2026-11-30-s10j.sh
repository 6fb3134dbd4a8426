#!/usr/bin/env bash
# Session 10 GPU call J: the row step held on chip by a cluster of CTAs (NOTES item 50), against the library's,
# both checked against the torch step; logs written straight to $OUT (the session's device time is nearly gone).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 110 python3 benchmarks/cluster_row_step_study.py --rows 2048 --configs 8:16 8:8 4:16 > $OUT/seed.log 2>&1; echo "rc=$?" >> $OUT/seed.log
cat $OUT/seed.log | grep -v Warning
timeout 45 python3 benchmarks/cluster_row_step_study.py --rows 2048 --vocab 32000 --configs 4:8 2:8 > $OUT/v32000.log 2>&1; echo "rc=$?" >> $OUT/v32000.log
cat $OUT/v32000.log | grep -v Warning
