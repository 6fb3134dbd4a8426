#!/usr/bin/env bash
# Session 11 GPU call B: NOTES item 53, item 51's held slices taken apart (wait / spin / halves / nowait) at the
# seed vocabulary and V = 262144, beside the library's per-row kernel; then the GPU fuzz of main's code (the
# _row_losses / _grad_coefficients split has run on the H200 only through gpu_check, in s11a).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
configs=""
for size in 4096:4 16384:16; do for mode in wait spin halves nowait; do configs="$configs slices:$size:$mode"; done; done
TAIL=9 run study 120 python3 benchmarks/one_read_row_step_study.py --rows 2048 --configs $configs
TAIL=5 run study_v262144 80 python3 benchmarks/one_read_row_step_study.py --rows 1024 --vocab 262144 --configs slices:16384:16:wait slices:16384:16:halves slices:16384:16:nowait slices:4096:4:nowait
run fuzz 240 python3 benchmarks/gpu_fuzz.py --seed 11 --cases 120 --out $R/fuzz
tail -4 $R/fuzz/fuzz.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
