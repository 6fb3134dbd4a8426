#!/usr/bin/env bash
# Session 17 GPU call D: the final bench on the tip (items 73, 74): all five default providers (ours, ours-fp8,
# naive, Liger 0.8.5, the floor), full step and no-grad forward, three settled rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
run bench 570 python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|naive|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
