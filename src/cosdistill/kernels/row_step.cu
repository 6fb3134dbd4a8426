// The cosine loss's row step in one pass over each logit, for Hopper clusters: row_step_cuda.py prepends its #defines
// (vocabulary, layout, label type) and cluster.cuh, and compiles it with NVRTC at run time. The math is
// _row_step.py's.
#define NUM_PARTS 5  // max, sum of exp, s.t, |s|^2, |t|^2
// Rows past these go to the Triton rescue; on the Gram path, which has none, rows past the first get NaN. exp(s - max)
// as one FFMA, s * log2e - max * log2e, rounds max * log2e: past this |max| by more than bf16's precision.
#define LARGEST_FFMA_MAX 16384.f
// SMALLEST_PLAIN_SUM and FLOAT32_MAX come from the host (row_step_cuda.source): triton_common.py's, the Triton twin's.

__device__ __forceinline__ void reduce_warp(float* part) {
  #pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_max = __shfl_xor_sync(0xffffffffu, part[0], offset);
    const float other_sum = __shfl_xor_sync(0xffffffffu, part[1], offset);
    merge_softmax(part[0], part[1], other_max, other_sum);
    #pragma unroll
    for (int k = 2; k < NUM_PARTS; ++k) part[k] += __shfl_xor_sync(0xffffffffu, part[k], offset);
  }
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) LAUNCH_BOUNDS
cluster_row_step(bf16_t* student, const bf16_t* teacher, const LABEL_T* labels, float* losses,
                 int student_stride, int teacher_stride, int ignore_index,
                 double weight_hard, double weight_soft, double beta, double norm_clamp,
                 const float* teacher_products, float* teacher_coefs) {
  // TEACHER 0 (the Gram path, _teacher_gram.py): no teacher logits; each row's s.t and |t|^2 come in teacher_products
  // and the coefficient of t in d L / d s goes out in teacher_coefs (_row_step.teacher_grad_coefficient).
  extern __shared__ uint4 tiles[];  // this block's slice but its register vectors: TILE_VECS student vectors, then the teacher's
  __shared__ float warp_parts[NUM_WARPS][NUM_PARTS];
  __shared__ float block_parts[NUM_PARTS];  // read by the cluster's other blocks
  __shared__ float row_coefs[6];  // row max, log sum exp, the three gradient coefficients, usable
  const int tid = threadIdx.x;
  const RowSlice slice = row_slice(student, labels, student_stride, ignore_index);
  if (!slice.valid) {  // an ignored token: zero gradient and losses
    zero_grad(slice);
    if (slice.rank == 0 && tid == 0) {
      losses[2 * slice.row] = losses[2 * slice.row + 1] = 0.f;
#if !TEACHER
      teacher_coefs[slice.row] = 0.f;
#endif
    }
    return;
  }
  const float target = target_logit(slice);
  const uint4* student_src = reinterpret_cast<const uint4*>(slice.student_row) + slice.first_vec;
  uint4* student_tile = tiles;
  uint4 student_regs[REGISTER_COLS + 1];  // + 1: no zero-length arrays
#if TEACHER
  const uint4* teacher_src = reinterpret_cast<const uint4*>(teacher + slice.row * teacher_stride) + slice.first_vec;
  uint4* teacher_tile = tiles + TILE_VECS;
  uint4 teacher_regs[REGISTER_COLS + 1];
#endif
  #pragma unroll
  for (int k = 0; k < REGISTER_COLS; ++k) {
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      student_regs[k] = __ldcg(student_src + i);
#if TEACHER
      teacher_regs[k] = __ldcg(teacher_src + i);
#endif
    }
  }
  #pragma unroll
  for (int k = REGISTER_COLS; k < ITERS; ++k) {  // one copy group per k, so the reduction starts on the first early
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      copy_async(student_tile + TILE_INDEX(i), student_src + i);
#if TEACHER
      copy_async(teacher_tile + TILE_INDEX(i), teacher_src + i);
#endif
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // Each thread reduces the vectors it copied itself: no block barrier before the reduction.
  float part[NUM_PARTS] = {NEG_INF, 0.f, 0.f, 0.f, 0.f};
  #pragma unroll
  for (int k = 0; k < ITERS; ++k) {
    if (k >= REGISTER_COLS) wait_copies(ITERS - 1 - k);
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      float s[8];
      unpack(VECTOR(student, k, i), s);
#if TEACHER
      float t[8];
      unpack(VECTOR(teacher, k, i), t);
#endif
      float vec_max = s[0];
      #pragma unroll
      for (int j = 1; j < 8; ++j) vec_max = fmaxf(vec_max, s[j]);
      const float new_max = fmaxf(part[0], vec_max);  // an inf or NaN logit overflows the sums below
      const float scaled_max = new_max * LOG2E;  // exp(s - max) as one FFMA and ex2
      float vec_sum = 0.f;
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        vec_sum += exp2_fast(fmaf(s[j], LOG2E, -scaled_max));
        part[3] += s[j] * s[j];
#if TEACHER
        part[2] += s[j] * t[j];
        part[4] += t[j] * t[j];
#endif
      }
      part[1] = part[1] * exp_fast(part[0] - new_max) + vec_sum;
      part[0] = new_max;
    }
  }
  reduce_warp(part);
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0)
    #pragma unroll
    for (int k = 0; k < NUM_PARTS; ++k) warp_parts[warp][k] = part[k];
  __syncthreads();
  if (warp == 0) {
    #pragma unroll
    for (int k = 0; k < NUM_PARTS; ++k) part[k] = lane < NUM_WARPS ? warp_parts[lane][k] : (k == 0 ? NEG_INF : 0.f);
    reduce_warp(part);
    if (lane == 0)
      #pragma unroll
      for (int k = 0; k < NUM_PARTS; ++k) block_parts[k] = part[k];
  }
  cluster_arrive();  // block_parts written
  cluster_wait();
  if (warp == 0) {  // lane r reads block r's parts
    #pragma unroll
    for (int k = 0; k < NUM_PARTS; ++k)
      part[k] = lane < CLUSTER ? peer_load(&block_parts[k], lane) : (k == 0 ? NEG_INF : 0.f);
    reduce_warp(part);
    if (lane == 0) {  // _row_step.py's losses and gradient coefficients (Triton: _row_losses, _grad_coefficients)
#if !TEACHER
      part[2] = teacher_products[2 * slice.row];
      part[4] = teacher_products[2 * slice.row + 1];
#endif
      const float eps = (float)norm_clamp;  // eps T: T cancels but in the clamp (_row_step.cosine_terms)
      const float total = part[3] + part[4] + fabsf(part[2]);
#if TEACHER  // all the squares may be lost where a sum is 0; after the rescue's scaled sums, 0 means logits of 0
      const bool too_small = part[3] < SMALLEST_PLAIN_SUM || part[4] < SMALLEST_PLAIN_SUM;
#else  // no rescue; |t|^2 is the Gram path's product, and the clamp at eps hides tiny |s| but at tiny T
      const bool too_small = false;
#endif
      const bool usable = !(total > FLOAT32_MAX || total != total) && fabsf(part[0]) <= LARGEST_FFMA_MAX && !too_small;
      const float log_sum_exp = logf(part[1]);
      const float norm_student = sqrtf(part[3]);
      const float clamped_student = fmaxf(norm_student, eps);
      const float clamped_teacher = fmaxf(sqrtf(part[4]), eps);
      const float cos = part[2] / clamped_student / clamped_teacher;
      if (slice.rank == 0) {
        losses[2 * slice.row] = usable ? (part[0] - target) + log_sum_exp : QUIET_NAN;
        losses[2 * slice.row + 1] = usable ? (float)beta * (1.f - cos) : QUIET_NAN;
      }
      const float soft_scale = (float)weight_soft * (float)beta;
      float coef_teacher = 1.f / (clamped_student * clamped_teacher);
      if (coef_teacher > FLOAT32_MAX && part[4] == 0.f) coef_teacher = 0.f;  // _row_step.cosine_terms
      const float coef_student = norm_student >= eps ? cos / (clamped_student * clamped_student) : 0.f;
      row_coefs[0] = part[0];
      row_coefs[1] = log_sum_exp;
      row_coefs[2] = (float)weight_hard;
      row_coefs[3] = -soft_scale * coef_teacher;
      row_coefs[4] = soft_scale * coef_student;
      row_coefs[5] = usable ? 1.f : 0.f;
#if !TEACHER  // no Triton rescue on the Gram path: a row whose sums overflow gets NaN losses and gradient
      if (!usable) row_coefs[2] = row_coefs[3] = row_coefs[4] = QUIET_NAN;
      row_coefs[5] = 1.f;
      if (slice.rank == 0) teacher_coefs[slice.row] = row_coefs[3];
#endif
    }
  }
  // Done reading the other blocks' parts (their values are in registers): they may exit once all arrived.
  cluster_arrive_relaxed();
  __syncthreads();
  const float row_max = row_coefs[0], log_sum_exp = row_coefs[1];
  const float prob_coef = row_coefs[2], teacher_coef = row_coefs[3], student_coef = row_coefs[4];
  const float scaled_shift = (row_max + log_sum_exp) * LOG2E;  // softmax as one FFMA and ex2 per logit
  if (row_coefs[5] != 0.f) {  // else the row keeps its logits for the Triton RESCUE launch
    const long long label_vec = slice.label / 8 - slice.first_vec;
    #pragma unroll
    for (int k = 0; k < ITERS; ++k) {
      const int i = tid + k * THREADS;
      if (i < slice.vecs) {
        float s[8], g[8];
        unpack(VECTOR(student, k, i), s);
#if TEACHER
        float t[8];
        unpack(VECTOR(teacher, k, i), t);
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          g[j] = fmaf(prob_coef, exp2_fast(fmaf(s[j], LOG2E, -scaled_shift)), fmaf(teacher_coef, t[j], student_coef * s[j]));
#else
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          g[j] = fmaf(prob_coef, exp2_fast(fmaf(s[j], LOG2E, -scaled_shift)), student_coef * s[j]);
#endif
        if (i == label_vec) {  // the label's entry at full precision, as the Triton kernel's; its two logits
          // come from the packed vectors again, so that s and t die above (fewer registers)
          const int j_label = slice.label % 8;
          const float s_label = element(VECTOR(student, k, i), j_label);
#if TEACHER
          const float t_label = element(VECTOR(teacher, k, i), j_label);
#else
          const float t_label = 0.f;
#endif
          const float label_grad = prob_coef * (expf((s_label - row_max) - log_sum_exp) - 1.f) + teacher_coef * t_label
                                   + student_coef * s_label;
          #pragma unroll
          for (int j = 0; j < 8; ++j)  // a constant index keeps g in registers
            if (j == j_label) g[j] = label_grad;
        }
        slice.grad_out[i] = make_uint4(pack(g[0], g[1]), pack(g[2], g[3]), pack(g[4], g[5]), pack(g[6], g[7]));
      }
    }
  }
  cluster_wait();  // no block leaves while another may still read its parts
}
