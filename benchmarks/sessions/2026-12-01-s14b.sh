#!/usr/bin/env bash
# Session 14 GPU call B: item 65's launch_config (register vectors where they add blocks per SM) against
# 435ab5f: the study at the vocabularies whose layout changed and two that did not (checks, alone, in step);
# the full step call by call at V = 262144 (T = 4096) and the seed (T = 1024 / 2048); gpu_check; GPU fuzz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_435ab5f.tar -C /tmp/old
TAIL=40 run study 200 python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step --vocabs 262144 128256 256000 200064 98304 65536 49152 151936 32000
grep -cE "NaN rows as spec True" $R/study.log; grep -E "rel err [0-9.]+e-0[0-5]|False|rror" $R/study.log | head
TAIL=4 run ab_v262144 130 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
TAIL=6 run ab_seed 150 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full --pairs 100 --json $R/ab_seed.json
run gpu_check 100 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL|row step cuda" $R/gpu_check.log | head
TAIL=6 run fuzz 90 python3 benchmarks/gpu_fuzz.py --seed 16 --cases 80 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
