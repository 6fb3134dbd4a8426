#!/usr/bin/env bash
# Needs benchmarks/sessions/old_src_a5db256.tar (not committed; carried): git archive -o .. a5db256 src
# Session 6 GPU call A. Correctness of a5db256 (not yet run on the GPU) plus the two-pass FP8
# quantisation (gpu_check, with its new bit-exact check of fp8.quantize_rows). FP8 levers: the
# teacher GEMM alone in each _scaled_mm setting (fp8_gemm_study), fast accumulation's errors on
# real-looking data and its step time (fp8_study --fast-accum), and the quantisation change against
# a5db256 alternating twice (ours-fp8 and the floor, full step).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 120 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "quantize_rows|FAIL" $R/gpu_check.log | head
run fp8_gemm_study 90 python3 benchmarks/fp8_gemm_study.py
cat $R/fp8_gemm_study.log
run fp8_study 200 python3 benchmarks/fp8_study.py --tokens 4096 --fast-accum --json $R/fp8_study.json
grep -E "full step|fast accumulation vs" $R/fp8_study.log
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_a5db256.tar -C /tmp/old
for round in 1 2; do
  for code in new old; do
    path=src; [ $code = old ] && path=/tmp/old/src
    PYTHONPATH=$path timeout 60 python3 -m cosdistill bench --device cuda --providers ours-fp8,floor \
        --markdown $R/ab-$code-$round.md > $R/ab-$code-$round.log 2>&1
    echo "$code round $round"; grep -E "^\| (ours-fp8|floor) " $R/ab-$code-$round.md | awk -F'|' '{print $2, $3, $5, $6}' | tr '\n' ';'; echo
  done
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
