#!/usr/bin/env bash
# Session 10 GPU call C: the session's final code on issue 3's other shapes, the FP8 teacher's errors on
# real-looking data (its quantisation now in Triton, NOTES item 44), and the GPU fuzz with a fresh seed.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
B="python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 4096"
run shapes_v262144 50 $B --vocab 262144 --hidden 2048 --markdown $R/v262144.md
run shapes_v151936 50 $B --vocab 151936 --hidden 3584 --markdown $R/v151936.md
run shapes_v32000 40 $B --vocab 32000 --hidden 4096 --markdown $R/v32000.md
run shapes_t3000 45 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 3000 --markdown $R/t3000.md
grep -E "^\| (ours|liger) " $R/v262144.md $R/v151936.md $R/v32000.md $R/t3000.md
run fp8_study 120 python3 benchmarks/fp8_study.py --tokens 4096 --json $R/fp8_study.json
grep -E "full step" $R/fp8_study.log
run fuzz 170 python3 benchmarks/gpu_fuzz.py --seed 10 --cases 100 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
