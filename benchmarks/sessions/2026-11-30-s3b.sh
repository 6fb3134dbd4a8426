#!/usr/bin/env bash
# Session 3 GPU call B: 2048-row student chunks with 1024-row teacher sub-chunks (NOTES item 17):
# gpu_check (new T = 2500 cases exercise the sub-chunks, also with the FP8 head), the gap study with
# the three row layouts, and the full seed bench beside Liger and the floor.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/gpu.txt
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run gap_study 150 python3 benchmarks/gap_study.py --json $R/gap_study.json
run bench 280 python3 -m cosdistill bench --device cuda --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
tar czf $OUT/results.tgz -C $R .
