#!/usr/bin/env bash
# Session 5 GPU call E: the final code (NOTES items 27-29). Correctness: gpu_check and the whole
# 240-case fuzz. Speed: V = 262144 / H = 2048 with the 2048 / 512 layout (item 29's prediction
# ~1.16-1.17x); V = 32000 with the automatic chunk (2048) against 4096 rows; T = 1024 and 2048 over
# five rounds (ours and the floor only), where the floor's drift between runs is largest.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 100 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
run fuzz 250 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run v262144 60 $B --vocab 262144 --hidden 2048 --tokens 4096 --markdown $R/v262144.md
run v32000 60 $B --vocab 32000 --hidden 4096 --tokens 4096 --chunk-sizes auto,4096 --markdown $R/v32000.md
grep -E "^\| (ours|ours-fp8|liger)" $R/v262144.md $R/v32000.md
run rounds 90 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 1024,2048 --rounds 5 --markdown $R/rounds.md
grep -E "^\| ours " $R/rounds.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
