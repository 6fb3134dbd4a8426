#!/usr/bin/env bash
# Session 3 GPU call D: fp16 gradients lifted by powers of two (issue 6's last item): gpu_check
# (fp16 row step with lifts at V = 151936, fp16 loss at V = 128256), the 240-case fuzz with no fp16
# excuse, the fp16 path's speed beside the floor, the bf16 row step's speed (LIFT off), and the
# chunk layouts at T = 2048 / 4096 (the bench's T = 2048 read 1.25x in s3b).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/gpu.txt
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run fuzz 200 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
run row_step_bench 60 python3 benchmarks/row_step_bench.py
run gap_2048 120 python3 benchmarks/gap_study.py --tokens 2048 4096 --json $R/gap_2048.json
run bench_fp16 120 python3 -m cosdistill bench --device cuda --dtype fp16 --providers ours,naive,liger,floor --tokens 1024,4096 --markdown $R/bench_fp16.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
