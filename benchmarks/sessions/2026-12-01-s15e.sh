#!/usr/bin/env bash
# Session 15 GPU call E: the final tip (item 67): the bench, all five providers, full and no-grad forward,
# three rounds (s15d's ran past its 400 s limit at 119 of 120 timings).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
run bench 560 python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
