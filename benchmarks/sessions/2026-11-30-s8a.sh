#!/usr/bin/env bash
# Session 8 GPU call A: where the library's time goes beyond the same chunk loop called straight
# (NOTES "Not tried yet": +0.10 ms at T = 1024, +0.48 at T = 8192 in s7a), now with both profiled, and
# the no-grad forward's +0.36 ms over its two GEMMs at T = 1024 (s7e): gap_study at T = 1024, 2048, 8192,
# then idle_timeline's gaps for the full step (T = 1024, 2048, 8192) and the no-grad forward (T = 1024).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-40} $R/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/smi_start.log; cat $R/smi_start.log
TAIL=5 run idle1024 60 python3 benchmarks/idle_timeline.py --tokens 1024
TAIL=5 run idle1024_nograd 60 python3 benchmarks/idle_timeline.py --tokens 1024 --no-grad
TAIL=5 run idle2048 60 python3 benchmarks/idle_timeline.py --tokens 2048
TAIL=5 run idle8192 60 python3 benchmarks/idle_timeline.py --tokens 8192
TAIL=200 run gap 330 python3 benchmarks/gap_study.py --tokens 1024 2048 8192 --chunks 2048 --layouts 2048/1024 1024/1024 --json $R/gap.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
