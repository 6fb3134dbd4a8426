#!/usr/bin/env bash
# Session 10 GPU call H: library_overhead_study at T = 4096, V = 262144 / H = 2048 and the seed shape (NOTES item 49).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=25 run overhead_v262144 150 python3 benchmarks/library_overhead_study.py --tokens 4096 --vocab 262144 --hidden 2048 --json $R/overhead_v262144.json
TAIL=25 run overhead_seed 150 python3 benchmarks/library_overhead_study.py --tokens 4096 --json $R/overhead_seed.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
