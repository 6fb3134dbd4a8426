#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_c94ac5b.py, made before the call (not committed):
#   git show c94ac5b:src/cosdistill/row_step_triton.py | sed 's/from .row_step import/from cosdistill.row_step import/' > benchmarks/sessions/old_row_step_triton_c94ac5b.py
# Session 4 GPU call H: whole-step A/B of NOTES item 24 (the leaner row step) against c94ac5b's row-step
# file (benchmarks/sessions/old_row_step_triton_c94ac5b.py, swapped into a copy of src/), alternating
# new / old twice, full step and no-grad forward, ours and the floor only.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
cp -r src /tmp/oldsrc && sed 's/from cosdistill.row_step import/from .row_step import/' \
    benchmarks/sessions/old_row_step_triton_c94ac5b.py > /tmp/oldsrc/cosdistill/row_step_triton.py
for round in 1 2; do
  for mode in full forward; do
    for code in new old; do
      path=src; [ $code = old ] && path=/tmp/oldsrc
      PYTHONPATH=$path timeout 60 python3 -m cosdistill bench --device cuda --providers ours,floor --mode $mode \
          --markdown $R/$mode-$code-$round.md > $R/$mode-$code-$round.log 2>&1
      echo "$mode $code round $round"; grep -E "^\| ours " $R/$mode-$code-$round.md | awk -F'|' '{print $3, $5, $6}' | tr '\n' ';'; echo
    done
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
