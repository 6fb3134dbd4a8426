#!/usr/bin/env bash
# Needs, made before the call (not committed; carried):
#   git show 7f089a7:src/cosdistill/row_step_triton.py | sed 's/from .row_step import/from cosdistill.row_step import/' > benchmarks/sessions/old_row_step_triton_7f089a7.py
#   git archive -o benchmarks/sessions/old_src_7f089a7.tar 7f089a7 src
# Session 5 GPU call A: NOTES items 27 (one Triton kernel for the label count; grad_output on the last
# GEMM's rows on the device for a single chunk) and 28 (one exp per logit in the statistics pass;
# loads prefetched through shared memory, swept over stages). gpu_check on the new code (stages 1),
# the row-step sweep with its errors against the torch step and against 7f089a7's kernel, then the
# whole step alternating new / old (7f089a7's src) twice, full and no-grad, ours and the floor only,
# and the idle timeline at T = 1024.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run row_step_bench 300 python3 benchmarks/row_step_bench.py --stages 1 2 3 4 --other benchmarks/sessions/old_row_step_triton_7f089a7.py
grep -E "defaults|copy" $R/row_step_bench.log
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_7f089a7.tar -C /tmp/old
for round in 1 2; do
  for mode in full forward; do
    for code in new old; do
      path=/tmp/site:src; [ $code = old ] && path=/tmp/site:/tmp/old/src
      PYTHONPATH=$path timeout 60 python3 -m cosdistill bench --device cuda --providers ours,floor --mode $mode \
          --markdown $R/ab-$mode-$code-$round.md > $R/ab-$mode-$code-$round.log 2>&1
      echo "$mode $code round $round"; grep -E "^\| (ours|floor) " $R/ab-$mode-$code-$round.md | awk -F'|' '{print $2, $3, $4, $5}' | tr '\n' ';'; echo
    done
  done
done
run idle 60 python3 benchmarks/idle_timeline.py --tokens 1024
tar czf $OUT/results.tgz -C $R . && rm -rf $R
