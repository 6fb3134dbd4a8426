#!/usr/bin/env bash
# Session 8 GPU call E: the final bench of the session's code (the last chunk's grad_input GEMM in backward
# with several chunks, NOTES item 41), settled: seed workload, full step and no-grad
# forward on the same tensors (2 rounds, plot), then issue 3's other shapes.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run bench 370 python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
B="python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 4096"
run shapes_v262144 50 $B --vocab 262144 --hidden 2048 --markdown $R/v262144.md
run shapes_v151936 50 $B --vocab 151936 --hidden 3584 --markdown $R/v151936.md
run shapes_v32000 40 $B --vocab 32000 --hidden 4096 --markdown $R/v32000.md
run shapes_t3000 45 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 3000 --markdown $R/t3000.md
grep -E "^\| (ours|liger) " $R/v262144.md $R/v151936.md $R/v32000.md $R/t3000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
