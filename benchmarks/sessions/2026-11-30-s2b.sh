#!/usr/bin/env bash
# Session 2 GPU call B: why the two-stage row step is slower than the old one (variants of the kernel file).
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/v/head /tmp/v/current /tmp/v/norescue /tmp/v/norescue_oldprob
git archive 5e79d38 src | tar -x -C /tmp/v/head
for v in current norescue norescue_oldprob; do cp -r src /tmp/v/$v/; done
python3 - <<'PY'
import re
for v in ("norescue", "norescue_oldprob"):
    p = f"/tmp/v/{v}/src/cosdistill/row_step_triton.py"
    s = open(p).read()
    s = re.sub(r"    overflow_check = .*?BLOCK,\n        \)\n", "", s, flags=re.S)
    if v.endswith("oldprob"):
        s = s.replace("prob = tl.exp((s - row_max) - log_sum_exp)", "prob = tl.exp(s - (row_max + log_sum_exp))")
    open(p, "w").write(s)
    print(v, "overflow_check" in s)
PY
for v in head current norescue norescue_oldprob; do
  echo "== $v"; PYTHONPATH=/tmp/v/$v/src timeout 100 python3 benchmarks/row_step_bench.py 2>&1 | grep -E "copy|block= 1024 warps= 4|block= 2048 warps= 8|block= 4096 warps=16|warps= 4:|Error" | tee -a $R/variants.log
done
