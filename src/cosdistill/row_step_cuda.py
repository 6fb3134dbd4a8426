"""The row step with each logit read once: a CUDA kernel for Hopper, compiled at run time by NVRTC.

The Triton row step (``row_step_triton.py``) reads every student and teacher logit twice, once for the
row's statistics and once for its gradient, because a row (0.5 MB at V = 128256) does not fit on one
SM. Here a cluster of 8 or 16 thread blocks on as many SMs holds one row in their shared memory: each
block copies its slice of the row in (cp.async), reduces its partial statistics, the blocks exchange
them through distributed shared memory, and each writes its slice's d loss / d s from shared memory.
Where it lets more blocks share an SM, part of each slice stays in the threads' registers instead
(``Layout.register_cols``).
HBM moves two reads and one write per logit pair instead of four reads and one write (docs/design.md,
The row step). Triton 3.6 cannot express clusters; NVRTC ships with torch's
CUDA build (``torch.cuda._compile_kernel``), so users need no compiler.

Only the common case takes this path (``supported``): bf16 logits of one vocabulary size V (a multiple
of 8), gradients wanted, no softcap, logit scale, fp16 lifts or vocabulary split. Everything else, and
rows whose sums overflow fp32 (left untouched with NaN losses, as the Triton kernel's first launch
leaves them), goes through the Triton kernels. The math is row_step.py's, as in the Triton twin.

Compiled with TEACHER 0 (``models=1``) it is the Gram path's row step (gram.py, ``gram_row_step_cuda``):
the student's logits alone, each row's s.t and |t|^2 given, each row's coefficient of t written out;
no rescue there (a row whose sums overflow gets NaN losses and gradient, as gram.py's range says).
"""

import ctypes
import functools
from typing import NamedTuple

import torch

from .row_step import COSINE_EPS, RowStepImpl, RowStepScales
from .row_step_triton import row_grad_triton, row_stats_triton, row_step_triton

MAX_SHARED_BYTES = 200 * 1024  # beside the static shared memory, under the H200's 227 KB per block
_LOCAL_SIZE_BYTES, _NUM_REGS, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 3, 4, 14  # CUfunction_attribute
_LABEL_TYPES = {torch.int64: "long long", torch.int32: "int"}

_SOURCE = r"""
typedef unsigned short bf16_t;
#define NUM_WARPS (THREADS / 32)
#define ITERS ((SLICE_VECS + THREADS - 1) / THREADS)  // vectors per thread: i = tid + k * THREADS, k < ITERS
// Vector k < REGISTER_COLS of each thread stays in its registers, the others in shared memory: less shared
// memory per block, so more blocks share an SM.
#define TILE_VECS (SLICE_VECS - REGISTER_COLS * THREADS)  // per model, in shared memory
#define TILE_INDEX(i) ((i) - REGISTER_COLS * THREADS)  // of vector i, k >= REGISTER_COLS
// vector i = tid + k * THREADS of the slice
#define VECTOR(model, k, i) ((k) < REGISTER_COLS ? model##_regs[k] : model##_tile[TILE_INDEX(i)])
#define NUM_PARTS 5  // max, sum of exp, s.t, |s|^2, |t|^2
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

#if REGISTER_COLS  // cap the registers at what MIN_BLOCKS blocks per SM leave each thread
#define LAUNCH_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else  // ptxas's own choice (even a minimum of 1 block changes it)
#define LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) LAUNCH_BOUNDS
cluster_row_step(bf16_t* student, const bf16_t* teacher, const LABEL_T* labels, float* losses,
                 int student_stride, int teacher_stride, int ignore_index,
                 double weight_hard, double weight_soft, double beta, double inv_temp_sq,
                 const float* teacher_products, float* teacher_coefs) {
  // TEACHER 0 (the Gram path, gram.py): no teacher logits; each row's s.t and |t|^2 come in teacher_products
  // and the coefficient of t in d L / d s goes out in teacher_coefs (row_step.teacher_grad_coefficient).
  extern __shared__ uint4 tiles[];  // this block's slice but its register vectors: TILE_VECS student vectors, then the teacher's
  __shared__ float warp_parts[NUM_WARPS][NUM_PARTS];
  __shared__ float block_parts[NUM_PARTS];  // read by the cluster's other blocks
  __shared__ float row_coefs[6];  // row max, log sum exp, the three gradient coefficients, usable
  const int rank = blockIdx.x % CLUSTER;  // == %cluster_ctarank: clusters are consecutive blocks along x
  const long long row = blockIdx.x / CLUSTER;
  const int tid = threadIdx.x;
  const long long label = (long long)labels[row];
  const bool valid = label != ignore_index && label >= 0 && label < VOCAB;
  bf16_t* student_row = student + row * student_stride;
  const int first_vec = rank * SLICE_VECS;
  const int slice_vecs = min(SLICE_VECS, VOCAB / 8 - first_vec);  // <= 0 for blocks past a short row
  uint4* grad_out = reinterpret_cast<uint4*>(student_row) + first_vec;
  if (!valid) {  // an ignored token: no gradient, zero losses (the whole cluster leaves here)
    for (int i = tid; i < slice_vecs; i += THREADS) grad_out[i] = make_uint4(0u, 0u, 0u, 0u);
    if (rank == 0 && tid == 0) {
      losses[2 * row] = losses[2 * row + 1] = 0.f;
#if !TEACHER
      teacher_coefs[row] = 0.f;
#endif
    }
    return;
  }
  const float target = (rank == 0 && tid == 0) ? __uint_as_float((unsigned)student_row[label] << 16) : 0.f;
  const uint4* student_src = reinterpret_cast<const uint4*>(student_row) + first_vec;
  uint4* student_tile = tiles;
  uint4 student_regs[REGISTER_COLS + 1];  // + 1: no zero-length arrays
#if TEACHER
  const uint4* teacher_src = reinterpret_cast<const uint4*>(teacher + row * teacher_stride) + first_vec;
  uint4* teacher_tile = tiles + TILE_VECS;
  uint4 teacher_regs[REGISTER_COLS + 1];
#endif
  #pragma unroll
  for (int k = 0; k < REGISTER_COLS; ++k) {
    const int i = tid + k * THREADS;
    if (i < slice_vecs) {
      student_regs[k] = __ldcg(student_src + i);
#if TEACHER
      teacher_regs[k] = __ldcg(teacher_src + i);
#endif
    }
  }
  #pragma unroll
  for (int k = REGISTER_COLS; k < ITERS; ++k) {  // one copy group per k, so the reduction starts on the first early
    const int i = tid + k * THREADS;
    if (i < slice_vecs) {
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
    if (i < slice_vecs) {
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
    if (lane == 0) {  // row_step.py's losses and gradient coefficients (Triton: _row_losses, _grad_coefficients)
#if !TEACHER
      part[2] = teacher_products[2 * row];
      part[4] = teacher_products[2 * row + 1];
#endif
      const float eps = COSINE_EPS;
      const float inv_t2 = (float)inv_temp_sq;
      const float total = part[3] + part[4] + fabsf(part[2]);
      const bool usable = !(total > 3.4028234663852886e38f || total != total);
      const float log_sum_exp = logf(part[1]);
      const float norm_student = sqrtf(part[3] * inv_t2);
      const float clamped_student = fmaxf(norm_student, eps);
      const float clamped_teacher = fmaxf(sqrtf(part[4] * inv_t2), eps);
      const float cos = part[2] * inv_t2 / clamped_student / clamped_teacher;
      if (rank == 0) {
        losses[2 * row] = usable ? (part[0] - target) + log_sum_exp : QUIET_NAN;
        losses[2 * row + 1] = usable ? (float)beta * (1.f - cos) : QUIET_NAN;
      }
      const float soft_scale = (float)weight_soft * (float)beta;
      const float coef_teacher = inv_t2 / (clamped_student * clamped_teacher);
      const float coef_student = norm_student >= eps ? cos * inv_t2 / (clamped_student * clamped_student) : 0.f;
      row_coefs[0] = part[0];
      row_coefs[1] = log_sum_exp;
      row_coefs[2] = (float)weight_hard;
      row_coefs[3] = -soft_scale * coef_teacher;
      row_coefs[4] = soft_scale * coef_student;
      row_coefs[5] = usable ? 1.f : 0.f;
#if !TEACHER  // no Triton rescue on the Gram path: a row whose sums overflow gets NaN losses and gradient
      if (!usable) row_coefs[2] = row_coefs[3] = row_coefs[4] = QUIET_NAN;
      row_coefs[5] = 1.f;
      if (rank == 0) teacher_coefs[row] = row_coefs[3];
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
    const long long label_vec = label / 8 - first_vec;
    #pragma unroll
    for (int k = 0; k < ITERS; ++k) {
      const int i = tid + k * THREADS;
      if (i < slice_vecs) {
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
          const int j_label = label % 8;
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
        grad_out[i] = make_uint4(pack(g[0], g[1]), pack(g[2], g[3]), pack(g[4], g[5]), pack(g[6], g[7]));
      }
    }
  }
  cluster_wait();  // no block leaves while another may still read its parts
}
"""


class Layout(NamedTuple):
    """How one row spreads over a cluster: blocks, threads per block, and how many of each thread's
    vectors stay in its registers instead of shared memory."""
    cluster: int
    threads: int
    register_cols: int = 0


def launch_configs(vocab: int, models: int = 2) -> list[Layout]:
    """The layouts _launch tries in turn, from the H200 sweeps of items 56, 65 and 67: about 32 KB of
    shared memory per block (several blocks share an SM and cover each other's idle phases), and where
    that leaves fewer than 8 blocks per SM, up to a third of each thread's vectors in registers: the
    layouts with the most blocks per SM first, then the most warps, then the fewest register vectors.
    Only ptxas knows which of them spill within the registers that __launch_bounds__ leaves, so _launch
    compiles them in turn; the last has no register vectors, so no bound. 16 blocks is past the
    portable cluster size; Hopper allows it. ``models``: 2, or 1 for the Gram path's student logits alone
    (the same rules, not swept on their own)."""
    cluster = 8 if _shared_bytes(vocab, 8, models=models) <= 48 * 1024 else 16
    slice_vecs = _slice_vecs(vocab, cluster)
    plain = Layout(cluster, 128 if slice_vecs <= 1024 else 256)

    def blocks(layout):
        return _blocks_per_sm(_shared_bytes(vocab, *layout, models=models), layout.threads)

    if blocks(plain) >= 8:  # the synchronous register loads cost more than a ninth block gains
        return [plain]
    with_registers = [Layout(cluster, threads, register_cols) for threads in range(128, 257, 32)
                      for register_cols in range(1, -(-slice_vecs // threads) // 3 + 1)]
    # At least 32 registers and 4 more per model and register vector: ptxas's least without a spill.
    with_registers = [layout for layout in with_registers if _shared_bytes(vocab, *layout, models=models) >= 0
                      and (32 + 4 * models * layout.register_cols) * layout.threads * blocks(layout) <= 65536]
    with_registers.sort(key=lambda layout: (-blocks(layout), -blocks(layout) * layout.threads, layout.register_cols))
    return [layout for layout in with_registers[:3] if blocks(layout) > blocks(plain)] + [plain]


def _slice_vecs(vocab: int, cluster: int) -> int:
    """16-byte vectors (8 logits) of the row per block."""
    return -(-vocab // (8 * cluster))


def _shared_bytes(vocab: int, cluster: int, threads: int = 0, register_cols: int = 0, models: int = 2) -> int:
    """Dynamic shared memory per block: the models' slices but the vectors held in registers."""
    return models * 16 * (_slice_vecs(vocab, cluster) - register_cols * threads)


def _blocks_per_sm(shared_bytes: int, threads: int) -> int:
    """Blocks an SM holds by shared memory (Hopper: 228 KB per SM, 1 KB reserved per block), threads (2048)
    and blocks (32). With vectors in registers, __launch_bounds__ caps the registers so that they allow
    as many; without, ptxas picks the count itself."""
    static_bytes = -(-(threads // 32 * 5 + 5 + 6) * 4 // 16) * 16  # warp_parts, block_parts, row_coefs
    return max(1, min((228 * 1024) // (shared_bytes + 1024 + static_bytes), 2048 // threads, 32))


def source(vocab: int, label_dtype: torch.dtype, layout: Layout, models: int = 2) -> str:
    shared = _shared_bytes(vocab, *layout, models=models)
    if shared < 0 or layout.register_cols < 0:
        raise ValueError(f"{layout} holds more vectors per block in registers than the {_slice_vecs(vocab, layout.cluster)} "
                         f"of a vocab-{vocab} slice")
    defines = dict(CLUSTER=layout.cluster, THREADS=layout.threads, REGISTER_COLS=layout.register_cols,
                   MIN_BLOCKS=_blocks_per_sm(shared, layout.threads), VOCAB=vocab,
                   SLICE_VECS=_slice_vecs(vocab, layout.cluster), LABEL_T=_LABEL_TYPES[label_dtype],
                   COSINE_EPS=f"{COSINE_EPS!r}f", TEACHER=int(models == 2))
    return "".join(f"#define {name} {value}\n" for name, value in defines.items()) + _SOURCE


@functools.lru_cache(maxsize=None)  # asked every call; a device's capability never changes
def available(device: torch.device) -> bool:
    """NVRTC through torch, and a GPU with thread block clusters (Hopper or newer)."""
    return (device.type == "cuda" and hasattr(torch.cuda, "_compile_kernel") and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def applies(dtype: torch.dtype, vocab_student: int, vocab_teacher: int, scales: RowStepScales) -> bool:
    """Whether the kernel computes row_step.py's step for logits of this kind (layout and device aside)."""
    plain = (scales.student_softcap is None and scales.teacher_softcap is None and scales.student_logit_scale == 1.0
             and scales.teacher_logit_scale == 1.0 and scales.vocab_start == 0
             and scales.vocab_student_total in (None, vocab_student) and -2**31 <= scales.ignore_index < 2**31)
    return (plain and dtype == torch.bfloat16 and vocab_student == vocab_teacher and vocab_student % 8 == 0
            and _shared_bytes(vocab_student, 16) <= MAX_SHARED_BYTES)


def supported(student_logits, teacher_logits, labels, scales: RowStepScales, write_grad, grad_lifts) -> bool:
    """Whether this kernel computes exactly what row_step.py asks for these arguments."""
    rows, vocab = student_logits.shape
    return (write_grad and grad_lifts is None and rows > 0 and teacher_logits.dtype == student_logits.dtype
            and teacher_logits.shape[0] == rows and applies(student_logits.dtype, vocab, teacher_logits.shape[1], scales)
            and labels.dtype in _LABEL_TYPES and labels.is_contiguous()
            and student_logits.stride(1) == teacher_logits.stride(1) == 1
            and student_logits.stride(0) % 8 == 0 and teacher_logits.stride(0) % 8 == 0
            and student_logits.data_ptr() % 16 == 0 and teacher_logits.data_ptr() % 16 == 0
            and available(student_logits.device))


class _CuLaunchConfig(ctypes.Structure):  # the driver's CUlaunchConfig, for the occupancy query
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _kernel(vocab: int, label_dtype: torch.dtype, device_index: int, layout: Layout, models: int = 2):
    """The compiled kernel, or None where not one cluster of it fits on the device (16 blocks need a GPC
    with 16 free SMs, which a MIG slice may not have) or where this NVRTC spills its registers to local
    memory within the __launch_bounds__ of the register vectors."""
    driver, check = torch.cuda._utils._get_gpu_runtime_library(), torch.cuda._utils._check_cuda
    shared = _shared_bytes(vocab, *layout, models=models)
    with torch.cuda.device(device_index):
        try:
            kernel = torch.cuda._compile_kernel(source(vocab, label_dtype, layout, models), "cluster_row_step",
                                                nvcc_options=["-std=c++17"])
        except RuntimeError as error:
            raise RuntimeError(f"compiling the CUDA row step (row_step_cuda.py) failed; impl='triton' runs "
                               f"without it: {error}") from error
        kernel.set_shared_memory_config(shared)
        if layout.cluster > 8:  # past the portable size the launch must opt in
            check(driver.cuFuncSetAttribute(kernel.func, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
        fits = max_active_clusters(kernel, layout, shared) > 0 and kernel_attribute(kernel, _LOCAL_SIZE_BYTES) == 0
    return kernel if fits else None


def kernel_attribute(kernel, attribute: int) -> int:
    """A compiled kernel's CUfunction_attribute (the study prints its registers, _NUM_REGS)."""
    driver, check = torch.cuda._utils._get_gpu_runtime_library(), torch.cuda._utils._check_cuda
    value = ctypes.c_int()
    check(driver.cuFuncGetAttribute(ctypes.byref(value), attribute, kernel.func))
    return value.value


def max_active_clusters(kernel, layout: Layout, shared_bytes: int) -> int:
    """Clusters of this compiled kernel the current device holds at once (the driver's occupancy query)."""
    driver, check = torch.cuda._utils._get_gpu_runtime_library(), torch.cuda._utils._check_cuda
    config = _CuLaunchConfig((layout.cluster, 1, 1), (layout.threads, 1, 1), shared_bytes, None, None, 0)
    clusters = ctypes.c_int()
    check(driver.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), kernel.func, ctypes.byref(config)))
    return clusters.value


@functools.lru_cache(maxsize=None)
def _launch(vocab: int, label_dtype: torch.dtype, device_index: int, models: int = 2):
    """(kernel, layout) at the first of launch_configs' layouts that fits without a spill; else at 8 blocks
    of 256 threads (where 16 blocks do not fit); None where none does (the Triton step runs instead)."""
    layouts = launch_configs(vocab, models)
    for layout in layouts + [Layout(8, 256)] if layouts[0].cluster > 8 else layouts:
        if _shared_bytes(vocab, *layout, models=models) <= MAX_SHARED_BYTES:
            kernel = _kernel(vocab, label_dtype, device_index, layout, models)
            if kernel is not None:
                return kernel, layout
    return None


def cluster_kernel(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses,
                   layout: Layout | None = None) -> None:
    """The kernel alone, for ``supported`` arguments (layout: _launch's unless given): rows whose sums
    overflow fp32 are left with NaN losses and their logits."""
    vocab = student_logits.shape[1]
    device = student_logits.device
    if layout:
        kernel = _kernel(vocab, labels.dtype, device.index, layout)
        if kernel is None:
            raise ValueError(f"no cluster of {layout} fits on {device}, or it spills registers")
    else:
        kernel, layout = _launch(vocab, labels.dtype, device.index)
    launch(kernel, layout, student_logits, teacher_logits, labels, scales, token_losses)


def launch(kernel, layout: Layout, student_logits, teacher_logits, labels, scales, token_losses,
           teacher_products=None, teacher_coefs=None) -> None:
    """One launch of a compiled kernel of this source (benchmarks/cluster_row_step_study.py times variants);
    teacher_logits None: the one-model kernel with teacher_products and teacher_coefs (gram_row_step_cuda)."""
    rows, vocab = student_logits.shape
    device = student_logits.device
    models = 1 if teacher_logits is None else 2
    if teacher_logits is None:  # never read: the one-model kernel takes no teacher pointer's rows
        teacher_logits = student_logits
    else:  # never read either: the two-model kernel leaves these alone
        teacher_products = teacher_coefs = token_losses
    with torch.cuda.device(device):  # the tensors' device and stream, whichever device is current
        kernel(grid=(rows * layout.cluster, 1, 1), block=(layout.threads, 1, 1),
               shared_mem=_shared_bytes(vocab, *layout, models=models),
               args=[student_logits, teacher_logits, labels, token_losses, student_logits.stride(0),
                     teacher_logits.stride(0), scales.ignore_index, float(scales.weight_hard),
                     float(scales.weight_soft), float(scales.beta), 1.0 / (scales.temperature * scales.temperature),
                     teacher_products, teacher_coefs],
               stream=torch.cuda.current_stream(device))


def row_step_cuda(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses, write_grad,
                  grad_lifts=None) -> None:
    """row_step.row_step_torch: this kernel and the Triton RESCUE launch where ``supported``, else Triton."""
    if not (supported(student_logits, teacher_logits, labels, scales, write_grad, grad_lifts)
            and token_losses.is_contiguous() and _launch(student_logits.shape[1], labels.dtype,
                                                          student_logits.device.index) is not None):
        row_step_triton(student_logits, teacher_logits, labels, scales, token_losses, write_grad, grad_lifts)
        return
    cluster_kernel(student_logits, teacher_logits, labels, scales, token_losses)
    row_step_triton(student_logits, teacher_logits, labels, scales, token_losses, write_grad, rescue_only=True)


def gram_row_step_cuda(student_logits, labels, scales: RowStepScales, token_losses, teacher_products,
                       teacher_coefs) -> bool:
    """The Gram path's row step (gram.py) in one launch of the one-model kernel, where it applies: the
    losses, d L / d s without its teacher term in place, and each row's coefficient of t (0 for ignored
    rows) into teacher_coefs, from each row's raw s.t and |t|^2 in teacher_products [n, 2]. A row whose
    sums overflow fp32 gets NaN losses and gradient (no rescue; gram.py's range). Whether it ran."""
    rows, vocab = student_logits.shape
    runs = (rows > 0 and applies(student_logits.dtype, vocab, vocab, scales) and labels.dtype in _LABEL_TYPES
            and labels.is_contiguous() and token_losses.is_contiguous() and teacher_products.is_contiguous()
            and teacher_coefs.is_contiguous() and student_logits.stride(1) == 1 and student_logits.stride(0) % 8 == 0
            and student_logits.data_ptr() % 16 == 0 and available(student_logits.device)
            and _launch(vocab, labels.dtype, student_logits.device.index, 1) is not None)
    if runs:
        kernel, layout = _launch(vocab, labels.dtype, student_logits.device.index, 1)
        launch(kernel, layout, student_logits, None, labels, scales, token_losses, teacher_products, teacher_coefs)
    return runs


CUDA_ROW_STEP = RowStepImpl(row_step_cuda, row_stats_triton, row_grad_triton, gram_step=gram_row_step_cuda)
