#!/usr/bin/env bash
# Session 10 GPU call E: small vocabularies' 4096-row chunks (NOTES item 48) against chunk_size = 2048 (the
# old automatic layout), two rounds, at V = 32000 (T = 4096 and 8192); then V = 262144 with two rounds, to
# set the bench beside item 47's gap study.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run v32000 150 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --chunk-sizes auto,2048 --rounds 2 --tokens 4096,8192 --vocab 32000 --hidden 4096 --markdown $R/v32000.md --json $R/v32000.json
grep -E "^\| (ours|liger|floor)" $R/v32000.md
run v262144 150 python3 -m cosdistill bench --device cuda --providers ours,liger,floor --rounds 2 --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
grep -E "^\| (ours|liger|floor)" $R/v262144.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
