#!/usr/bin/env bash
# Session 6 GPU call E: the bench with every provider warmed up for >= 0.5 s per round (the power
# limiter settled, NOTES item 35) and rotating order: seed workload full step (2 rounds, plot),
# no-grad forward, and issue 3's other shapes.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run bench 230 python3 -m cosdistill bench --device cuda --rounds 2 --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run forward 110 $B --mode forward --rounds 2 --markdown $R/forward.md
grep -E "^\| (ours|ours-fp8|liger) " $R/forward.md
run shapes_v32000 45 $B --vocab 32000 --hidden 4096 --tokens 4096 --markdown $R/v32000.md
run shapes_v151936 50 $B --vocab 151936 --hidden 3584 --tokens 4096 --markdown $R/v151936.md
run shapes_v262144 55 $B --vocab 262144 --hidden 2048 --tokens 4096 --markdown $R/v262144.md
run shapes_t3000 45 $B --tokens 3000 --markdown $R/t3000.md
grep -E "^\| (ours|ours-fp8|liger) " $R/v32000.md $R/v151936.md $R/v262144.md $R/t3000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
