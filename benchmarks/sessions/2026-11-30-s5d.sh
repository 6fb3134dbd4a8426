#!/usr/bin/env bash
# Session 5 GPU call D: measurements for the next levers, no code change. How much of each call is the
# host's (host_ahead.py) and where the host spends it (host_profile.py); at V = 262144 / H = 2048 the
# chunk loop in the current 1024/1024 layout against 2048/512 (NOTES "Not tried yet"); the shapes of
# issue 3 and the no-grad forward with every provider (two rounds) on the s5c code.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run host_ahead 100 python3 benchmarks/host_ahead.py
grep round $R/host_ahead.log
run host_profile 40 python3 benchmarks/host_profile.py
run gap_v262144 100 python3 benchmarks/gap_study.py --vocab 262144 --hidden 2048 --tokens 4096 --chunks 1024 2048 \
    --layouts 1024/1024 2048/512 2048/1024 --json $R/gap_v262144.json
grep -E "direct|library|floor" $R/gap_v262144.log
B="python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor"
run forward 110 $B --mode forward --rounds 2 --markdown $R/forward.md
grep -E "^\| (ours|ours-fp8|liger) " $R/forward.md
run v32000 50 $B --vocab 32000 --hidden 4096 --tokens 4096 --markdown $R/v32000.md
run v151936 60 $B --vocab 151936 --hidden 3584 --tokens 4096 --markdown $R/v151936.md
run v262144 60 $B --vocab 262144 --hidden 2048 --tokens 4096 --markdown $R/v262144.md
run t3000 50 $B --tokens 3000 --markdown $R/t3000.md
grep -E "^\| (ours|ours-fp8|liger) " $R/v32000.md $R/v151936.md $R/v262144.md $R/t3000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
