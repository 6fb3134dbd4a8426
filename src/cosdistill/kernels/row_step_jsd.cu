// The generalized JSD's row step with each logit read once, for Hopper clusters: row_step_jsd_cuda.py prepends
// its #defines (vocabulary, layout, label type, MODE, SHARED) and cluster.cuh, and compiles it
// with NVRTC at run time. The math is _row_step_jsd.py's, in base 2 and in the forms of row_step_jsd_triton.py
// (whose helpers say why each is formed as it is). A cluster holds one row in its blocks' shared memory (and
// registers); they reduce the row's statistics, then its soft sums, exchanging each through distributed shared
// memory, and write their slice's d L / d s from what they hold.
// The student's max and sums of 2^((s - max) scale) at T and unscaled; the teacher's max and sum; REVERSE's sixth,
// the teacher's largest logit among the student's max columns (its reference column, row_step_jsd_triton._referenced_gap).
#define NUM_STATS (MODE == REVERSE ? 6 : 5)
// The soft term's student sum (also the gradient's row sum) and teacher sum; REVERSE's second, which it has no
// teacher sum for, its row sum against the reference column (pass 3 takes the smaller of the two).
#define NUM_SUMS 2
#define FORWARD 0  // MODE: beta == 0, KL(q || p)
#define REVERSE 1  // beta == 1, KL(p || q)
#define MIXED 2  // 0 < beta < 1, against the mixture m = (1 - beta) p + beta q
// MIXED keeps each pair's log2 p - log2 m from pass 2 for pass 3, two SFU operations per pair fewer. In fp32: the
// gradient subtracts the row's sum from it, which a rounded gap does not survive on peaked rows. A register
// vector's gaps take its teacher registers' place; a shared one's its teacher tile and a third tile.
#define KEEP_GAP (MODE == MIXED)
#define LN2 0.6931471805599453f

__device__ __forceinline__ float log2_fast(float x) {  // lg2.approx.ftz, as the Triton kernel's _log2
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two sums of 2^((v - max) scale), each over its own max, as one over the larger max: the sum at the larger max
// stays, the other is scaled by 2^(-|max difference| scale). One exponential where moving both to the larger max
// takes two; the same numbers, as 2^0 = 1. Sums that have seen nothing are 0 at -inf (the factor is then unused).
__device__ __forceinline__ float merged_sum(float sum, float max, float other_sum, float other_max, float scale) {
  const float factor = exp2_fast(-fabsf(max - other_max) * scale);
  return (max >= other_max ? sum : sum * factor) + (other_max >= max ? other_sum : other_sum * factor);
}

// Merges `other` into `stats` (NUM_STATS each; one that has seen nothing is -inf, 0, 0, -inf, 0, -inf).
__device__ __forceinline__ void merge_stats(float* stats, const float* other, float x_scale) {
  if (MODE == REVERSE)  // the teacher at the larger student max, the larger of the two at a tie
    stats[5] = other[0] > stats[0] ? other[5] : other[0] == stats[0] ? fmaxf(stats[5], other[5]) : stats[5];
  stats[1] = merged_sum(stats[1], stats[0], other[1], other[0], x_scale);
  if (!SHARED) stats[2] = merged_sum(stats[2], stats[0], other[2], other[0], LOG2E);
  stats[0] = fmaxf(stats[0], other[0]);
  stats[4] = merged_sum(stats[4], stats[3], other[4], other[3], x_scale);
  stats[3] = fmaxf(stats[3], other[3]);
}

// The row's total of every thread's `part` (N values, merged by `merge`): over each warp, then the block (into
// `block_part`, which the cluster's other blocks read), then the cluster. Warp 0's threads end with it.
template <int N, typename Merge>
__device__ __forceinline__ void reduce_row(float* part, const float* empty, float (*warp_parts)[N], float* block_part,
                                           Merge merge) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto reduce_warp = [&]() {
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      float other[N];
      #pragma unroll
      for (int k = 0; k < N; ++k) other[k] = __shfl_xor_sync(0xffffffffu, part[k], offset);
      merge(part, other);
    }
  };
  reduce_warp();
  if (lane == 0)
    #pragma unroll
    for (int k = 0; k < N; ++k) warp_parts[warp][k] = part[k];
  __syncthreads();
  if (warp == 0) {
    #pragma unroll
    for (int k = 0; k < N; ++k) part[k] = lane < NUM_WARPS ? warp_parts[lane][k] : empty[k];
    reduce_warp();
    if (lane == 0)
      #pragma unroll
      for (int k = 0; k < N; ++k) block_part[k] = part[k];
  }
  cluster_arrive();  // block_part written
  cluster_wait();
  if (warp == 0) {  // lane r reads block r's part
    #pragma unroll
    for (int k = 0; k < N; ++k) part[k] = lane < CLUSTER ? peer_load(&block_part[k], lane) : empty[k];
    reduce_warp();
  }
}

// (log2 p - log2 m, log2 q - log2 m) from d = log2 q - log2 p alone, given smaller = 2^-|d|: the MIXED form of
// row_step_jsd_triton._minus_mixture (whose third value, the shifted gap, MIXED does not use).
__device__ __forceinline__ void minus_mixture(float d, float smaller, float keep, float beta, float& student_gap,
                                              float& teacher_gap) {
  const float log_spread = log2_fast(d >= 0.f ? beta + keep * smaller : keep + beta * smaller);
  student_gap = -log_spread - fmaxf(d, 0.f);
  teacher_gap = fminf(d, 0.f) - log_spread;
}

// One slice's vector of d L / d s to bf16, with the one-hot of the label (if this vector holds it) taken off.
__device__ __forceinline__ uint4 grad_vector(float* g, bool holds_label, int label_lane, float weight_hard) {
  if (holds_label)
    #pragma unroll
    for (int j = 0; j < 8; ++j)  // a constant index keeps g in registers
      if (j == label_lane) g[j] -= weight_hard;
  return make_uint4(pack(g[0], g[1]), pack(g[2], g[3]), pack(g[4], g[5]), pack(g[6], g[7]));
}

#if HASH_ROW_VECS
// A weight's hash (_fingerprint.py, with kernels/fingerprint.py's numbers) taken along by the step: each block
// hashes its share of the weight's rows of 32-bit words (HASH_ROW_VECS 16-byte vectors each), each word mixed, into
// its partial lanes, which the caller sums mod 2^32. Its reads fill HBM time that the step, held by its exponentials, leaves.
#define HASH_PARAMS , const uint4* hash_words, int hash_rows, int hash_stride, unsigned* hash_partials
__device__ __forceinline__ unsigned hash_mix(unsigned word) {  // _fingerprint.mix_words_torch: a bijection
  word *= HASH_MIX_MULTIPLIER_0;
  word ^= word >> HASH_MIX_SHIFT_0;
  word *= HASH_MIX_MULTIPLIER_1;
  return word ^ (word >> HASH_MIX_SHIFT_1);
}
__device__ __forceinline__ unsigned hash_key(unsigned position, unsigned multiplier, unsigned increment) {
  return hash_mix(position * multiplier + increment) | 1u;  // mod 2^32, odd
}
__device__ void hash_share(const uint4* words, int rows, int stride, unsigned* partials, unsigned (*warp_lanes)[2]) {
  const int per_block = (rows + gridDim.x - 1) / gridDim.x;
  const int first = blockIdx.x * per_block, last = min(rows, first + per_block);
  unsigned lanes[2] = {0u, 0u};
  // Column by column down the block's rows: each word's column key is made once, not once per row.
  for (int vec = threadIdx.x; vec < HASH_ROW_VECS; vec += THREADS) {
    unsigned column_sums[4][2] = {{0u, 0u}, {0u, 0u}, {0u, 0u}, {0u, 0u}};  // sum over rows of row_key(r) b[r, c]
    #pragma unroll 4
    for (int row = first; row < last; ++row) {
      const uint4 w = __ldcs(words + (long long)row * stride + vec);  // streamed: read once
      const unsigned bits[4] = {hash_mix(w.x), hash_mix(w.y), hash_mix(w.z), hash_mix(w.w)};
      const unsigned row_keys[2] = {hash_key((unsigned)row, HASH_KEY_00, HASH_KEY_01),
                                    hash_key((unsigned)row, HASH_KEY_10, HASH_KEY_11)};
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        column_sums[j][0] += bits[j] * row_keys[0];
        column_sums[j][1] += bits[j] * row_keys[1];
      }
    }
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      lanes[0] += column_sums[j][0] * hash_key(4 * vec + j, HASH_KEY_02, HASH_KEY_03);
      lanes[1] += column_sums[j][1] * hash_key(4 * vec + j, HASH_KEY_12, HASH_KEY_13);
    }
  }
  #pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    lanes[0] += __shfl_xor_sync(0xffffffffu, lanes[0], offset);
    lanes[1] += __shfl_xor_sync(0xffffffffu, lanes[1], offset);
  }
  if (threadIdx.x % 32 == 0) {
    warp_lanes[threadIdx.x / 32][0] = lanes[0];
    warp_lanes[threadIdx.x / 32][1] = lanes[1];
  }
  __syncthreads();
  if (threadIdx.x < 2) {
    unsigned total = 0u;
    for (int warp = 0; warp < NUM_WARPS; ++warp) total += warp_lanes[warp][threadIdx.x];
    partials[2 * blockIdx.x + threadIdx.x] = total;
  }
  __syncthreads();  // warp_lanes is the step's warp_sums
}
#else
#define HASH_PARAMS
#endif

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) LAUNCH_BOUNDS
cluster_jsd_row_step(bf16_t* student, const bf16_t* teacher, const LABEL_T* labels, float* losses,
                     int student_stride, int teacher_stride, int ignore_index,
                     double weight_hard_in, double soft_coef_in, double x_scale_in, double keep_in, double beta_in
                     HASH_PARAMS) {
  extern __shared__ uint4 tiles[];  // this block's slice but its register vectors: the student's, the teacher's, gaps
  __shared__ float warp_stats[NUM_WARPS][NUM_STATS], warp_sums[NUM_WARPS][NUM_SUMS];
  __shared__ float block_stats[NUM_STATS], block_sums[NUM_SUMS];  // read by the cluster's other blocks
  // top_s, norm_x, norm_z, top_t, norm_y; the gradient's row sum; REVERSE's teacher at the student's top, then the
  // teacher logit and normaliser gap its pass 3 forms its g against (row_step_jsd_triton._row_reference's choice)
  __shared__ float row_consts[9];
#if HASH_ROW_VECS
  hash_share(hash_words, hash_rows, hash_stride, hash_partials, reinterpret_cast<unsigned (*)[2]>(warp_sums));
#endif
  const float weight_hard = (float)weight_hard_in, soft_coef = (float)soft_coef_in;  // soft_coef = weight_soft / T
  const float x_scale = (float)x_scale_in, keep = (float)keep_in, beta = (float)beta_in;  // log2(e) / T, 1 - beta
  const int tid = threadIdx.x;
  const RowSlice slice = row_slice(student, labels, student_stride, ignore_index);
  if (!slice.valid) {  // an ignored token: zero gradient and losses
    zero_grad(slice);
    if (slice.rank == 0 && tid == 0) losses[2 * slice.row] = losses[2 * slice.row + 1] = 0.f;
    return;
  }
  const float target = target_logit(slice);
  const uint4* student_src = reinterpret_cast<const uint4*>(slice.student_row) + slice.first_vec;
  const uint4* teacher_src = reinterpret_cast<const uint4*>(teacher + slice.row * teacher_stride) + slice.first_vec;
  uint4* student_tile = tiles;
  uint4* teacher_tile = tiles + TILE_VECS;
  uint4* gap_tile = tiles + 2 * TILE_VECS;  // KEEP_GAP: each vector's last four gaps (the teacher tile: its first)
  uint4 student_regs[REGISTER_COLS + 1], teacher_regs[REGISTER_COLS + 1];  // + 1: no zero-length arrays
  float gap_regs[REGISTER_COLS + 1][8];  // KEEP_GAP
  #pragma unroll
  for (int k = 0; k < REGISTER_COLS; ++k) {
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      student_regs[k] = __ldcg(student_src + i);
      teacher_regs[k] = __ldcg(teacher_src + i);
    }
  }
  #pragma unroll
  for (int k = REGISTER_COLS; k < ITERS; ++k) {  // one copy group per k, so the reduction starts on the first early
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      copy_async(student_tile + TILE_INDEX(i), student_src + i);
      copy_async(teacher_tile + TILE_INDEX(i), teacher_src + i);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // Pass 1: each thread's statistics of the vectors it copied itself (no block barrier before), per vector
  // one max and then one exponential per logit and stream.
  float stats[6] = {NEG_INF, 0.f, 0.f, NEG_INF, 0.f, NEG_INF};  // the first NUM_STATS
  #pragma unroll
  for (int k = 0; k < ITERS; ++k) {
    if (k >= REGISTER_COLS) wait_copies(ITERS - 1 - k);
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      float s[8], t[8];
      unpack(VECTOR(student, k, i), s);
      unpack(VECTOR(teacher, k, i), t);
      float vec[6] = {s[0], 0.f, 0.f, t[0], 0.f, NEG_INF};
      #pragma unroll
      for (int j = 1; j < 8; ++j) {
        vec[0] = fmaxf(vec[0], s[j]);
        vec[3] = fmaxf(vec[3], t[j]);
      }
      if (MODE == REVERSE)
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          if (s[j] == vec[0]) vec[5] = fmaxf(vec[5], t[j]);
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float student_distance = s[j] - vec[0];
        vec[1] += exp2_fast(student_distance * x_scale);
        if (!SHARED) vec[2] += exp2_fast(student_distance * LOG2E);
        vec[4] += exp2_fast((t[j] - vec[3]) * x_scale);
      }
      merge_stats(stats, vec, x_scale);
    }
  }
  const float empty_stats[6] = {NEG_INF, 0.f, 0.f, NEG_INF, 0.f, NEG_INF};
  reduce_row<NUM_STATS>(stats, empty_stats, warp_stats, block_stats,
                        [&](float* mine, const float* other) { merge_stats(mine, other, x_scale); });
  if (tid == 0) {  // log2 p = (s - top_s) x_scale - norm_x, log2 softmax(s) = (s - top_s) log2(e) - norm_z, ...
    row_consts[0] = stats[0];
    row_consts[1] = log2f(stats[1]);
    row_consts[2] = SHARED ? row_consts[1] : log2f(stats[2]);
    row_consts[3] = stats[3];
    row_consts[4] = log2f(stats[4]);
    if (MODE == REVERSE) row_consts[6] = stats[5];
  }
  __syncthreads();
  const float top_s = row_consts[0], norm_x = row_consts[1], norm_z = row_consts[2];
  const float top_t = row_consts[3], norm_y = row_consts[4];
  const float teacher_at_top = MODE == REVERSE ? row_consts[6] : 0.f;
  const float norm_gap = norm_x - norm_y;
  const long long label_vec = slice.label / 8 - slice.first_vec;
  const int label_lane = slice.label % 8;

  // Pass 2: the soft sums; FORWARD also writes the gradient, whose soft part (p - q) / T needs no row sum.
  float sums[NUM_SUMS] = {0.f, 0.f};
  #pragma unroll
  for (int k = 0; k < ITERS; ++k) {
    const int i = tid + k * THREADS;
    if (i < slice.vecs) {
      float s[8], t[8], g[8];  // MIXED: g holds the student gaps
      unpack(VECTOR(student, k, i), s);
      unpack(VECTOR(teacher, k, i), t);
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float student_distance = s[j] - top_s, teacher_distance = t[j] - top_t;
        const float a = student_distance * x_scale - norm_x;
        const float b = teacher_distance * x_scale - norm_y;
        const float d = (teacher_distance - student_distance) * x_scale + norm_gap;
        if (MODE == FORWARD) {
          const float q = exp2_fast(b);
          sums[1] += q * d;
          const float p = exp2_fast(a);
          const float hard_prob = SHARED ? p : exp2_fast(student_distance * LOG2E - norm_z);
          g[j] = weight_hard * hard_prob + soft_coef * (p - q);
        } else if (MODE == REVERSE) {  // the loss's sum (also the unreferenced row sum), and the referenced one
          const float p = exp2_fast(a);
          sums[0] -= p * d;
          sums[1] -= p * (((t[j] - teacher_at_top) - student_distance) * x_scale);
        } else {  // p and q from one exponential of the larger and the ratio 2^-|d| that the mixture needs anyway
          const float smaller = exp2_fast(-fabsf(d));
          const float larger_prob = exp2_fast(fmaxf(a, b)), smaller_prob = larger_prob * smaller;
          float teacher_gap;
          minus_mixture(d, smaller, keep, beta, g[j], teacher_gap);
          sums[0] += (d >= 0.f ? smaller_prob : larger_prob) * g[j];
          sums[1] += beta * (d >= 0.f ? larger_prob : smaller_prob) * teacher_gap;
        }
      }
      if (MODE == FORWARD) slice.grad_out[i] = grad_vector(g, i == label_vec, label_lane, weight_hard);
      if (KEEP_GAP && k < REGISTER_COLS) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) gap_regs[k][j] = g[j];
      } else if (KEEP_GAP) {
        teacher_tile[TILE_INDEX(i)] = make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]), __float_as_uint(g[2]),
                                                 __float_as_uint(g[3]));
        gap_tile[TILE_INDEX(i)] = make_uint4(__float_as_uint(g[4]), __float_as_uint(g[5]), __float_as_uint(g[6]),
                                             __float_as_uint(g[7]));
      }
    }
  }
  const float empty_sums[NUM_SUMS] = {0.f, 0.f};
  reduce_row<NUM_SUMS>(sums, empty_sums, warp_sums, block_sums, [](float* mine, const float* other) {
    mine[0] += other[0];
    mine[1] += other[1];
  });
  if (tid == 0) {
    row_consts[5] = sums[0];  // sum_j p_j (log2 p_j - x_j): the gradient's row sum
    if (MODE == REVERSE && fabsf(sums[1]) < fabsf(sums[0])) {  // the row's form: the smaller row sum
      row_consts[5] = sums[1];
      row_consts[7] = teacher_at_top;
      row_consts[8] = 0.f;
    } else if (MODE == REVERSE) {
      row_consts[7] = top_t;
      row_consts[8] = norm_gap;
    }
    if (slice.rank == 0) {
      losses[2 * slice.row] = (top_s - target) + LN2 * norm_z;  // logsumexp(s) - s[label]
      losses[2 * slice.row + 1] = LN2 * (MODE == FORWARD ? sums[1] : MODE == REVERSE ? sums[0] : keep * sums[0] + sums[1]);
    }
  }
  // Done reading the other blocks' sums (they are in registers): they may exit once all arrived.
  cluster_arrive_relaxed();

  // Pass 3: REVERSE and MIXED subtract each row's sum_j p_j g_j, known only now.
  if (MODE != FORWARD) {
    __syncthreads();
    const float row_sum = row_consts[5];
    const float gap_teacher = MODE == REVERSE ? row_consts[7] : 0.f, gap_norm = MODE == REVERSE ? row_consts[8] : 0.f;
    const float log_coef = soft_coef * LN2 * (MODE == MIXED ? keep : 1.f);
    #pragma unroll
    for (int k = 0; k < ITERS; ++k) {
      const int i = tid + k * THREADS;
      if (i < slice.vecs) {
        float s[8], other[8], g[8];  // other: REVERSE's teacher logits, MIXED's kept gaps
        unpack(VECTOR(student, k, i), s);
        if (KEEP_GAP && k < REGISTER_COLS) {
          #pragma unroll
          for (int j = 0; j < 8; ++j) other[j] = gap_regs[k][j];
        } else if (KEEP_GAP) {
          const uint4 first = teacher_tile[TILE_INDEX(i)], last = gap_tile[TILE_INDEX(i)];
          const unsigned words[8] = {first.x, first.y, first.z, first.w, last.x, last.y, last.z, last.w};
          #pragma unroll
          for (int j = 0; j < 8; ++j) other[j] = __uint_as_float(words[j]);
        } else {
          unpack(VECTOR(teacher, k, i), other);
        }
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float student_distance = s[j] - top_s;
          const float a = student_distance * x_scale - norm_x;
          const float p = exp2_fast(a);
          const float hard_prob = SHARED ? p : exp2_fast(student_distance * LOG2E - norm_z);
          const float student_gap =  // log2 p - log2 m, or REVERSE's log2 p - log2 q (less its value at the reference)
              KEEP_GAP ? other[j] : -(((other[j] - gap_teacher) - student_distance) * x_scale + gap_norm);
          // p first: log_coef times the bracket can pass fp32's range near T = 0, where p is 0
          g[j] = weight_hard * hard_prob + (p * log_coef) * (student_gap - row_sum);
        }
        slice.grad_out[i] = grad_vector(g, i == label_vec, label_lane, weight_hard);
      }
    }
  }
  cluster_wait();  // no block leaves while another may still read its sums
}
