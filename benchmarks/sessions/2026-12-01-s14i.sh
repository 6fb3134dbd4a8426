#!/usr/bin/env bash
# Session 14 GPU call I (ran on commit a916c42, since reverted): item 66, the CUDA row step with softcaps and
# logit scales compiled in: the study's checks and timings with Gemma-2 style caps (student 30, teacher 45)
# and logit scales (0.5 / 1.0) against the Triton step (the kernel's fallback there); gpu_check; GPU fuzz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=12 run study 120 python3 benchmarks/cluster_row_step_study.py --in-step --softcap 30 --logit-scale 0.5 --vocabs 256000 128256 262144
grep -cE "NaN rows as spec True" $R/study.log; grep -E "rel err [0-9.]+e-0[0-5]|False|rror" $R/study.log | head
run gpu_check 100 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL|row step cuda" $R/gpu_check.log | head -20
TAIL=4 run fuzz 80 python3 benchmarks/gpu_fuzz.py --seed 17 --cases 60 --out $R/fuzz
grep -E "cases:|Coverage" $R/fuzz/fuzz.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
