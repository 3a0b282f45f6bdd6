// launch_floor: what a chain of dependent steps costs on this GPU before any
// arithmetic, measured three ways (docs/BENCHMARKS.md, session 26, "what
// each unmet bar would need"):
//
//   graph      N dependent launches of a minimal step kernel, captured in a
//              CUDA graph and replayed (how samesum's decode token runs);
//   graph+pdl  the same with programmatic dependent launch (each kernel may
//              start while the previous one drains and waits for it with
//              griddepcontrol.wait; samesum's decode launches use it);
//   persistent one launch of one block an SM that runs the N steps with a
//              grid-wide barrier between them (a counter and a generation
//              word in device memory).
//
// Every step reads the previous step's buffer at a permuted index, so each
// step depends on the whole previous one, and writes the other buffer. The
// per-step figure is the replay's time divided by N, the mean of R timed
// replays after warm-ups. It also checks that the three ways compute the
// same buffer, so a broken barrier cannot pass as a fast one.
//
// Build and run (scripts/gpu.sh step `floor` does this on the device):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o launch_floor scripts/launch_floor.cu
//   ./launch_floor

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,               \
                         cudaGetErrorString(e_));                                         \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)

constexpr int THREADS = 256;

// One step: out[i] = 0.5 in[(i * 7 + 3) % n] + 1 for the grid's elements.
__device__ __forceinline__ void step(const float* in, float* out, int n, int i0, int stride) {
    for (int i = i0; i < n; i += stride) out[i] = fmaf(0.5f, in[(int)(((long long)i * 7 + 3) % n)], 1.0f);
}

__global__ void __launch_bounds__(THREADS) step_kernel(const float* in, float* out, int n, int pdl) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    step(in, out, n, blockIdx.x * THREADS + threadIdx.x, gridDim.x * THREADS);
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
}

// Grid-wide barrier for co-resident blocks: the last block to arrive resets
// the counter and advances the generation; the others wait for it.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen, unsigned blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g = *(volatile unsigned*)gen;
        __threadfence();
        if (atomicAdd(count, 1u) == blocks - 1) {
            *(volatile unsigned*)count = 0;
            __threadfence();
            atomicAdd(gen, 1u);
        } else {
            while (*(volatile unsigned*)gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

__global__ void __launch_bounds__(THREADS)
    persistent_kernel(float* a, float* b, int n, int steps, unsigned* count, unsigned* gen) {
    for (int s = 0; s < steps; s++) {
        const float* in = (s & 1) ? b : a;
        float* out = (s & 1) ? a : b;
        step(in, out, n, blockIdx.x * THREADS + threadIdx.x, gridDim.x * THREADS);
        grid_barrier(count, gen, gridDim.x);
    }
}

static void launch_step(cudaStream_t st, const float* in, float* out, int n, int blocks, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(THREADS);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, n, pdl ? 1 : 0));
}

struct Bufs {
    float *a, *b;
    unsigned *count, *gen;
    int n;
};

static void reset(const Bufs& m, const std::vector<float>& init) {
    CHECK(cudaMemcpy(m.a, init.data(), sizeof(float) * m.n, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(m.b, 0, sizeof(float) * m.n));
    CHECK(cudaMemset(m.count, 0, sizeof(unsigned)));
    CHECK(cudaMemset(m.gen, 0, sizeof(unsigned)));
}

// The buffer the last of `steps` steps wrote.
static std::vector<float> result(const Bufs& m, int steps) {
    std::vector<float> h(m.n);
    CHECK(cudaMemcpy(h.data(), (steps & 1) ? m.b : m.a, sizeof(float) * m.n, cudaMemcpyDeviceToHost));
    return h;
}

// Microseconds a step: `run` replays `steps` steps; warm-ups, then `reps`.
template <class F>
static double time_steps(cudaStream_t st, int steps, int reps, F run) {
    for (int w = 0; w < 3; w++) run();
    CHECK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(e0, st));
    for (int r = 0; r < reps; r++) run();
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return 1000.0 * ms / ((double)reps * steps);
}

int main(int argc, char** argv) {
    int steps = argc > 1 ? std::atoi(argv[1]) : 480;  // a qwen3moe token: 48 layers x 10 launches
    int reps = argc > 2 ? std::atoi(argv[2]) : 50;
    if (steps < 2 || (steps & 1) || reps < 1) {
        std::fprintf(stderr, "usage: launch_floor [even steps >= 2] [reps >= 1]\n");
        return 2;
    }
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    int sms = p.multiProcessorCount;
    std::printf("%s, %d SMs; %d dependent steps a replay, %d replays timed\n", p.name, sms, steps, reps);
    std::printf("| blocks | elements | graph (us a step) | graph+pdl | persistent | same buffer |\n");
    std::printf("|---:|---:|---:|---:|---:|---|\n");
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int ok_all = 1;
    for (int blocks : {sms / 2, sms}) {
        for (int per_thread : {1, 8}) {
            Bufs m;
            m.n = blocks * THREADS * per_thread;
            CHECK(cudaMalloc(&m.a, sizeof(float) * m.n));
            CHECK(cudaMalloc(&m.b, sizeof(float) * m.n));
            CHECK(cudaMalloc(&m.count, sizeof(unsigned)));
            CHECK(cudaMalloc(&m.gen, sizeof(unsigned)));
            std::vector<float> init(m.n);
            for (int i = 0; i < m.n; i++) init[i] = (float)((i * 2654435761u) % 1000u) / 1000.0f;

            double us[2];
            std::vector<float> got[3];
            for (int pdl = 0; pdl < 2; pdl++) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int s = 0; s < steps; s++)
                    launch_step(st, (s & 1) ? m.b : m.a, (s & 1) ? m.a : m.b, m.n, blocks, pdl != 0);
                CHECK(cudaStreamEndCapture(st, &g));
                CHECK(cudaGraphInstantiate(&ge, g, 0));
                reset(m, init);
                CHECK(cudaGraphLaunch(ge, st));
                CHECK(cudaStreamSynchronize(st));
                got[pdl] = result(m, steps);
                us[pdl] = time_steps(st, steps, reps, [&] { CHECK(cudaGraphLaunch(ge, st)); });
                CHECK(cudaGraphExecDestroy(ge));
                CHECK(cudaGraphDestroy(g));
            }
            void* args[] = {&m.a, &m.b, &m.n, &steps, &m.count, &m.gen};
            auto persist = [&] {
                CHECK(cudaLaunchCooperativeKernel((void*)persistent_kernel, dim3(blocks), dim3(THREADS), args, 0, st));
            };
            reset(m, init);
            persist();
            CHECK(cudaStreamSynchronize(st));
            got[2] = result(m, steps);
            double up = time_steps(st, steps, reps, persist);
            int same = got[0] == got[1] && got[0] == got[2];
            ok_all &= same;
            std::printf("| %d | %d | %.3f | %.3f | %.3f | %s |\n", blocks, m.n, us[0], us[1], up,
                        same ? "yes" : "NO");
            CHECK(cudaFree(m.a));
            CHECK(cudaFree(m.b));
            CHECK(cudaFree(m.count));
            CHECK(cudaFree(m.gen));
        }
    }
    CHECK(cudaStreamDestroy(st));
    if (!ok_all) {
        std::fprintf(stderr, "launch_floor: the three ways wrote different buffers\n");
        return 1;
    }
    return 0;
}
