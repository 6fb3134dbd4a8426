#!/usr/bin/env bash
# Session 6 GPU call H (the last ~5 minutes of device time): what each grad_weight accumulation costs
# (grad_weight_gemm_study), and the FP8 teacher with fast accumulation under torch.compile against
# eager (the custom op of ops.py runs the same code; this checks it on the GPU).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
timeout 150 python3 benchmarks/grad_weight_gemm_study.py > $R/grad_weight_gemm_study.log 2>&1; echo "rc=$?" >> $R/grad_weight_gemm_study.log
cat $R/grad_weight_gemm_study.log
timeout 100 python3 - > $R/compile_fp8.log 2>&1 <<'PY'
import torch
from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import make_tensors
t = make_tensors(2500, 128256, 4096, 2048, torch.bfloat16, torch.device("cuda"))
def run(fn):
    t.clear_grads()
    loss = fn(*t.args(), teacher_precision="fp8")
    loss.backward()
    return [loss.detach().float(), t.student_input.grad.float(), t.student_weight.grad.float()]
eager = run(fused_linear_cosine_distill)
compiled = run(torch.compile(fused_linear_cosine_distill, fullgraph=True))
for name, a, b in zip(("loss", "grad_input", "grad_weight"), compiled, eager):
    print(name, "compiled vs eager rel err", ((a - b).norm() / b.norm()).item())
PY
echo "rc=$?" >> $R/compile_fp8.log
cat $R/compile_fp8.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
