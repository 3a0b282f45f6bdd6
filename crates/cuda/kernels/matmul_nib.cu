// ---------------------------------------------------------------- 4-bit table and offset formats
//
// Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1 and Q5_1 (32-value blocks, Q8_0
// activations) and IQ4_XS (256-value blocks of eight 32-value sub-blocks
// with 6-bit scales, Q8_K activations) for the row kernels above. Every
// value is a small integer (an offset nibble, or a signed byte from a
// 16-entry table: IQ4_NL's non-linear levels, MXFP4's e2m1 values doubled)
// times the block's float scale, so each block's integer sum is exact and
// its float step is step_plain, in block order: any kernel (these row
// kernels for any m, the tensor-core tiles for wide calls) computes the
// same bytes. Q4_1 and Q5_1 add an offset m to every value (x = d q + m):
// their block's second integer is the activation block's quant sum, and
// their float step step_min with dmin = -m (so it adds (m da) sum). The CPU
// takes their dots against Q8_1 blocks, whose quants are Q8_0's and whose
// s = f16(d sum) carries the same sum rounded to a half.

// 4 bytes at p, any alignment: two aligned words funnel-shifted (the second
// may lie past the block: the device copy of the weights has slack).
__device__ __forceinline__ u32 ld_u32_a1(const u8* p) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    return __funnelshift_r(a[0], a[1], ((u32)(size_t)p & 3u) * 8u);
}

// Four table entries: byte i of q (0..15) picks entry q_i of the table whose
// bytes 0-15 are t0..t3 (little endian), as signed bytes.
__device__ __forceinline__ u32 lut16(u32 q, u32 t0, u32 t1, u32 t2, u32 t3) {
    u32 v = q & 0x07070707u;
    u32 sel = (v & 0x7u) | ((v >> 4) & 0x70u) | ((v >> 8) & 0x700u) | ((v >> 12) & 0x7000u);
    u32 lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    u32 mask = ((q >> 3) & 0x01010101u) * 0xffu;
    return (hi & mask) | (lo & ~mask);
}

// IQ4_NL's levels: -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113.
__device__ __forceinline__ u32 iq4nl_lut(u32 q) {
    return lut16(q, 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u);
}
// MXFP4's e2m1 values doubled: 0 1 2 3 4 6 8 12, then their negatives.
__device__ __forceinline__ u32 mxfp4_lut(u32 q) {
    return lut16(q, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu);
}

// The formats of 32-value blocks: KIND 0 Q4_0 (d, qs[16]: nibble - 8),
// 1 IQ4_NL (d, qs[16]: table), 2 MXFP4 (e8m0 exponent, qs[16]: table, scale
// 2^(e-128) as ggml's E8M0_TO_FP32_HALF), 3 Q5_0 (d, qh u32, qs[16]:
// nibble | fifth bit << 4, - 16), 4 Q4_1 (d, m, qs[16]: nibble), 5 Q5_1 (d,
// m, qh u32, qs[16]: nibble | fifth bit << 4). Value j < 16 is the low
// nibble of qs byte j, value j + 16 its high nibble (Q5_0, Q5_1: the fifth
// bit of value e is qh's bit e). d and m are f16; the kinds with m (MINS)
// add it to every value.
template <int KIND>
struct Nib32 {
    static constexpr bool MINS = KIND == 4 || KIND == 5;
    static constexpr bool Q5 = KIND == 3 || KIND == 5;
    static constexpr int BYTES = KIND == 2 ? 17 : KIND == 3 ? 22 : KIND == 4 ? 20 : KIND == 5 ? 24 : 18;
    static constexpr int QS = KIND == 2 ? 1 : KIND == 3 ? 6 : KIND == 4 ? 4 : KIND == 5 ? 8 : 2;
    static constexpr int QH = KIND == 3 ? 2 : 4;  // the fifth bits' word (Q5)
    // Values 4j..4j+3 (hi = 0) or 16+4j..16+4j+3 (hi = 1) from qs word w
    // (bytes 4j..4j+3) and, for Q5_0 and Q5_1, qh: signed bytes, unsigned
    // ones (0..31) for Q4_1 and Q5_1.
    static __device__ __forceinline__ u32 values(u32 w, u32 qh, int j, int hi) {
        u32 n = (w >> (4 * hi)) & 0x0F0F0F0Fu;
        if constexpr (KIND == 0) return __vsub4(n, 0x08080808u);
        if constexpr (KIND == 1) return iq4nl_lut(n);
        if constexpr (KIND == 2) return mxfp4_lut(n);
        if constexpr (KIND == 4) return n;
        u32 hb = (qh >> (16 * hi + 4 * j)) & 0xFu;
        u32 h = (hb & 1u) | ((hb & 2u) << 7) | ((hb & 4u) << 14) | ((hb & 8u) << 21);
        if constexpr (KIND == 5) return n | (h << 4);
        return __vsub4(n | (h << 4), 0x10101010u);
    }
    // The scale from the block's first word (its bytes 0..3).
    static __device__ __forceinline__ float scale_of(u32 w) {
        if constexpr (KIND == 2) {
            u32 e = w & 0xffu;
            return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        }
        return f16_to_f32((u16)(w & 0xffffu));
    }
    // The float step's dmin from the same word: the offset m (bytes 2..3)
    // negated, as step_min subtracts dmin da msum; 0 without mins.
    static __device__ __forceinline__ float dmin_of(u32 w) {
        if constexpr (MINS) return -f16_to_f32((u16)(w >> 16));
        return 0.0f;
    }
    static __device__ __forceinline__ float scale(const u8* b) {
        if constexpr (KIND == 2) return scale_of(b[0]);
        return scale_of(ld_u16(b));
    }
    static __device__ __forceinline__ float dmin(const u8* b) {
        if constexpr (MINS) return dmin_of((u32)ld_u16(b + 2) << 16);
        return 0.0f;
    }
    // One block's float step: isum the values' dot, msum (kinds with mins)
    // the activation block's quant sum.
    static __device__ __forceinline__ float step(float acc, float d, float dmin, float da, int isum, int msum) {
        if constexpr (MINS) return step_min(acc, d, dmin, da, isum, msum);
        return step_plain(acc, d, da, isum);
    }
};

// The row kernels' form: part s = values 16s..16s+15 (the low nibbles of
// the 16 qs bytes for s = 0, their high nibbles for s = 1) against the
// activation block's words 4s..4s+3 (as FmtQ8_0: two lanes a block); with
// mins, the part's activation quant sum (a dp4a against ones) too, so the
// two lanes' sums are the block's.
template <int KIND>
struct FmtNib32 {
    typedef Nib32<KIND> N;
    enum { ELEMS = 32, BYTES = N::BYTES, LANES = 2, ABYTES = Q8A_BYTES };
    typedef Act80 A;
    u32 q[4];
    float d, dmin;
    static __device__ A act(const u8* a, int s) { return FmtQ8_0::act(a, s); }
    __device__ void load(const u8* b, int s) {
        u32 qh = N::Q5 ? ld_u32_a1(b + N::QH) : 0u;
#pragma unroll
        for (int j = 0; j < 4; j++) q[j] = N::values(ld_u32_a1(b + N::QS + 4 * j), qh, j, s);
        d = N::scale(b);
        dmin = N::dmin(b);
    }
    __device__ int iprod(const A& x) const {
        int t = __dp4a((int)q[0], (int)x.x[0], 0);
        t = __dp4a((int)q[1], (int)x.x[1], t);
        t = __dp4a((int)q[2], (int)x.x[2], t);
        return __dp4a((int)q[3], (int)x.x[3], t);
    }
    __device__ int mprod(const A& x) const {
        if constexpr (N::MINS) {
            int t = __dp4a(0x01010101, (int)x.x[0], 0);
            t = __dp4a(0x01010101, (int)x.x[1], t);
            t = __dp4a(0x01010101, (int)x.x[2], t);
            return __dp4a(0x01010101, (int)x.x[3], t);
        }
        return 0;
    }
    static __device__ float step(float acc, float d, float dmin, float da, int is, int ms) {
        return N::step(acc, d, dmin, da, is, ms);
    }
};

typedef FmtNib32<0> FmtQ4_0;
typedef FmtNib32<1> FmtIQ4NL;
typedef FmtNib32<2> FmtMXFP4;
typedef FmtNib32<3> FmtQ5_0;
typedef FmtNib32<4> FmtQ4_1;
typedef FmtNib32<5> FmtQ5_1;

// IQ4_XS: d (f16), scales_h (u16), scales_l[4], qs[128]; part s = sub-block
// s (32 values: the low nibbles of qs bytes 16s..16s+15, then their high
// nibbles), its scale ((scales_l nibble s) | (scales_h bits 2s..2s+1) << 4) - 32.
__device__ __forceinline__ int iq4xs_scale(const u8* b, int s) {
    return (int)(((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((ld_u16(b + 2) >> (2 * s)) & 3) << 4)) - 32;
}

struct FmtIQ4XS {
    enum { ELEMS = 256, BYTES = 136, LANES = 8, ABYTES = Q8K_BYTES };
    typedef ActK32 A;
    u32 q[8];
    int sc;
    float d, dmin;
    static __device__ A act(const u8* a, int s) { return act_k32(a, s); }
    __device__ void load(const u8* b, int s) {
        const u32* qs = (const u32*)(b + 8 + 16 * s);  // 136-byte blocks: 8-byte aligned
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = qs[i];
            q[i] = iq4nl_lut(w & 0x0F0F0F0Fu);
            q[4 + i] = iq4nl_lut((w >> 4) & 0x0F0F0F0Fu);
        }
        sc = iq4xs_scale(b, s);
        d = f16_to_f32(ld_u16(b));
        dmin = 0.0f;
    }
    __device__ int iprod(const A& x) const { return sc * dot32(q, x); }
    __device__ int mprod(const A&) const { return 0; }
    static __device__ float step(float acc, float d, float, float da, int is, int) {
        return step_plain(acc, d, da, is);
    }
};

// Each format's row kernels (the instances the kernel list is read from).
MM_KERNEL(mm_q4_0, FmtQ4_0, 1)
MM_ROW_KERNEL(mm_q4_0_1, FmtQ4_0)
MM_GLU_KERNEL(mm_q4_0_glu_1, FmtQ4_0)
MM_MULTI_KERNEL(mm_q4_0_multi_1, FmtQ4_0)
MM_MOE_KERNEL(mm_q4_0_moe_1, FmtQ4_0, 1)
MM_MOE_KERNEL(mm_q4_0_moe_glu_1, FmtQ4_0, 2)

MM_KERNEL(mm_q5_0, FmtQ5_0, 1)
MM_ROW_KERNEL(mm_q5_0_1, FmtQ5_0)
MM_GLU_KERNEL(mm_q5_0_glu_1, FmtQ5_0)
MM_MULTI_KERNEL(mm_q5_0_multi_1, FmtQ5_0)
MM_MOE_KERNEL(mm_q5_0_moe_1, FmtQ5_0, 1)
MM_MOE_KERNEL(mm_q5_0_moe_glu_1, FmtQ5_0, 2)

MM_KERNEL(mm_q4_1, FmtQ4_1, 1)
MM_ROW_KERNEL(mm_q4_1_1, FmtQ4_1)
MM_GLU_KERNEL(mm_q4_1_glu_1, FmtQ4_1)
MM_MULTI_KERNEL(mm_q4_1_multi_1, FmtQ4_1)
MM_MOE_KERNEL(mm_q4_1_moe_1, FmtQ4_1, 1)
MM_MOE_KERNEL(mm_q4_1_moe_glu_1, FmtQ4_1, 2)

MM_KERNEL(mm_q5_1, FmtQ5_1, 1)
MM_ROW_KERNEL(mm_q5_1_1, FmtQ5_1)
MM_GLU_KERNEL(mm_q5_1_glu_1, FmtQ5_1)
MM_MULTI_KERNEL(mm_q5_1_multi_1, FmtQ5_1)
MM_MOE_KERNEL(mm_q5_1_moe_1, FmtQ5_1, 1)
MM_MOE_KERNEL(mm_q5_1_moe_glu_1, FmtQ5_1, 2)

MM_KERNEL(mm_iq4_nl, FmtIQ4NL, 1)
MM_ROW_KERNEL(mm_iq4_nl_1, FmtIQ4NL)
MM_GLU_KERNEL(mm_iq4_nl_glu_1, FmtIQ4NL)
MM_MULTI_KERNEL(mm_iq4_nl_multi_1, FmtIQ4NL)
MM_MOE_KERNEL(mm_iq4_nl_moe_1, FmtIQ4NL, 1)
MM_MOE_KERNEL(mm_iq4_nl_moe_glu_1, FmtIQ4NL, 2)

MM_KERNEL(mm_mxfp4, FmtMXFP4, 1)
MM_ROW_KERNEL(mm_mxfp4_1, FmtMXFP4)
MM_GLU_KERNEL(mm_mxfp4_glu_1, FmtMXFP4)
MM_MULTI_KERNEL(mm_mxfp4_multi_1, FmtMXFP4)
MM_MOE_KERNEL(mm_mxfp4_moe_1, FmtMXFP4, 1)
MM_MOE_KERNEL(mm_mxfp4_moe_glu_1, FmtMXFP4, 2)

MM_KERNEL(mm_iq4_xs, FmtIQ4XS, 1)
MM_ROW_KERNEL(mm_iq4_xs_1, FmtIQ4XS)
MM_GLU_KERNEL(mm_iq4_xs_glu_1, FmtIQ4XS)
MM_MULTI_KERNEL(mm_iq4_xs_multi_1, FmtIQ4XS)
MM_MOE_KERNEL(mm_iq4_xs_moe_1, FmtIQ4XS, 1)
MM_MOE_KERNEL(mm_iq4_xs_moe_glu_1, FmtIQ4XS, 2)
