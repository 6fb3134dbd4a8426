#!/usr/bin/env bash
# Session 7 GPU call D: s7c read 1.28x at V = 262144 and 1.20x at V = 32000 (s6g: 1.20, 1.14) and
# 1.12x on the seed shape. Whether the sliced row step does that inside a settled step: ours at this
# session's code against 99f4fe3 (per-row kernel), alternating, T = 4096, three vocabularies.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_99f4fe3.tar -C /tmp/old
for round in 1 2; do
  for shape in "262144 2048" "32000 4096" "128256 4096"; do
    set -- $shape
    for code in new old; do
      path=src; [ $code = old ] && path=/tmp/old/src
      PYTHONPATH=$path timeout 45 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 4096 \
          --vocab $1 --hidden $2 --markdown $R/ab-$1-$code-$round.md > $R/ab-$1-$code-$round.log 2>&1
      echo "V=$1 $code round $round: $(grep -E '^\| (ours|floor) ' $R/ab-$1-$code-$round.md | awk -F'|' '{print $2, $5, $6}' | tr '\n' ';')"
    done
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
