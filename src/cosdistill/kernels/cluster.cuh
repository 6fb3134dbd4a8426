// What the cluster row steps share (row_step.cu, row_step_jsd.cu): the slice layout's macros and each block's
// slice of its row, fast exponentials, asynchronous copies, cluster barriers and loads from another block's
// shared memory, bf16 packing. The Python side prepends it, after its #defines, to each kernel's source.
typedef unsigned short bf16_t;
#define NUM_WARPS (THREADS / 32)
#define ITERS ((SLICE_VECS + THREADS - 1) / THREADS)  // vectors per thread: i = tid + k * THREADS, k < ITERS
// Vector k < REGISTER_COLS of each thread stays in its registers, the others in shared memory: less shared
// memory per block, so more blocks share an SM.
#define TILE_VECS (SLICE_VECS - REGISTER_COLS * THREADS)  // per model, in shared memory
#define TILE_INDEX(i) ((i) - REGISTER_COLS * THREADS)  // of vector i, k >= REGISTER_COLS
// vector i = tid + k * THREADS of the slice
#define VECTOR(model, k, i) ((k) < REGISTER_COLS ? model##_regs[k] : model##_tile[TILE_INDEX(i)])
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h
#define QUIET_NAN __int_as_float(0x7fc00000)

#define LOG2E 1.4426950408889634f
__device__ __forceinline__ float exp2_fast(float x) {  // ex2.approx.ftz, as the Triton kernel's _exp
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_fast(float x) { return exp2_fast(x * LOG2E); }
__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_address(shared)), "l"(global) : "memory");
}
#define WAIT_CASE(n) case n: asm volatile("cp.async.wait_group " #n ";" ::: "memory"); break;
__device__ __forceinline__ void wait_copies(int pending) {  // at most `pending` of this thread's groups in flight
  switch (pending) {  // the count is an immediate; `pending` is a constant in the unrolled loops
    WAIT_CASE(0) WAIT_CASE(1) WAIT_CASE(2) WAIT_CASE(3) WAIT_CASE(4) WAIT_CASE(5) WAIT_CASE(6) WAIT_CASE(7)
    WAIT_CASE(8) WAIT_CASE(9) WAIT_CASE(10) WAIT_CASE(11) WAIT_CASE(12) WAIT_CASE(13) WAIT_CASE(14)
    default: asm volatile("cp.async.wait_group 15;" ::: "memory"); break;
  }
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
// Orders nothing: ptxas makes a release arrive a MEMBAR.ALL.GPU, which would wait for this block's
// outstanding global stores (the losses), not only for the shared memory the other blocks read.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ float peer_load(const float* local, unsigned rank) {  // the same address in block `rank`
  unsigned remote;
  float value;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
  return value;
}
// Where a block's slice of its row lies (clusters are consecutive blocks along x, a row each), and whether the
// row's label counts.
struct RowSlice {
  int rank;  // == %cluster_ctarank
  long long row, label;
  bool valid;  // the label is neither ignore_index nor outside the vocabulary
  bf16_t* student_row;
  int first_vec, vecs;  // vecs <= 0 for blocks past a short row
  uint4* grad_out;  // the slice of student_row that the gradient overwrites
};
__device__ __forceinline__ RowSlice row_slice(bf16_t* student, const LABEL_T* labels, int student_stride,
                                              int ignore_index) {
  RowSlice slice;
  slice.rank = blockIdx.x % CLUSTER;
  slice.row = blockIdx.x / CLUSTER;
  slice.label = (long long)labels[slice.row];
  slice.valid = slice.label != ignore_index && slice.label >= 0 && slice.label < VOCAB;
  slice.student_row = student + slice.row * student_stride;
  slice.first_vec = slice.rank * SLICE_VECS;
  slice.vecs = min(SLICE_VECS, VOCAB / 8 - slice.first_vec);
  slice.grad_out = reinterpret_cast<uint4*>(slice.student_row) + slice.first_vec;
  return slice;
}
// An ignored token's gradient: zero (its whole cluster then leaves).
__device__ __forceinline__ void zero_grad(const RowSlice& slice) {
  for (int i = threadIdx.x; i < slice.vecs; i += THREADS) slice.grad_out[i] = make_uint4(0u, 0u, 0u, 0u);
}
// The label's logit, for block 0's thread 0; read before the first cluster barrier, after which other blocks may
// overwrite the row with gradients.
__device__ __forceinline__ float target_logit(const RowSlice& slice) {
  return (slice.rank == 0 && threadIdx.x == 0) ? __uint_as_float((unsigned)slice.student_row[slice.label] << 16) : 0.f;
}
__device__ __forceinline__ void unpack(uint4 v, float* x) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[2 * j] = __uint_as_float(w[j] << 16);
    x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ float element(uint4 v, int j) {  // logit j of a packed vector, j at run time
  const unsigned w = j < 4 ? (j < 2 ? v.x : v.y) : (j < 6 ? v.z : v.w);
  return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16);
}
__device__ __forceinline__ unsigned pack(float lo, float hi) {  // round to nearest even, as .to(bf16)
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Merges running (max, sum of exp(x - max)) pairs; a pair that has seen nothing is (-inf, 0).
__device__ __forceinline__ void merge_softmax(float& run_max, float& run_sum, float other_max, float other_sum) {
  const float new_max = fmaxf(run_max, other_max);
  run_sum = new_max == NEG_INF ? 0.f : run_sum * exp_fast(run_max - new_max) + other_sum * exp_fast(other_max - new_max);
  run_max = new_max;
}
#if REGISTER_COLS  // cap the registers at what MIN_BLOCKS blocks per SM leave each thread
#define LAUNCH_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else  // ptxas's own choice (even a minimum of 1 block changes it)
#define LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif
