#!/usr/bin/env bash
# Session 10 GPU call F: T = 32768 with the session's code (last timed in session 3): the working set flat
# in T apart from grad_input (issue 3), ours, ours-fp8, Liger and the floor.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run t32768 300 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor --tokens 32768 --markdown $R/t32768.md --json $R/t32768.json
grep -E "^\| (ours|liger|floor)" $R/t32768.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
