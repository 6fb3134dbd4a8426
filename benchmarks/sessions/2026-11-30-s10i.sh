#!/usr/bin/env bash
# Session 10 GPU call I: where the GPU waits in backward under autograd's engine (NOTES item 49: +0.3 ms of
# GPU backward time against the Function's backward called straight): idle_timeline at T = 4096 and 1024.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
for t in 4096 1024; do timeout 100 python3 benchmarks/idle_timeline.py --tokens $t --min-gap-us 20 > $R/idle_t$t.log 2>&1; echo "rc=$?" >> $R/idle_t$t.log; done
tail -40 $R/idle_t4096.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
