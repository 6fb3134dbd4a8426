#!/usr/bin/env bash
# Session 16 GPU call A: the Gram path (gram.py, cosine_via) checked against float64 (gpu_check: every
# bias-free loss case on the Gram path too; the seed accum study at T = 8192 now runs it by "auto"),
# then timed against the logits path and the floor: seed T = 1024..8192 full and no-grad forward (the
# crossover for gram_is_cheaper), issue 3's other shapes at T = 4096 (T = 3000 at the seed vocab).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
TAIL=4 run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "gram|FAIL" $R/gpu_check.log | head -30
P=ours-logits,ours-gram,floor
run seed 200 python3 -m cosdistill bench --device cuda --providers $P --mode full,forward --markdown $R/seed.md --json $R/seed.json
grep -E "^\| (ours|floor)" $R/seed.md
run v262144 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 262144 --hidden 2048 --markdown $R/v262144.md --json $R/v262144.json
run v151936 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 151936 --hidden 3584 --markdown $R/v151936.md --json $R/v151936.json
run v32000 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 4096 --vocab 32000 --hidden 4096 --markdown $R/v32000.md --json $R/v32000.json
run t3000 60 python3 -m cosdistill bench --device cuda --providers $P --tokens 3000 --markdown $R/t3000.md --json $R/t3000.json
grep -hE "^\| (ours|floor)" $R/v*.md $R/t3000.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
