#!/usr/bin/env bash
# Session 16 GPU call B: the bench on the final code, three rounds, full and no-grad forward: ours (cosine_via
# "auto": the Gram path where gram_is_cheaper says so), ours-logits (the logits path forced: last session's
# ours), ours-fp8, Liger 0.8.5 and the floor. naive left out to fit the call (its figures: s15e).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
run bench 570 python3 -m cosdistill bench --device cuda --providers ours,ours-logits,ours-fp8,liger,floor --rounds 3 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-logits|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
