#!/usr/bin/env bash
# Session 2 GPU call H: the kernels after folding their shared prologue into one jit helper:
# gpu_check, the rescue check of s2c, the row step's speed.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
sed -n "/^cat > \/tmp\/rescue_check.py <<'PY'$/,/^PY$/p" benchmarks/sessions/2026-11-30-s2c.sh | sed '1d;$d' > /tmp/rescue_check.py
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run rescue_check 60 python3 /tmp/rescue_check.py
run row_step_bench 60 python3 benchmarks/row_step_bench.py
run gpu_check 90 python3 benchmarks/gpu_check.py
