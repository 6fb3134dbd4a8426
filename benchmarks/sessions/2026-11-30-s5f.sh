#!/usr/bin/env bash
# Needs benchmarks/sessions/old_src_7f089a7.tar (not committed; carried): git archive -o .. 7f089a7 src
# Session 5 GPU call F: the whole step of the final code against 7f089a7 (session 4's final code),
# alternating new / old twice, full step and no-grad forward, ours and the floor only: the sum of
# NOTES items 27-29 at the seed workload, with the floor's drift between runs taken out.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_7f089a7.tar -C /tmp/old
for round in 1 2; do
  for mode in full forward; do
    for code in new old; do
      path=src; [ $code = old ] && path=/tmp/old/src
      PYTHONPATH=$path timeout 45 python3 -m cosdistill bench --device cuda --providers ours,floor --mode $mode \
          --markdown $R/ab-$mode-$code-$round.md > $R/ab-$mode-$code-$round.log 2>&1
      echo "$mode $code round $round"; grep -E "^\| (ours|floor) " $R/ab-$mode-$code-$round.md | awk -F'|' '{print $2, $3, $5, $6}' | tr '\n' ';'; echo
    done
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
