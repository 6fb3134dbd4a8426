#!/usr/bin/env bash
# Session 16 GPU call E: the Gram path's row step in one launch of the one-model cluster kernel
# (row_step_cuda.gram_row_step_cuda, NOTES item 72): gpu_check (its row step against the torch spec, poisoned,
# with an overflowing row; the loss cases through impl="cuda"), then call by call against a76eb68 (the
# Triton stats and grad kernels) at V = 262144 (T = 4096) and the seed's T = 8192, where "auto" takes the Gram path.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_a76eb68.tar -C /tmp/old
TAIL=3 run gpu_check 120 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "cuda gram|FAIL" $R/gpu_check.log | head -20
TAIL=3 run ab_v262144 60 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 40 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
TAIL=3 run ab_seed 60 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 8192 --modes full --pairs 30 --json $R/ab_seed.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
