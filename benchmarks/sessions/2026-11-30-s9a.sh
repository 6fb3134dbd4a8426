#!/usr/bin/env bash
# Session 9 GPU call A: the FP8 activations quantized by one Triton kernel (NOTES item 44). Correctness
# first (gpu_check, with the Triton quantization's bit check), then the quantization alone
# (fp8_gemm_study), then the FP8 step against 2c11870 (before the change) call by call in one process
# (ab_study, its first GPU run), and the bf16 step, which the change leaves alone, as ab_study's A/A check;
# last, the softcapped row step against 2c11870's.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_2c11870.tar -C /tmp/old
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL|quantize" $R/gpu_check.log | head
TAIL=30 run fp8_gemm 120 python3 benchmarks/fp8_gemm_study.py --rows 1024,2048
TAIL=12 run ab_fp8 240 python3 benchmarks/ab_study.py --old /tmp/old/src --fp8 --tokens 2048 8192 --modes full forward --pairs 100 --json $R/ab_fp8.json
TAIL=8 run ab_bf16 120 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 --modes full --pairs 200 --json $R/ab_bf16.json
# the softcapped row step (session 9's tanh fix, NOTES "Not tried yet") against 2c11870's, Gemma-2's cap
for code in new old; do
  path=src; [ $code = old ] && path=/tmp/old/src
  PYTHONPATH=$path timeout 120 python3 benchmarks/row_step_bench.py --softcap 30 --configs 2048:8 > $R/softcap_$code.log 2>&1
  echo "softcap $code: $(tail -4 $R/softcap_$code.log | tr '\n' ';')"
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
