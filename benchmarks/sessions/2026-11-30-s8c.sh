#!/usr/bin/env bash
# Session 8 GPU call C (call B again: its old source was not carried; the deferral now only with several chunks): the last chunk's grad_input GEMM in backward (NOTES item 41). Correctness first
# (gpu_check passed in call B), then library_overhead_study on a41a085 (before the change),
# then ours against a41a085 in the bench, alternating, settled, full step, T = 4096 and 8192.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_a41a085.tar -C /tmp/old
TAIL=16 PYTHONPATH=/tmp/old/src run layers_old 120 python3 benchmarks/library_overhead_study.py --tokens 1024 8192 --json $R/layers_old.json
for round in 1 2; do
  for code in new old; do
    path=src; [ $code = old ] && path=/tmp/old/src
    PYTHONPATH=$path timeout 90 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 4096,8192 \
        --mode full --markdown $R/ab-$code-$round.md > $R/ab-$code-$round.log 2>&1
    echo "$code round $round: $(grep -E '^\| (ours|floor) ' $R/ab-$code-$round.md | awk -F'|' '{print $2, $3, $5, $6}' | tr '\n' ';')"
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
