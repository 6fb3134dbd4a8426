#!/usr/bin/env bash
# Session 11 GPU call D: the final code (main; the library unchanged this session apart from session 10's last
# refactor, which s11a's gpu_check and s11b's fuzz ran): gpu_check, then the final bench of the seed workload
# (two settled rounds, full step and no-grad forward, plot) and V = 262144 (two rounds).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run gpu_check 90 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
run bench 330 python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
run v262144 130 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --rounds 2 --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
grep -E "^\| (ours|liger|floor)" $R/v262144.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
