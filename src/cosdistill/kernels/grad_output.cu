// grad_output onto up to three gradients in one launch, nothing written when it is 1: grad_output_cuda.py
// prepends each tensor's element kind (FIRST_KIND, SECOND_KIND, THIRD_KIND) and compiles it with NVRTC at run
// time. The math is grad_output.py's: each value times the factor in fp32, rounded once to nearest even.
#define KIND_FP32 0
#define KIND_BF16 1
#define KIND_FP16 2

template <int KIND> struct Element { typedef unsigned short type; };  // bf16 and fp16 as their bits
template <> struct Element<KIND_FP32> { typedef float type; };

template <int KIND> __device__ __forceinline__ float widen(typename Element<KIND>::type value);
template <> __device__ __forceinline__ float widen<KIND_FP32>(float value) { return value; }
template <> __device__ __forceinline__ float widen<KIND_BF16>(unsigned short bits) {
  return __uint_as_float((unsigned)bits << 16);
}
template <> __device__ __forceinline__ float widen<KIND_FP16>(unsigned short bits) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
}

template <int KIND> __device__ __forceinline__ typename Element<KIND>::type narrow(float value);
template <> __device__ __forceinline__ float narrow<KIND_FP32>(float value) { return value; }
template <> __device__ __forceinline__ unsigned short narrow<KIND_BF16>(float value) {
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}
template <> __device__ __forceinline__ unsigned short narrow<KIND_FP16>(float value) {
  unsigned short bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}

// values[0, numel) *= factor: its first `vectors` 16-byte vectors whole (0 where values is not 16-byte
// aligned), then the rest one by one; each thread strides over the grid.
template <int KIND>
__device__ __forceinline__ void scale(void* values, long long numel, long long vectors, float factor) {
  typedef typename Element<KIND>::type T;
  constexpr int PER_VECTOR = 16 / sizeof(T);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  uint4* packed = (uint4*)values;
  for (long long v = first; v < vectors; v += stride) {
    uint4 vector = packed[v];
    T* items = (T*)&vector;
#pragma unroll
    for (int k = 0; k < PER_VECTOR; ++k) items[k] = narrow<KIND>(widen<KIND>(items[k]) * factor);
    packed[v] = vector;
  }
  T* items = (T*)values;
  for (long long i = vectors * PER_VECTOR + first; i < numel; i += stride) {
    items[i] = narrow<KIND>(widen<KIND>(items[i]) * factor);
  }
}

extern "C" __global__ void scale_unless_one(void* first, long long first_numel, long long first_vectors,
                                            void* second, long long second_numel, long long second_vectors,
                                            void* third, long long third_numel, long long third_vectors,
                                            const float* factor_ptr) {
  const float factor = *factor_ptr;
  if (factor == 1.0f) return;  // NaN goes on: it must reach the gradients
  scale<FIRST_KIND>(first, first_numel, first_vectors, factor);
  scale<SECOND_KIND>(second, second_numel, second_vectors, factor);
  scale<THIRD_KIND>(third, third_numel, third_vectors, factor);
}
