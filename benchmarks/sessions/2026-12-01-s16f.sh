#!/usr/bin/env bash
# Session 16 GPU call F (run as one command line right after E, on the warm machine): the bench after item 72,
# one round: the seed's T = 4096 and 8192 (full and no-grad forward; ours, ours-logits, floor) and V = 262144.
export PYTHONPATH=src PYTHONUNBUFFERED=1; R=$OUT/r; mkdir -p $R
timeout 130 python3 -m cosdistill bench --device cuda --providers ours,ours-logits,floor --tokens 4096,8192 --mode full,forward --markdown $R/seed.md --json $R/seed.json > $R/seed.log 2>&1; echo rc=$? >> $R/seed.log
timeout 60 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json > $R/v262144.log 2>&1; echo rc=$? >> $R/v262144.log
grep -hE "^\| (ours|floor)|rc=" $R/*.md $R/*.log; tar czf $OUT/results.tgz -C $R . && rm -rf $R
