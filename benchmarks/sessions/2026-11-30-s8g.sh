#!/usr/bin/env bash
# Session 8 GPU call G: the loss divided by N on the device (NOTES item 43) against e6165c6 (before it),
# alternating, three settled rounds: ours and the floor, T = 1024 and 2048, full step and no-grad forward.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_e6165c6.tar -C /tmp/old
for round in 1 2 3; do
  for code in new old; do
    path=src; [ $code = old ] && path=/tmp/old/src
    PYTHONPATH=$path timeout 60 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 1024,2048 \
        --mode full,forward --markdown $R/ab-$code-$round.md > $R/ab-$code-$round.log 2>&1
    echo "$code round $round: $(grep -E '^\| (ours|floor) ' $R/ab-$code-$round.md | awk -F'|' '{print $2, $3, $4, $5, $6}' | tr '\n' ';')"
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
