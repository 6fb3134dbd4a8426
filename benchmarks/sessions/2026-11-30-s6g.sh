#!/usr/bin/env bash
# Session 6 GPU call G: the final bench, every provider warmed up >= 3 s per round (the default now,
# NOTES item 35), rotating order: seed workload full step (2 rounds, plot), no-grad forward, and the
# two smallest-margin shapes of issue 3 (V = 262144 / H = 2048, V = 32000).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run bench 300 python3 -m cosdistill bench --device cuda --rounds 2 --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run forward 130 $B --mode forward --json $R/forward.json --markdown $R/forward.md
grep -E "^\| (ours|ours-fp8|liger) " $R/forward.md
run shapes_v262144 60 $B --vocab 262144 --hidden 2048 --tokens 4096 --markdown $R/v262144.md
run shapes_v32000 50 $B --vocab 32000 --hidden 4096 --tokens 4096 --markdown $R/v32000.md
grep -E "^\| (ours|ours-fp8|liger) " $R/v262144.md $R/v32000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
