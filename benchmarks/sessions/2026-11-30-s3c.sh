#!/usr/bin/env bash
# Session 3 GPU call C: no-grad forward, the other shapes, and T = 32768's peak, after NOTES item 17.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" --markdown $R/$name.md > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run forward 150 $B --mode forward
run t3000 80 $B --tokens 3000
run t32768 150 python3 -m cosdistill bench --device cuda --providers ours,floor --tokens 32768
run v32000 80 $B --vocab 32000 --hidden 4096 --tokens 4096
run v151936 80 $B --vocab 151936 --hidden 3584 --tokens 4096
run v262144 80 $B --vocab 262144 --hidden 2048 --tokens 4096
tar czf $OUT/results.tgz -C $R .
