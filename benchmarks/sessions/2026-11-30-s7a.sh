#!/usr/bin/env bash
# Session 7 GPU call A: the studies prepared in session 6 and never run: the sliced row step whose
# second read comes from L2 (NOTES item 37, under timeout: its programs wait for each other), the
# energy per step under the power cap, and gap_study with its settle.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; cat $R/$name.log | tail -${TAIL:-40}; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/smi_start.log; cat $R/smi_start.log
run sliced 150 python3 benchmarks/sliced_row_step_study.py
run sliced_v262144 90 python3 benchmarks/sliced_row_step_study.py --vocab 262144 --configs 8192:2048:8:6 16384:2048:8:6
run energy 100 python3 benchmarks/energy_study.py
TAIL=60 run gap 200 python3 benchmarks/gap_study.py --tokens 1024 8192 --layouts 2048/1024 --json $R/gap.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
