"""The GPU kernels, one file per family; internal (no stable API). Each has a plain-torch spec beside the
code that calls it, and the tests compare the two.

- ``row_step_triton.py``: the cosine loss's row step (statistics, losses, d loss / d logits in place); spec
  ``_row_step.py``.
- ``row_step_cuda.py`` + ``row_step.cu``: the same step in one read per logit, Hopper thread block clusters
  (``cluster.cuh``: what the cluster kernels share); compiled for one model, the Gram path's step
  (``gram_row_step_cuda``).
- ``row_step_jsd_triton.py``: the generalized JSD's row step; spec ``_row_step_jsd.py``.
- ``row_step_jsd_cuda.py`` + ``row_step_jsd.cu``: the same in one read per logit, on clusters.
- ``triton_common.py``: what the Triton row steps share (logits as the loss sees them, a row's label, the fp16
  lift, launch arguments); helpers of the steps above, with no spec of their own.
- ``labels.py``: the label count (N) and the losses' mean; spec ``_labels.py``.
- ``grad_output.py``: grad_output applied without a host read; spec ``_backends.scale_unless_one_torch``.
- ``fp8_quantize.py``: row-wise FP8 quantization; spec ``_teacher_fp8.quantize_rows``.
- ``student_metrics.py``: the student's per-token entropy and top-1 hit, for the trainers' logs; spec
  ``_student_metrics.py``.
- ``fingerprint.py``: the hash of a cached teacher weight and its comparison with the kept one; spec
  ``_fingerprint.py``.
"""

# Every Triton launch here passes these: FMA contraction on, as the kernels were written and measured with it.
# It is Triton's default through 3.9, which warns at each process's first compile that 3.10 turns it off.
TRITON_OPTIONS = {"enable_fp_fusion": True}
