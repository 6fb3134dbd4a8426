#!/usr/bin/env bash
# Session 16 GPU call C: issue 3's other shapes on the final code (ours = "auto", ours-logits, Liger, floor;
# V = 262144 three rounds), then gpu_check (the Gram path on every bias-free case) once more.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
P=ours,ours-logits,liger,floor
run v262144 150 python3 -m cosdistill bench --device cuda --providers $P --rounds 3 --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
run v151936 70 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 151936 --hidden 3584 --markdown $R/v151936.md --json $R/v151936.json
run v32000 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 32000 --hidden 4096 --markdown $R/v32000.md --json $R/v32000.json
run t3000 70 python3 -m cosdistill bench --device cuda --providers $P --tokens 3000 --markdown $R/t3000.md --json $R/t3000.json
grep -hE "^\| (ours|liger|floor)" $R/v*.md $R/t3000.md
TAIL=3 run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
