#!/usr/bin/env bash
# Needs benchmarks/sessions/old_row_step_triton_c94ac5b.py, made before the call (not committed):
#   git show c94ac5b:src/cosdistill/row_step_triton.py | sed 's/from .row_step import/from cosdistill.row_step import/' > benchmarks/sessions/old_row_step_triton_c94ac5b.py
# Session 4 GPU call E: the row step of NOTES item 24 at its swept defaults (block 2048 / 4 warps; loss
# only 2048 / 8): the microbench again, the seed bench (full step, with FP8), the no-grad forward, and
# the two shapes past 1.15x (V = 32000 / H = 4096, V = 262144 / H = 2048).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run row_step_bench 90 python3 benchmarks/row_step_bench.py --other benchmarks/sessions/old_row_step_triton_c94ac5b.py
grep -E "defaults|copy" $R/row_step_bench.log
run bench 150 python3 -m cosdistill bench --device cuda --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger) " $R/bench.md
run forward 120 $B --mode forward --markdown $R/forward.md
grep -E "^\| (ours|ours-fp8) " $R/forward.md
run v32000 70 $B --vocab 32000 --hidden 4096 --tokens 4096 --markdown $R/v32000.md
run v262144 70 $B --vocab 262144 --hidden 2048 --tokens 4096 --markdown $R/v262144.md
grep -E "^\| (ours|ours-fp8) " $R/v32000.md $R/v262144.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
