#!/usr/bin/env bash
# Session 7 GPU call B: the sliced row step in the library (NOTES item 38) and the no-grad teacher
# sub-chunks (item 39) on the H200: correctness first (gpu_check, GPU fuzz with a fresh seed), the row
# step alone at its slice widths, then ours against 99f4fe3 (before both), alternating, settled.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
run fuzz 150 python3 benchmarks/gpu_fuzz.py --seed 7 --cases 120 --out $R/fuzz
run row_step_bench 60 python3 benchmarks/row_step_bench.py --configs 1024:4 512:2 --slice-cols 8192 16384 32768
grep -E "^row step" $R/row_step_bench.log
run row_step_bench_v262144 45 python3 benchmarks/row_step_bench.py --vocab 262144 --configs 1024:4 --slice-cols 16384 32768
grep -E "^row step" $R/row_step_bench_v262144.log
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_99f4fe3.tar -C /tmp/old
for round in 1 2; do
  for code in new old; do
    path=src; [ $code = old ] && path=/tmp/old/src
    PYTHONPATH=$path timeout 80 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 2048,8192 \
        --mode full,forward --markdown $R/ab-$code-$round.md > $R/ab-$code-$round.log 2>&1
    echo "$code round $round"; grep -E "^\| (ours|floor) " $R/ab-$code-$round.md | awk -F'|' '{print $2, $3, $4, $5, $6}' | tr '\n' ';'; echo
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
