#!/usr/bin/env bash
# Session 10 GPU call G: issue 3's other two shapes with two rounds (s10c timed them in one).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run v151936 120 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --rounds 2 --tokens 4096 --vocab 151936 --hidden 3584 --markdown $R/v151936.md --json $R/v151936.json
run t3000 120 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --rounds 2 --tokens 3000 --markdown $R/t3000.md --json $R/t3000.json
grep -E "^\| (ours|liger|floor)" $R/v151936.md $R/t3000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
