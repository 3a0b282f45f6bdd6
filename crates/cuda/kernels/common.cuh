// Shared helpers for samesum's CUDA kernels. No CUDA headers are needed:
// half conversions go through PTX, so NVRTC compiles these sources with no
// include path at all.
//
// The row contract holds by construction: every reduction below has an order
// fixed by the sizes of the model (width, head dim, number of blocks), never by
// the number of rows in a call or the grid that covers them.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

#define INFINITY __int_as_float(0x7f800000)

// The first statement of every kernel. Under programmatic dependent launch
// (Hopper and later; see Device::launch_raw) a kernel may start while the one
// before it in the stream is still running: `griddepcontrol.wait` blocks until
// that kernel has completed and its memory writes are visible, so nothing is
// read or written early. `launch_dependents` then lets the next kernel be
// scheduled (it waits in turn). Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Fixed butterfly sums over a warp (or over the low `w` lanes of each group).
__device__ __forceinline__ int isum_lanes(int v, int w) {
    for (int o = w / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
