#!/usr/bin/env bash
# Session 16 GPU call D: the final code against 0f40c7f (session 15's) call by call at the seed's T = 1024 / 2048,
# where "auto" keeps the logits path (is its choice free?); T = 32768 with the Gram path (one round); the fuzz
# (the Gram path where "auto" takes it).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_0f40c7f.tar -C /tmp/old
TAIL=3 run ab_seed 90 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full --pairs 80 --json $R/ab_seed.json
run t32768 150 python3 -m cosdistill bench --device cuda --providers ours,ours-logits,liger,floor --tokens 32768 --reps 5 --markdown $R/t32768.md --json $R/t32768.json
grep -E "^\| (ours|liger|floor)" $R/t32768.md
TAIL=4 run fuzz 150 python3 benchmarks/gpu_fuzz.py --seed 19 --cases 80 --out $R/fuzz
grep -E "Coverage|PASSED|FAILED" $R/fuzz/fuzz.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
