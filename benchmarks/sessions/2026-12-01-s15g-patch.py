"""Session 15's prepared variant, not yet run on a GPU (NOTES item 70): patches row_step_cuda.py under the src
folder given so that each block pushes its partial statistics into every peer's shared memory (st.async,
completing the peer's mbarrier) instead of the peers pulling them after a release cluster barrier (which
ptxas makes a MEMBAR.ALL.GPU)."""
import sys
from pathlib import Path
p = Path(sys.argv[1]) / "cosdistill/row_step_cuda.py"
s = p.read_text()


def replace(old, new):
    global s
    assert s.count(old) == 1, old
    s = s.replace(old, new)


replace('''__device__ __forceinline__ void unpack(uint4 v, float* x) {''', '''__device__ __forceinline__ unsigned peer_address(const void* local, unsigned rank) {  // the same address in block `rank`
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
  return remote;
}
__device__ __forceinline__ void push_to_peer(unsigned remote, float value, unsigned remote_barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(remote), "r"(__float_as_uint(value)), "r"(remote_barrier) : "memory");
}
__device__ __forceinline__ void wait_barrier(const void* barrier, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void unpack(uint4 v, float* x) {''')
replace('''  __shared__ float block_parts[NUM_PARTS];  // read by the cluster's other blocks
''', '''  __shared__ float peer_parts[CLUSTER][NUM_PARTS];  // block r's parts, pushed by block r
  __shared__ unsigned long long parts_arrived;  // mbarrier: complete once every block's parts are in
''')
replace('''  const float target = (rank == 0 && tid == 0)''', '''  if (tid == 0) {  // expects CLUSTER * NUM_PARTS floats, pushed by the blocks of the cluster
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(&parts_arrived)) : "memory");
    asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                 :: "r"(shared_address(&parts_arrived)), "r"(CLUSTER * NUM_PARTS * 4) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  cluster_arrive_relaxed();  // waited for before the first push: every block's barrier initialised
  const float target = (rank == 0 && tid == 0)''')
replace('''    reduce_warp(part);
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
    reduce_warp(part);''', '''    reduce_warp(part);  // every lane holds the block's parts
  }
  cluster_wait();  // every block's barrier initialised
  if (warp == 0) {
    if (lane < CLUSTER) {  // lane r pushes this block's parts to block r
      const unsigned remote_parts = peer_address(&peer_parts[rank][0], lane);
      const unsigned remote_barrier = peer_address(&parts_arrived, lane);
      #pragma unroll
      for (int k = 0; k < NUM_PARTS; ++k) push_to_peer(remote_parts + 4 * k, part[k], remote_barrier);
    }
    wait_barrier(&parts_arrived, 0);
    #pragma unroll
    for (int k = 0; k < NUM_PARTS; ++k) part[k] = lane < CLUSTER ? peer_parts[lane][k] : (k == 0 ? NEG_INF : 0.f);
    reduce_warp(part);''')
replace('''  // Done reading the other blocks' parts (their values are in registers): they may exit once all arrived.
  cluster_arrive_relaxed();''', '''  // This block's pushes are issued; no block leaves before every block has issued its own.
  cluster_arrive_relaxed();''')
replace('''  cluster_wait();  // no block leaves while another may still read its parts''',
        '''  cluster_wait();  // no block leaves while another may still push to it''')
replace('''    static_bytes = -(-(threads // 32 * 5 + 5 + 6) * 4 // 16) * 16  # warp_parts, block_parts, row_coefs''',
        '''    static_bytes = -(-(threads // 32 * 5 + 16 * 5 + 6 + 2) * 4 // 16) * 16  # warp_parts, peer_parts, row_coefs, mbarrier''')
p.write_text(s)
