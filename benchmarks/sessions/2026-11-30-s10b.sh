#!/usr/bin/env bash
# Session 10 GPU call B: the session's code (FP8 quantisation in Triton, NOTES item 44; softcap x / cap as a
# multiply, item 45). gpu_check first (softcap cases); the softcapped row step against b34ea9d (divisions,
# Taylor fix) and 2c11870 (before the fix); then the final bench of the seed workload, settled, full step and
# no-grad forward (2 rounds, plot).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run gpu_check 100 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL|softcap" $R/gpu_check.log | head
for rev in b34ea9d 2c11870; do mkdir -p /tmp/$rev && tar xf benchmarks/sessions/old_src_$rev.tar -C /tmp/$rev; done
for code in new b34ea9d 2c11870; do
  path=src; [ $code != new ] && path=/tmp/$code/src
  PYTHONPATH=$path timeout 35 python3 benchmarks/row_step_bench.py --softcap 30 --configs 2048:8 > $R/softcap_$code.log 2>&1
  echo "softcap $code: $(grep defaults $R/softcap_$code.log | tr '\n' ';')"
done
run bench 380 python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
