#!/usr/bin/env bash
# Session 2 GPU call D: no-grad forward and the other shapes with the current row step.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" --markdown $R/$name.md > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run forward 150 $B --mode forward
run t3000 90 $B --tokens 3000
run v32000 90 $B --vocab 32000 --hidden 4096 --tokens 4096
run v151936 90 $B --vocab 151936 --hidden 3584 --tokens 4096
run v262144 90 $B --vocab 262144 --hidden 2048 --tokens 4096
tar czf $OUT/results.tgz -C $R .
