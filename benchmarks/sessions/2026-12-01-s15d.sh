#!/usr/bin/env bash
# Session 15 GPU call D: item 67's layouts on the final code: issue 3's other shapes (ours, Liger, floor; V =
# 262144 three rounds), then the bench, all five providers, full and no-grad forward, three rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
run v262144 100 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --rounds 3 --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
run v151936 60 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 4096 --vocab 151936 --hidden 3584 --markdown $R/v151936.md --json $R/v151936.json
grep -hE "^\| (ours|liger|floor) " $R/v*.md
run bench 400 python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
