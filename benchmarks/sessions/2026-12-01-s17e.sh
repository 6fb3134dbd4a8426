#!/usr/bin/env bash
# Session 17 GPU call E: issue 3's other shapes on the tip (ours = "auto", Liger 0.8.5, the floor; one round each),
# T = 32768's working set, and the GPU fuzz after item 74's change of the API's flow.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
P=ours,liger,floor
run v262144 70 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
run v151936 70 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 151936 --hidden 3584 --markdown $R/v151936.md --json $R/v151936.json
run v32000 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 32000 --hidden 4096 --markdown $R/v32000.md --json $R/v32000.json
run t3000 70 python3 -m cosdistill bench --device cuda --providers $P --tokens 3000 --markdown $R/t3000.md --json $R/t3000.json
run t32768 90 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor --tokens 32768 --reps 5 --markdown $R/t32768.md --json $R/t32768.json
grep -hE "^\| (ours|ours-fp8|liger|floor)" $R/v*.md $R/t3000.md $R/t32768.md
TAIL=4 run fuzz 150 python3 benchmarks/gpu_fuzz.py --seed 20 --cases 80 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
