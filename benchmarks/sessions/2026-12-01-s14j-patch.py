"""Session 14 call J's variant (NOTES item 65, not adopted): patches row_step_cuda.py under the src folder given so that
the label fix-up re-reads its two logits from the packed vectors."""
import sys
from pathlib import Path
p = Path(sys.argv[1]) / "cosdistill/row_step_cuda.py"
s = p.read_text()
old = '''        if (i == label_vec) {  // the label's entry at full precision, as the Triton kernel's
          #pragma unroll
          for (int j = 0; j < 8; ++j)  // a constant index keeps g in registers
            if (j == label % 8)
              g[j] = prob_coef * (expf((s[j] - row_max) - log_sum_exp) - 1.f) + teacher_coef * t[j] + student_coef * s[j];
        }'''
new = '''        if (i == label_vec) {  // the label's entry at full precision; its logits re-read from the packed vectors
          const int j_label = label % 8;
          const float s_label = element(k < REGISTER_COLS ? student_regs[k] : student_tile[TILE_INDEX(i)], j_label);
          const float t_label = element(k < REGISTER_COLS ? teacher_regs[k] : teacher_tile[TILE_INDEX(i)], j_label);
          const float label_grad = prob_coef * (expf((s_label - row_max) - log_sum_exp) - 1.f) + teacher_coef * t_label + student_coef * s_label;
          #pragma unroll
          for (int j = 0; j < 8; ++j)  // a constant index keeps g in registers
            if (j == j_label) g[j] = label_grad;
        }'''
assert s.count(old) == 1
s = s.replace(old, new)
old2 = "__device__ __forceinline__ unsigned pack(float lo, float hi) {"
new2 = '''__device__ __forceinline__ float element(uint4 v, int j) {  // logit j of a packed vector, j at run time
  const unsigned w = j < 4 ? (j < 2 ? v.x : v.y) : (j < 6 ? v.z : v.w);
  return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16);
}
''' + old2
assert s.count(old2) == 1
s = s.replace(old2, new2)
p.write_text(s)
