// Gather engine KV blocks into host staging slots, or scatter slots back into blocks.
//
// One launch moves every chunk of every block of one cache group:
//   blockIdx.x  = chunk of the group's chunked range template (KVRangeTemplate.chunked),
//   blockIdx.y  = entry of this launch's (block id, staging slot) list.
// The chunk table is four int64 columns of n_chunks each, uploaded once per layout:
//   engine address of block 0, block stride, object offset, length (bytes).
// Staging is pinned host memory; with unified addressing its host pointer is valid on
// the device, so the copy goes straight over the bus with no device bounce buffer.
//
// Compiled at run time by NVRTC (CuPy RawModule). The tests also compile it with nvcc
// and, with UMBP_HOST_EMULATION defined, as plain C++ that runs the grid on the CPU.

#ifndef UMBP_HOST_EMULATION
typedef unsigned long long umbp_u64;
typedef long long umbp_i64;
#endif

// Threads of a CTA stride over the run; each issues UNROLL loads before its stores so
// that many reads are in flight (this matters most when the source is host memory).
template <typename T>
__device__ __forceinline__ void umbp_copy_run(char* dst, const char* src, umbp_u64 nbytes) {
    const umbp_u64 n = nbytes / sizeof(T);
    const T* s = reinterpret_cast<const T*>(src);
    T* d = reinterpret_cast<T*>(dst);
    const umbp_u64 step = blockDim.x;
    umbp_u64 i = threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        const T a = s[i];
        const T b = s[i + step];
        const T c = s[i + 2 * step];
        const T e = s[i + 3 * step];
        d[i] = a;
        d[i + step] = b;
        d[i + 2 * step] = c;
        d[i + 3 * step] = e;
    }
    for (; i < n; i += step) {
        d[i] = s[i];
    }
}

extern "C" __global__ void umbp_copy_chunks(
    const umbp_i64* chunks,      // [4][n_chunks] columns, see above
    int n_chunks,
    const int* entries,          // [2][n_entries]: block ids, then staging slot indices
    int n_entries,
    char* staging_base,          // slot 0 of the staging pool
    umbp_i64 slot_bytes,
    int to_staging)              // 1: engine -> staging (store), 0: staging -> engine (load)
{
    const int c = blockIdx.x;
    const int e = blockIdx.y;
    if (c >= n_chunks || e >= n_entries) {
        return;
    }
    const umbp_i64 block_id = entries[e];
    const umbp_i64 slot = entries[n_entries + e];
    char* engine = reinterpret_cast<char*>(chunks[c] + block_id * chunks[n_chunks + c]);
    char* object = staging_base + slot * slot_bytes + chunks[2 * n_chunks + c];
    const umbp_u64 len = static_cast<umbp_u64>(chunks[3 * n_chunks + c]);
    char* dst = to_staging ? object : engine;
    const char* src = to_staging ? engine : object;
    // The widest word that divides both addresses and the length.
    const umbp_u64 m = reinterpret_cast<umbp_u64>(dst) | reinterpret_cast<umbp_u64>(src) | len;
    if ((m & 15) == 0) {
        umbp_copy_run<uint4>(dst, src, len);
    } else if ((m & 7) == 0) {
        umbp_copy_run<umbp_u64>(dst, src, len);
    } else if ((m & 3) == 0) {
        umbp_copy_run<unsigned int>(dst, src, len);
    } else if ((m & 1) == 0) {
        umbp_copy_run<unsigned short>(dst, src, len);
    } else {
        umbp_copy_run<unsigned char>(dst, src, len);
    }
}
