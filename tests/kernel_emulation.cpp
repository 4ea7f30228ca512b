// Runs umbp_redis/engine/copy/block_copy.cu on the CPU: the kernel's own source, compiled as C++,
// with every CTA and thread of the grid executed in turn. The kernel has no shared
// memory or barriers, so a sequential schedule is one of its legal schedules.
#define UMBP_HOST_EMULATION 1
typedef unsigned long long umbp_u64;
typedef long long umbp_i64;

struct umbp_dim3 {
    unsigned x, y, z;
};
static umbp_dim3 blockIdx, threadIdx, blockDim;

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

#define __global__
#define __device__
#define __forceinline__ inline

#include "block_copy.cu"

extern "C" void umbp_emulate_launch(unsigned grid_x, unsigned grid_y, unsigned threads,
                                    const umbp_i64* chunks, int n_chunks, const int* entries,
                                    int n_entries, char* staging_base, umbp_i64 slot_bytes,
                                    int to_staging) {
    blockDim = {threads, 1, 1};
    for (unsigned y = 0; y < grid_y; ++y) {
        for (unsigned x = 0; x < grid_x; ++x) {
            for (unsigned t = 0; t < threads; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                umbp_copy_chunks(chunks, n_chunks, entries, n_entries, staging_base, slot_bytes,
                                 to_staging);
            }
        }
    }
}
