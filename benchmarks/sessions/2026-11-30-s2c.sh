#!/usr/bin/env bash
# Session 2 GPU call C: the row step with its rescue launch (checks, speed), full bench with Liger,
# GEMM-epilogue study, fuzz again.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -4 $R/$name.log; }
cat > /tmp/rescue_check.py <<'PY'
import torch
from cosdistill.row_step import RowStepScales, row_step_torch
from cosdistill.row_step_triton import row_step_triton
top = torch.finfo(torch.bfloat16).max
s = torch.randn(64, 50000, device="cuda").mul(3).bfloat16(); t = torch.randn(64, 50021, device="cuda").mul(3).bfloat16()
s[::3, 7] = top; s[1::3, 9] = -top; t[::2, 11] = top  # rows whose |s|^2, |t|^2 overflow fp32
s[5, 3] = float("inf")  # a non-finite row
labels = torch.randint(0, 50000, (64,), device="cuda"); labels[::3] = 7
scales = RowStepScales(0.5, 0.5, 0.5, 1.3, -100)
want_grad, want_losses = s.clone(), torch.full((64, 2), 7.0, device="cuda")
row_step_torch(want_grad, t, labels, scales, want_losses, True)
got_grad, got_losses = s.clone(), torch.full((64, 2), 7.0, device="cuda")
row_step_triton(got_grad, t, labels, scales, got_losses, True)
finite = torch.ones(64, dtype=torch.bool, device="cuda"); finite[5] = False
print("row 5 losses (want non-finite):", got_losses[5].tolist(), want_losses[5].tolist())
torch.testing.assert_close(got_losses[finite], want_losses[finite], rtol=2e-5, atol=2e-5)
torch.testing.assert_close(got_grad[finite].float(), want_grad[finite].float(), rtol=1e-2, atol=1e-4)
assert not torch.isfinite(got_losses[5]).all()
print("RESCUE CHECK PASSED")
PY
run rescue_check 120 python3 /tmp/rescue_check.py
run row_step_bench 100 python3 benchmarks/row_step_bench.py
run bench 330 python3 -m cosdistill bench --device cuda --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
run epilogue 150 python3 benchmarks/epilogue_study.py --out $R/epilogue
run fuzz 120 python3 benchmarks/gpu_fuzz.py --out $R/fuzz
tar czf $OUT/results.tgz -C $R .
