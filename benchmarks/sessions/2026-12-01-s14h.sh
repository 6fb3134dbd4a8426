#!/usr/bin/env bash
# Session 14 GPU call H (a lead, not adopted): the full step at V = 262144 (T = 4096) call by call, this tree
# against itself with launch_config giving s14c's fastest in-step layout there, (16, 224, 3), which ptxas
# fits only with a 32-byte spill.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/variant && cp -r src /tmp/variant/
python3 - <<'PY'
from pathlib import Path
p = Path("/tmp/variant/src/cosdistill/row_step_cuda.py")
s = p.read_text()
old = "    cluster = 8 if _shared_bytes(vocab, 8) <= 48 * 1024 else 16\n"
assert s.count(old) == 1
p.write_text(s.replace(old, "    if vocab == 262144:\n        return Layout(16, 224, 3)\n" + old))
PY
TAIL=4 run ab_v262144_224 130 python3 benchmarks/ab_study.py --old /tmp/variant/src --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048 --json $R/ab_v262144_224.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
