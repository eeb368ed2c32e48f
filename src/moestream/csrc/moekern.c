/* moestream's CPU kernels: y = x . W^T computed on ggml blocks as they are stored, and the routed-expert FFN
 * of one MoE layer in one call.
 *
 * Arithmetic (the scheme of ggml's CPU backend, written here from the block formats of ggml-common.h):
 *   - each activation row is quantized once per matmul to 8-bit blocks: "Q8_0" blocks of 32 (fp16-rounded
 *     scale d = amax / 127, q = round(x / d)) for weights in blocks of 32, "Q8_K" super-blocks of 256
 *     (float scale, q in [-127, 127], 16 sums of 16 q) for weights in super-blocks of 256;
 *   - a weight block is unpacked to int8 codes and small integer scales (family A: 32 codes, one float scale d
 *     and an optional float offset m; family B: 256 codes, 16 integer scales, one per 16 codes, a float d and
 *     optionally a float dmin with 16 integer mins); float weights (F32, F16, BF16) are widened to float32
 *     (family C) and meet float32 activations;
 *   - integer dot products per block (AVX2 maddubs/madd, or AVX512-VNNI dpbusd, or portable C), then
 *     float scales.
 *
 * Determinism: every output element is computed by one thread with a sequence of operations that depends
 * only on the weight row, the activation row and the build (ISA), never on the thread count, on which other
 * tokens or rows share the call, or on how the work is split. So streaming on/off and -t 1 / -t 8 give the
 * same bits.
 *
 * The same source is compiled once per ISA (MS_ISA_AVX512, MS_ISA_AVX2, or neither = portable); Python picks
 * the build the CPU runs (moestream/kernels.py). Family B's float arithmetic is scalar per super-block and
 * its integer sums exact, so its results are identical across builds; family A and C accumulate in vector
 * lanes on x86 builds.
 *
 * The API is plain C (ctypes): no Python headers.
 */

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(MS_ISA_AVX2) || defined(MS_ISA_AVX512)
#include <immintrin.h>
#define MS_X86_SIMD 1
#endif

#define QK 32
#define QKK 256
#define MAX_THREADS 256
/* tokens whose accumulators one pass over a weight row updates: 16 tokens' activation blocks of a 2048-wide row
 * (16 x 8 x 292 bytes for Q8_K) stay near L1 while the row is read; 64 was 12-16% slower on 128-token calls */
#ifndef TOK_TILE
#define TOK_TILE 16
#endif

enum { FAM_A = 1, FAM_B = 2, FAM_C = 3 }; /* 32-blocks x Q8_0, 256-blocks x Q8_K, float x float */

/* ggml type numbers (ggml.h enum ggml_type) */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
    T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22,
    T_IQ4_XS = 23, T_BF16 = 30, T_IQ1_M = 29, T_TQ1_0 = 34, T_TQ2_0 = 35, T_MXFP4 = 39,
};

/* ------------------------------------------------------------------------------------------------------ */
/* half / bfloat16                                                                                         */

static inline float fp32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t fp32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE binary16 -> binary32, exact (subnormals included). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {
        if (man == 0) return fp32_from_bits(sign);
        /* subnormal: man * 2^-24 (exact in float) */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) return fp32_from_bits(sign | 0x7F800000u | (man << 13));
    return fp32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

/* binary32 -> binary16, round to nearest even (what F16C's vcvtps2ph and ggml's fallback do). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x = fp32_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        /* value * 2^24 rounded to an integer, ties to even */
        float v = fp32_from_bits(ax) * 16777216.0f;
        uint32_t m = (uint32_t)v;
        float frac = v - (float)m;
        if (frac > 0.5f || (frac == 0.5f && (m & 1))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t e = (ax >> 23) - 112, man = ax & 0x7FFFFFu;
    uint32_t h = (e << 10) | (man >> 13);
    uint32_t rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline float bf16_to_f32(uint16_t b) { return fp32_from_bits((uint32_t)b << 16); }

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
#ifdef MS_X86_SIMD
static inline float rdh(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
#else
static inline float rdh(const uint8_t *p) { return f16_to_f32(rd16(p)); }
#endif

/* ------------------------------------------------------------------------------------------------------ */
/* activation blocks (internal formats, never in a file)                                                   */

typedef struct { float d; float s; int8_t q[QK]; } act_q8_0;                /* x ~ d * q; s = d * sum(q) */
typedef struct { float d; int16_t bsum[16]; int8_t q[QKK]; } act_q8_k;     /* x ~ d * q; bsum: 16 codes each */

/* round half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT) (ggml's AVX quantizer) */
static inline int round_even(float v) { return (int)nearbyintf(v); }

static void quantize_q8_0(const float *x, act_q8_0 *y, int n) {
    for (int b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < QK; i++) { float a = fabsf(xb[i]); amax = a > amax ? a : amax; finite &= a <= FLT_MAX; }
        if (!finite) { /* NaN / Inf in: NaN out (never a finite result from non-finite input) */
            y[b].d = y[b].s = NAN;
            memset(y[b].q, 0, QK);
            continue;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) { int q = round_even(xb[i] * id); y[b].q[i] = (int8_t)q; sum += q; }
        y[b].d = f16_to_f32(f32_to_f16(d)); /* ggml keeps the activation scale as fp16 */
        y[b].s = y[b].d * (float)sum;
    }
}

static void quantize_q8_k(const float *x, act_q8_k *y, int n) {
    for (int b = 0; b < n / QKK; b++) {
        const float *xb = x + b * QKK;
        float amax = 0.0f, mx = 0.0f;
        int finite = 1;
        for (int i = 0; i < QKK; i++) {
            float a = fabsf(xb[i]);
            finite &= a <= FLT_MAX;
            if (a > amax) { amax = a; mx = xb[i]; }
        }
        if (!finite) { /* NaN / Inf in: NaN out */
            y[b].d = NAN;
            memset(y[b].q, 0, QKK);
            memset(y[b].bsum, 0, sizeof y[b].bsum);
            continue;
        }
        if (amax == 0.0f) {
            y[b].d = 0.0f;
            memset(y[b].q, 0, QKK);
            memset(y[b].bsum, 0, sizeof y[b].bsum);
            continue;
        }
        const float iscale = -127.0f / mx;
        for (int i = 0; i < QKK; i++) {
            int q = round_even(iscale * xb[i]);
            y[b].q[i] = (int8_t)(q > 127 ? 127 : (q < -127 ? -127 : q));
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].q[g * 16 + i];
            y[b].bsum[g] = (int16_t)s;
        }
        y[b].d = 1.0f / iscale;
    }
}

#ifdef MS_X86_SIMD
static inline int hsum_epi32(__m256i v);
/* The same two quantizers on 8 lanes: the same float operations per element (one multiply, round to nearest even,
 * truncating convert), the same clamps and the same first-maximum rule, so every byte equals the scalar code's.
 * A block whose inverse scale is not finite (a subnormal maximum) takes the scalar code. */
static inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline int all_finite_abs(__m256 a) { /* every |x| <= FLT_MAX (false for NaN and Inf) */
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ)) == 0xFF;
}
static inline __m256i round_i32(__m256 v) {
    return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 32 int32 lanes (each in -128..127) -> 32 int8 in order */
static inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_q8_0_v(const float *x, act_q8_0 *y, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        int finite = 1;
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(xb + 8 * c);
            const __m256 a = _mm256_andnot_ps(sign, v[c]);
            finite &= all_finite_abs(a);
            mx = _mm256_max_ps(mx, a);
        }
        const float amax = hmax_ps(mx);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        if (!finite || !(id <= FLT_MAX)) { quantize_q8_0(xb, y + b, QK); continue; }
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            q[c] = round_i32(_mm256_mul_ps(v[c], idv));
            sum = _mm256_add_epi32(sum, q[c]);
        }
        _mm256_storeu_si256((__m256i *)y[b].q, pack_i8(q[0], q[1], q[2], q[3]));
        y[b].d = f16_to_f32(f32_to_f16(d));
        y[b].s = y[b].d * (float)hsum_epi32(sum);
    }
}

static void quantize_q8_k_v(const float *x, act_q8_k *y, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < n / QKK; b++) {
        const float *xb = x + b * QKK;
        __m256 mx = _mm256_setzero_ps();
        int finite = 1;
        for (int c = 0; c < QKK / 8; c++) {
            const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * c));
            finite &= all_finite_abs(a);
            mx = _mm256_max_ps(mx, a);
        }
        const float amax = hmax_ps(mx);
        if (!finite || amax == 0.0f) { quantize_q8_k(xb, y + b, QKK); continue; }
        int first = 0; /* the first element of largest magnitude, as the scalar loop's strict '>' keeps */
        const __m256 am = _mm256_set1_ps(amax);
        for (int c = 0; c < QKK / 8; c++) {
            const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * c)), am,
                                                           _CMP_EQ_OQ));
            if (m) { first = 8 * c + __builtin_ctz((unsigned)m); break; }
        }
        const float iscale = -127.0f / xb[first];
        if (!(fabsf(iscale) <= FLT_MAX)) { quantize_q8_k(xb, y + b, QKK); continue; }
        const __m256 isv = _mm256_set1_ps(iscale);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        for (int c = 0; c < QKK / 32; c++) {
            __m256i q[4];
            for (int k = 0; k < 4; k++)
                q[k] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, round_i32(_mm256_mul_ps(isv, _mm256_loadu_ps(
                    xb + 32 * c + 8 * k)))));
            _mm256_storeu_si256((__m256i *)(y[b].q + 32 * c), pack_i8(q[0], q[1], q[2], q[3]));
            y[b].bsum[2 * c] = (int16_t)hsum_epi32(_mm256_add_epi32(q[0], q[1]));
            y[b].bsum[2 * c + 1] = (int16_t)hsum_epi32(_mm256_add_epi32(q[2], q[3]));
        }
        y[b].d = 1.0f / iscale;
    }
}
#endif

/* ------------------------------------------------------------------------------------------------------ */
/* weight blocks -> unpacked form                                                                          */

typedef struct { int8_t q[QK]; float d; float m; } ublk_a;  /* w_i = d * q_i + m */
typedef struct {
    int8_t q[QKK];
    int16_t sc[16];  /* one integer scale per 16 codes */
    int16_t mn[16];  /* integer mins per 16 codes (when dmin != 0 or has_min) */
    float d, dmin;   /* w_i = d * sc[i/16] * q_i - dmin * mn[i/16] */
    int has_min;
#ifdef MS_X86_SIMD
    __m256i scv[8];  /* per 32 codes: 16 int16 lanes, sc of the first 16 codes in the low half, then the next */
#endif
} ublk_b;

/* after an unpacker: the scale vectors the SIMD dot reads */
static inline void prep_b(ublk_b *u) {
#ifdef MS_X86_SIMD
    for (int c = 0; c < 8; c++)
        u->scv[c] = _mm256_set_m128i(_mm_set1_epi16(u->sc[2 * c + 1]), _mm_set1_epi16(u->sc[2 * c]));
#else
    (void)u;
#endif
}

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* code-book tables of the 1-3 bit i-quants, handed in from Python (the gguf package's grids) */
static const uint8_t *G_IQ2XXS, *G_IQ2XS, *G_IQ2S, *G_IQ3XXS, *G_IQ3S, *G_IQ1S, *G_KSIGNS;

static inline void nibbles32(const uint8_t *qs, int8_t *out, int bias) {
    for (int j = 0; j < 16; j++) {
        out[j] = (int8_t)((qs[j] & 0x0F) - bias);
        out[j + 16] = (int8_t)((qs[j] >> 4) - bias);
    }
}


#ifdef MS_X86_SIMD
static inline __m256i nib_split(__m128i v) { /* 16 bytes -> 32 codes: low nibbles then high nibbles */
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
/* the 32 bits of qh as 32 bytes of 0 / 0xFF (byte j = bit j) */
static inline __m256i bits_to_bytes(uint32_t qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
#endif
/* family A unpackers: one 32-element block */
#ifdef MS_X86_SIMD
static void unpack_q4_0(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = 0.0f;
    _mm256_storeu_si256((__m256i *)u->q, _mm256_sub_epi8(nib_split(_mm_loadu_si128((const __m128i *)(b + 2))),
                                                         _mm256_set1_epi8(8)));
}
static void unpack_q4_1(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = rdh(b + 2);
    _mm256_storeu_si256((__m256i *)u->q, nib_split(_mm_loadu_si128((const __m128i *)(b + 4))));
}
static void unpack_q5_0(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = 0.0f;
    __m256i q = nib_split(_mm_loadu_si128((const __m128i *)(b + 6)));
    __m256i hb = _mm256_and_si256(bits_to_bytes(rd32(b + 2)), _mm256_set1_epi8(0x10));
    _mm256_storeu_si256((__m256i *)u->q, _mm256_sub_epi8(_mm256_or_si256(q, hb), _mm256_set1_epi8(16)));
}
static void unpack_q5_1(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = rdh(b + 2);
    __m256i q = nib_split(_mm_loadu_si128((const __m128i *)(b + 8)));
    __m256i hb = _mm256_and_si256(bits_to_bytes(rd32(b + 4)), _mm256_set1_epi8(0x10));
    _mm256_storeu_si256((__m256i *)u->q, _mm256_or_si256(q, hb));
}
#else
static void unpack_q4_0(const uint8_t *b, ublk_a *u) { u->d = rdh(b); u->m = 0.0f; nibbles32(b + 2, u->q, 8); }
static void unpack_q4_1(const uint8_t *b, ublk_a *u) { u->d = rdh(b); u->m = rdh(b + 2); nibbles32(b + 4, u->q, 0); }
static void unpack_q5_0(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = 0.0f;
    const uint32_t qh = rd32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        u->q[j] = (int8_t)(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
        u->q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
static void unpack_q5_1(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = rdh(b + 2);
    const uint32_t qh = rd32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        u->q[j] = (int8_t)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
        u->q[j + 16] = (int8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}
#endif
static void unpack_q8_0(const uint8_t *b, ublk_a *u) { u->d = rdh(b); u->m = 0.0f; memcpy(u->q, b + 2, QK); }
#ifdef MS_X86_SIMD
static inline __m256i lut16(__m256i codes, const int8_t *table) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    return _mm256_shuffle_epi8(t, codes);
}
static void unpack_iq4_nl(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = 0.0f;
    _mm256_storeu_si256((__m256i *)u->q, lut16(nib_split(_mm_loadu_si128((const __m128i *)(b + 2))), KVALUES_IQ4NL));
}
#else
static void unpack_iq4_nl(const uint8_t *b, ublk_a *u) {
    u->d = rdh(b); u->m = 0.0f;
    for (int j = 0; j < 16; j++) { u->q[j] = KVALUES_IQ4NL[b[2 + j] & 0x0F]; u->q[j + 16] = KVALUES_IQ4NL[b[2 + j] >> 4]; }
}
#endif
static void unpack_mxfp4(const uint8_t *b, ublk_a *u) {
    /* e8m0 scale halved (the code book is doubled): float bits (e - 1) << 23, subnormal below e = 2 */
    const uint32_t e = b[0];
    u->d = fp32_from_bits(e < 2 ? (e + 1) * 0x00200000u : (e - 1) << 23);
    u->m = 0.0f;
#ifdef MS_X86_SIMD /* the code book looked up 32 lanes at once, as IQ4_NL's (the same codes: the same bits) */
    _mm256_storeu_si256((__m256i *)u->q, lut16(nib_split(_mm_loadu_si128((const __m128i *)(b + 1))), KVALUES_MXFP4));
#else
    for (int j = 0; j < 16; j++) { u->q[j] = KVALUES_MXFP4[b[1 + j] & 0x0F]; u->q[j + 16] = KVALUES_MXFP4[b[1 + j] >> 4]; }
#endif
}

/* family B unpackers: one 256-element super-block */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

#ifdef MS_X86_SIMD
static void unpack_q2_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *scales = b, *qs = b + 16;
    u->d = rdh(b + 80); u->dmin = rdh(b + 82); u->has_min = 1;
    const __m128i sv = _mm_loadu_si128((const __m128i *)scales);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    _mm256_storeu_si256((__m256i *)u->sc, _mm256_cvtepu8_epi16(_mm_and_si128(sv, m4)));
    _mm256_storeu_si256((__m256i *)u->mn, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sv, 4), m4)));
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        _mm256_storeu_si256((__m256i *)(u->q + 128 * n), _mm256_and_si256(v, m3));
        _mm256_storeu_si256((__m256i *)(u->q + 128 * n + 32), _mm256_and_si256(_mm256_srli_epi16(v, 2), m3));
        _mm256_storeu_si256((__m256i *)(u->q + 128 * n + 64), _mm256_and_si256(_mm256_srli_epi16(v, 4), m3));
        _mm256_storeu_si256((__m256i *)(u->q + 128 * n + 96), _mm256_and_si256(_mm256_srli_epi16(v, 6), m3));
    }
}
static void unpack_q3_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    u->d = rdh(b + 108); u->dmin = 0.0f; u->has_min = 0;
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
        int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        u->sc[i] = (int16_t)((lo | (hi << 4)) - 32);
    }
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i h = _mm256_loadu_si256((const __m256i *)hm);
    for (int n = 0; n < 2; n++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int j = 0; j < 4; j++) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * n + j)));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
            const __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * j)), m3);
            _mm256_storeu_si256((__m256i *)(u->q + 128 * n + 32 * j), _mm256_sub_epi8(q, _mm256_andnot_si256(set, four)));
        }
    }
}
static inline void scales_k4(const uint8_t *scales, ublk_b *u) {
    for (int j = 0; j < 8; j++) {
        int sc, m; scale_min_k4(j, scales, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = (int16_t)sc;
        u->mn[2 * j] = u->mn[2 * j + 1] = (int16_t)m;
    }
}
static void unpack_q4_k(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = rdh(b + 2); u->has_min = 1;
    scales_k4(b + 4, u);
    const uint8_t *qs = b + 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        _mm256_storeu_si256((__m256i *)(u->q + 64 * j), _mm256_and_si256(v, m4));
        _mm256_storeu_si256((__m256i *)(u->q + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    }
}
static void unpack_q5_k(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = rdh(b + 2); u->has_min = 1;
    scales_k4(b + 4, u);
    const uint8_t *qs = b + 48;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j + 1)), one);
        _mm256_storeu_si256((__m256i *)(u->q + 64 * j),
                            _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_slli_epi16(h0, 4)));
        _mm256_storeu_si256((__m256i *)(u->q + 64 * j + 32),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_slli_epi16(h1, 4)));
    }
}
static void unpack_q6_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    u->d = rdh(b + 208); u->dmin = 0.0f; u->has_min = 0;
    _mm256_storeu_si256((__m256i *)u->sc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; n++) {
        const __m256i L0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n));
        const __m256i L1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
        int8_t *q = u->q + 128 * n;
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(H, m3), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4);
        const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4);
        const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4);
        _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(L0, m4), h0), k32));
        _mm256_storeu_si256((__m256i *)(q + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(L1, m4), h1), k32));
        _mm256_storeu_si256((__m256i *)(q + 64),
                            _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4), h2), k32));
        _mm256_storeu_si256((__m256i *)(q + 96),
                            _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4), h3), k32));
    }
}
static void unpack_iq4_xs(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = 0.0f; u->has_min = 0;
    const uint16_t sh = rd16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
        u->sc[2 * ib] = u->sc[2 * ib + 1] = (int16_t)(ls - 32);
        _mm256_storeu_si256((__m256i *)(u->q + 32 * ib),
                            lut16(nib_split(_mm_loadu_si128((const __m128i *)(qs + 16 * ib))), KVALUES_IQ4NL));
    }
}
#else
static void unpack_q2_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *scales = b, *qs = b + 16;
    u->d = rdh(b + 80); u->dmin = rdh(b + 82); u->has_min = 1;
    for (int g = 0; g < 16; g++) { u->sc[g] = scales[g] & 0x0F; u->mn[g] = scales[g] >> 4; }
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) u->q[n * 128 + j * 32 + l] = (int8_t)((qs[n * 32 + l] >> (2 * j)) & 3);
}
static void unpack_q3_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    u->d = rdh(b + 108); u->dmin = 0.0f; u->has_min = 0;
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
        int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        u->sc[i] = (int16_t)((lo | (hi << 4)) - 32);
    }
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++) {
            const uint8_t m = (uint8_t)(1u << (n * 4 + j));
            for (int l = 0; l < 32; l++)
                u->q[n * 128 + j * 32 + l] = (int8_t)(((qs[n * 32 + l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4));
        }
}
static void unpack_q4_k(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = rdh(b + 2); u->has_min = 1;
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m; scale_min_k4(j, scales, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = (int16_t)sc;
        u->mn[2 * j] = u->mn[2 * j + 1] = (int16_t)m;
    }
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            u->q[64 * j + l] = (int8_t)(qs[32 * j + l] & 0x0F);
            u->q[64 * j + 32 + l] = (int8_t)(qs[32 * j + l] >> 4);
        }
}
static void unpack_q5_k(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = rdh(b + 2); u->has_min = 1;
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, m; scale_min_k4(j, scales, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = (int16_t)sc;
        u->mn[2 * j] = u->mn[2 * j + 1] = (int16_t)m;
    }
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            u->q[64 * j + l] = (int8_t)((qs[32 * j + l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4));
            u->q[64 * j + 32 + l] = (int8_t)((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
        }
}
static void unpack_q6_k(const uint8_t *b, ublk_b *u) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    u->d = rdh(b + 208); u->dmin = 0.0f; u->has_min = 0;
    for (int g = 0; g < 16; g++) u->sc[g] = sc[g];
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *L = ql + 64 * n, *H = qh + 32 * n;
            int8_t *q = u->q + 128 * n;
            q[l] = (int8_t)(((L[l] & 0x0F) | (((H[l] >> 0) & 3) << 4)) - 32);
            q[l + 32] = (int8_t)(((L[l + 32] & 0x0F) | (((H[l] >> 2) & 3) << 4)) - 32);
            q[l + 64] = (int8_t)(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
            q[l + 96] = (int8_t)(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
        }
}
static void unpack_iq4_xs(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b); u->dmin = 0.0f; u->has_min = 0;
    const uint16_t sh = rd16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
        u->sc[2 * ib] = u->sc[2 * ib + 1] = (int16_t)(ls - 32);
        for (int j = 0; j < 16; j++) {
            u->q[32 * ib + j] = KVALUES_IQ4NL[qs[16 * ib + j] & 0x0F];
            u->q[32 * ib + 16 + j] = KVALUES_IQ4NL[qs[16 * ib + j] >> 4];
        }
    }
}

#endif

/* ------------------------------------------------------------------------------------------------------ */
/* dot products on unpacked blocks                                                                         */

#ifdef MS_X86_SIMD
static inline float hsum_ps(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline int hsum_epi32(__m256i v) {
    __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xB1));
    return _mm_cvtsi128_si32(lo);
}
/* 8 int32 lanes, each the sum of 4 products w*x of 32 int8 pairs */
static inline __m256i dot32_epi32(__m256i w, __m256i x) {
#if defined(MS_ISA_AVX512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
#else
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}
/* 16 int16 lanes: pair sums of w*x (|w| <= 128, |x| <= 127: no saturation) */
static inline __m256i dot32_epi16(__m256i w, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

/* Family A accumulator: per (row, token) 8 float lanes (x86) or one float (portable). */
typedef struct {
#ifdef MS_X86_SIMD
    __m256 v;
#else
    float v;
#endif
    float m; /* sum of m_w * s_x (offset terms) */
} acc_a;

static inline void acc_a_zero(acc_a *a) {
#ifdef MS_X86_SIMD
    a->v = _mm256_setzero_ps();
#else
    a->v = 0.0f;
#endif
    a->m = 0.0f;
}
static inline float acc_a_total(const acc_a *a) {
#ifdef MS_X86_SIMD
    return hsum_ps(a->v) + a->m;
#else
    return a->v + a->m;
#endif
}
static inline void dot_a(const ublk_a *w, const act_q8_0 *x, acc_a *a) {
#ifdef MS_X86_SIMD
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w->q);
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x->q);
    const __m256 p = _mm256_cvtepi32_ps(dot32_epi32(wv, xv));
    a->v = _mm256_fmadd_ps(_mm256_set1_ps(w->d * x->d), p, a->v);
#else
    int isum = 0;
    for (int i = 0; i < QK; i++) isum += (int)w->q[i] * (int)x->q[i];
    a->v += (w->d * x->d) * (float)isum;
#endif
    a->m += w->m * x->s; /* 0 for types without an offset (exact: adds +0) */
}

/* Family B accumulator per (row, token): on SIMD builds two vectors of 8 float lanes (d-terms and min-terms,
 * summed across lanes at the end of the row); portable: one float, each super-block's integer sums exact. */
typedef struct {
#ifdef MS_X86_SIMD
    __m256 v, m;
#else
    float v;
#endif
} acc_b;

static inline void acc_b_zero(acc_b *a) {
#ifdef MS_X86_SIMD
    a->v = _mm256_setzero_ps(); a->m = _mm256_setzero_ps();
#else
    a->v = 0.0f;
#endif
}
static inline float acc_b_total(const acc_b *a) {
#ifdef MS_X86_SIMD
    return hsum_ps(a->v) - hsum_ps(a->m);
#else
    return a->v;
#endif
}
static inline void dot_b(const ublk_b *w, const act_q8_k *x, acc_b *a) {
#ifdef MS_X86_SIMD
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w->q + 32 * c));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * c));
#if defined(MS_ISA_AVX512)
        acc = _mm256_dpwssd_epi32(acc, dot32_epi16(wv, xv), w->scv[c]);
#else
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(dot32_epi16(wv, xv), w->scv[c]));
#endif
    }
    a->v = _mm256_fmadd_ps(_mm256_set1_ps(w->d * x->d), _mm256_cvtepi32_ps(acc), a->v);
    if (w->has_min) {
        const __m256i mn = _mm256_loadu_si256((const __m256i *)w->mn);
        const __m256i bs = _mm256_loadu_si256((const __m256i *)x->bsum);
        a->m = _mm256_fmadd_ps(_mm256_set1_ps(w->dmin * x->d), _mm256_cvtepi32_ps(_mm256_madd_epi16(mn, bs)), a->m);
    }
#else
    int isum = 0, msum = 0;
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += (int)w->q[16 * g + i] * (int)x->q[16 * g + i];
        isum += s * w->sc[g];
    }
    float r = (w->d * x->d) * (float)isum;
    if (w->has_min) {
        for (int g = 0; g < 16; g++) msum += (int)w->mn[g] * (int)x->bsum[g];
        r -= (w->dmin * x->d) * (float)msum;
    }
    a->v += r;
#endif
}

/* Family C: float weights widened per 32-element block */
static void widen_block(int t, const uint8_t *b, float *out) {
    if (t == T_F32) { memcpy(out, b, QK * 4); return; }
#if defined(MS_X86_SIMD)
    if (t == T_F16) {
        for (int i = 0; i < QK; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * i))));
        return;
    }
    for (int i = 0; i < QK; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 2 * i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
#else
    for (int i = 0; i < QK; i++) out[i] = t == T_F16 ? f16_to_f32(rd16(b + 2 * i)) : bf16_to_f32(rd16(b + 2 * i));
#endif
}

typedef struct {
#ifdef MS_X86_SIMD
    __m256 v;
#else
    float v[8];
#endif
} acc_c;

static inline void acc_c_zero(acc_c *a) {
#ifdef MS_X86_SIMD
    a->v = _mm256_setzero_ps();
#else
    for (int i = 0; i < 8; i++) a->v[i] = 0.0f;
#endif
}
static inline float acc_c_total(const acc_c *a) {
#ifdef MS_X86_SIMD
    return hsum_ps(a->v);
#else
    return ((a->v[0] + a->v[1]) + (a->v[2] + a->v[3])) + ((a->v[4] + a->v[5]) + (a->v[6] + a->v[7]));
#endif
}
static inline void dot_c(const float *w, const float *x, acc_c *a) {
#ifdef MS_X86_SIMD
    __m256 v = a->v;
    for (int i = 0; i < QK; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), v);
    a->v = v;
#else
    for (int i = 0; i < QK; i += 8)
        for (int l = 0; l < 8; l++) a->v[l] += w[i + l] * x[i + l];
#endif
}

/* Software prefetch of the weight row PF_ROWS ahead of the one being computed: the hardware prefetchers alone left
 * a one-token matmul at 10.8 GB/s on one thread of the 2-core AMD EPYC test machine, 13.6 GB/s with it (the Q6_K
 * LM head of the Qwen3-30B-A3B-shaped bench model; 20.3 -> 25.0 GB/s on 2 threads). */
#ifndef PF_ROWS
#define PF_ROWS 2
#endif
/* the same block of the row PF_ROWS ahead, a cache line at a time, beside the computation of this one (a whole
 * row at the start of each row was slower: the misses then come in bursts) */
#if defined(MS_X86_SIMD)
#define PF_BLOCK(p, nbytes)                                                                                   \
    do {                                                                                                      \
        if (pf)                                                                                               \
            for (int l_ = 0; l_ < (nbytes); l_ += 64)                                                         \
                _mm_prefetch((const char *)(p) + PF_ROWS * row_bytes + l_, _MM_HINT_T0);                      \
    } while (0)
#elif defined(__GNUC__)
#define PF_BLOCK(p, nbytes)                                                                                   \
    do {                                                                                                      \
        if (pf)                                                                                               \
            for (int l_ = 0; l_ < (nbytes); l_ += 64)                                                         \
                __builtin_prefetch((const char *)(p) + PF_ROWS * row_bytes + l_, 0, 3);                       \
    } while (0)
#else
#define PF_BLOCK(p, nbytes) (void)pf
#endif

/* ------------------------------------------------------------------------------------------------------ */
/* activation rows                                                                                         */

/* bytes of one quantized activation row of n elements for weights of family fam */
static size_t act_row_bytes(int fam, int n) {
    if (fam == FAM_A) return (size_t)(n / QK) * sizeof(act_q8_0);
    if (fam == FAM_B) return (size_t)(n / QKK) * sizeof(act_q8_k);
    return (size_t)n * sizeof(float);
}
static int no_fused(void);
static void quantize_row(int fam, const float *x, void *out, int n) {
#ifdef MS_X86_SIMD
    if (!no_fused()) {
        if (fam == FAM_A) { quantize_q8_0_v(x, (act_q8_0 *)out, n); return; }
        if (fam == FAM_B) { quantize_q8_k_v(x, (act_q8_k *)out, n); return; }
    }
#endif
    if (fam == FAM_A) quantize_q8_0(x, (act_q8_0 *)out, n);
    else if (fam == FAM_B) quantize_q8_k(x, (act_q8_k *)out, n);
    else memcpy(out, x, (size_t)n * sizeof(float));
}

/* ------------------------------------------------------------------------------------------------------ */
/* the tile kernels: rows [r0, r1) of W against n_tok activation rows                                     */
/* out[t * out_stride + r] = scale[t] * (W[r] . x[t])   (scale NULL: 1). One function per type, with the    */
/* unpacker inlined; for each weight block the unpacked codes meet up to TOK_TILE tokens.                   */

#define MM_HEAD                                                                                               \
    for (int t0 = 0; t0 < n_tok; t0 += TOK_TILE) {                                                            \
        const int nt = n_tok - t0 < TOK_TILE ? n_tok - t0 : TOK_TILE;                                         \
        for (int r = r0; r < r1; r++) {                                                                       \
            const uint8_t *wr = W + (size_t)r * row_bytes;                                                    \
            const int pf = r + PF_ROWS < r1;                                                                  \
            float res[TOK_TILE];
#define MM_TAIL                                                                                               \
            for (int k = 0; k < nt; k++)                                                                      \
                out[(size_t)(t0 + k) * out_stride + r] = scale ? scale[t0 + k] * res[k] : res[k];             \
        }                                                                                                     \
    }

#define MM_ARGS const uint8_t *W, size_t row_bytes, int r0, int r1, int n_cols, const uint8_t *const *xq, \
                int n_tok, float *out, size_t out_stride, const float *scale
typedef void (*mm_fn)(MM_ARGS);

#define DEFINE_MM_A(NAME, UNPACK, BYTES)                                                                      \
    static void NAME(MM_ARGS) {                                                                               \
        const int nb = n_cols / QK;                                                                           \
        MM_HEAD                                                                                               \
        acc_a acc[TOK_TILE];                                                                                  \
        for (int k = 0; k < nt; k++) acc_a_zero(&acc[k]);                                                     \
        ublk_a u;                                                                                             \
        for (int b = 0; b < nb; b++) {                                                                        \
            PF_BLOCK(wr + (size_t)b * (BYTES), BYTES);                                                        \
            UNPACK(wr + (size_t)b * (BYTES), &u);                                                             \
            for (int k = 0; k < nt; k++) dot_a(&u, (const act_q8_0 *)xq[t0 + k] + b, &acc[k]);                \
        }                                                                                                     \
        for (int k = 0; k < nt; k++) res[k] = acc_a_total(&acc[k]);                                           \
        MM_TAIL                                                                                               \
    }

#define DEFINE_MM_B(NAME, UNPACK, BYTES)                                                                      \
    static void NAME(MM_ARGS) {                                                                               \
        const int nb = n_cols / QKK;                                                                          \
        MM_HEAD                                                                                               \
        acc_b acc[TOK_TILE];                                                                                  \
        for (int k = 0; k < nt; k++) acc_b_zero(&acc[k]);                                                     \
        ublk_b u;                                                                                             \
        for (int b = 0; b < nb; b++) {                                                                        \
            PF_BLOCK(wr + (size_t)b * (BYTES), BYTES);                                                        \
            UNPACK(wr + (size_t)b * (BYTES), &u);                                                             \
            prep_b(&u);                                                                                       \
            for (int k = 0; k < nt; k++) dot_b(&u, (const act_q8_k *)xq[t0 + k] + b, &acc[k]);                \
        }                                                                                                     \
        for (int k = 0; k < nt; k++) res[k] = acc_b_total(&acc[k]);                                           \
        MM_TAIL                                                                                               \
    }

#define DEFINE_MM_C(NAME, TYPE, BYTES)                                                                        \
    static void NAME(MM_ARGS) {                                                                               \
        const int nb = n_cols / QK;                                                                           \
        MM_HEAD                                                                                               \
        acc_c acc[TOK_TILE];                                                                                  \
        for (int k = 0; k < nt; k++) acc_c_zero(&acc[k]);                                                     \
        float wf[QK] __attribute__((aligned(32)));                                                            \
        for (int b = 0; b < nb; b++) {                                                                        \
            PF_BLOCK(wr + (size_t)b * (BYTES), BYTES);                                                        \
            widen_block(TYPE, wr + (size_t)b * (BYTES), wf);                                                  \
            for (int k = 0; k < nt; k++) dot_c(wf, (const float *)xq[t0 + k] + b * QK, &acc[k]);              \
        }                                                                                                     \
        for (int k = 0; k < nt; k++) res[k] = acc_c_total(&acc[k]);                                           \
        MM_TAIL                                                                                               \
    }

DEFINE_MM_A(mm_q4_0, unpack_q4_0, 18)
DEFINE_MM_A(mm_q4_1, unpack_q4_1, 20)
DEFINE_MM_A(mm_q5_0, unpack_q5_0, 22)
DEFINE_MM_A(mm_q5_1, unpack_q5_1, 24)
DEFINE_MM_A(mm_q8_0, unpack_q8_0, 34)
DEFINE_MM_A(mm_iq4_nl, unpack_iq4_nl, 18)
DEFINE_MM_A(mm_mxfp4, unpack_mxfp4, 17)
DEFINE_MM_B(mm_q2_k, unpack_q2_k, 84)
DEFINE_MM_B(mm_q3_k, unpack_q3_k, 110)
DEFINE_MM_B(mm_q4_k, unpack_q4_k, 144)
DEFINE_MM_B(mm_q5_k, unpack_q5_k, 176)
DEFINE_MM_B(mm_q6_k, unpack_q6_k, 210)
DEFINE_MM_B(mm_iq4_xs, unpack_iq4_xs, 136)
DEFINE_MM_C(mm_f32, T_F32, 128)
DEFINE_MM_C(mm_f16, T_F16, 64)
DEFINE_MM_C(mm_bf16, T_BF16, 64)


#ifdef MS_X86_SIMD
/* Fused tile kernels for the commonest types on x86 builds: the per-super-block scales are decoded once per
 * weight row and block, the codes are formed in registers for each token (no unpacked copy in memory). Each
 * forms exactly the integer vectors and float operations of the unpack path above (same 32-code chunks, same
 * int16 pair sums, same scale lanes, same FMAs), so the results are bitwise those of DEFINE_MM_B/A. */

/* Q4_K: 8 six-bit scales and mins from the 12 packed bytes (ggml-common.h block_q4_K): bytes 0-7 of the result
 * are the scales, 8-15 the mins; formed in general registers and moved as one vector (no store and reload) */
static inline __m128i q4k_scales(const uint8_t *q) {
    uint32_t u[3];
    memcpy(u, q, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    const uint32_t mins47 = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins03 = u[1] & k1;
    const uint32_t sc47 = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    const uint32_t sc03 = u[0] & k1;
    return _mm_set_epi32((int)mins47, (int)mins03, (int)sc47, (int)sc03);
}

static void mm_q4_k_fused(MM_ARGS) {
    const int nb = n_cols / QKK;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    MM_HEAD
    acc_b acc[TOK_TILE];
    for (int k = 0; k < nt; k++) acc_b_zero(&acc[k]);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wr + (size_t)b * 144;
        PF_BLOCK(blk, 144);
        const __m128i sm = q4k_scales(blk + 4);
        const float d = rdh(blk), dmin = rdh(blk + 2);
        /* scale c as 16 int16 lanes by one byte shuffle each (zero high bytes: the scales are 6-bit, unsigned) */
        const __m256i smv = _mm256_broadcastsi128_si256(sm);
        __m256i scv[8];
        for (int c = 0; c < 8; c++) scv[c] = _mm256_shuffle_epi8(smv, _mm256_set1_epi16((short)(0x8000 | c)));
        const __m128i m8 = _mm_unpackhi_epi64(sm, sm);
        const __m256i mnv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        const uint8_t *qs = blk + 16;
        for (int k = 0; k < nt; k++) {
            const act_q8_k *x = (const act_q8_k *)xq[t0 + k] + b;
            /* two chains of integer lanes (the low and the high nibbles' chunks), added at the end: the same exact
             * int32 lanes, half the dependent dpwssd latency per block */
            __m256i is = _mm256_setzero_si256(), is1 = _mm256_setzero_si256(), is2 = is, is3 = is;
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x->q + 64 * j)));
                const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->q + 64 * j + 32)));
#if defined(MS_ISA_AVX512)
                if (j & 1) {
                    is2 = _mm256_dpwssd_epi32(is2, p0, scv[2 * j]);
                    is3 = _mm256_dpwssd_epi32(is3, p1, scv[2 * j + 1]);
                } else {
                    is = _mm256_dpwssd_epi32(is, p0, scv[2 * j]);
                    is1 = _mm256_dpwssd_epi32(is1, p1, scv[2 * j + 1]);
                }
#else
                is = _mm256_add_epi32(is, _mm256_madd_epi16(p0, scv[2 * j]));
                is1 = _mm256_add_epi32(is1, _mm256_madd_epi16(p1, scv[2 * j + 1]));
#endif
            }
            is = _mm256_add_epi32(_mm256_add_epi32(is, is1), _mm256_add_epi32(is2, is3));
            acc[k].v = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(is), acc[k].v);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)x->bsum);
            acc[k].m = _mm256_fmadd_ps(_mm256_set1_ps(dmin * x->d), _mm256_cvtepi32_ps(_mm256_madd_epi16(mnv, bs)),
                                       acc[k].m);
        }
    }
    for (int k = 0; k < nt; k++) res[k] = acc_b_total(&acc[k]);
    MM_TAIL
}

/* Q6_K. The 16 int8 scales become the 8 scale vectors by a byte shuffle each (low half sc[2c], high half
 * sc[2c + 1], sign-extended to int16) instead of 8 pairs of broadcasts. The codes q - 32 meet a token's codes x
 * as int16 pair sums either as maddubs(|q - 32|, sign(x, q - 32)) (the codes' magnitudes shared by a tile of
 * tokens) or, for one token, as maddubs(q, x) - maddubs(32, x) (q in 0..63 unsigned): both are the exact pair
 * sums (no saturation: |q - 32| <= 32, 63 * 127 * 2 < 32767), so every int16 lane, and so every bit, is the same. */
static const uint8_t Q6K_SCALE_SHUF[8][16] = {
#define Q6K_ROW(c) {2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,                                     \
                    2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1}
    Q6K_ROW(0), Q6K_ROW(1), Q6K_ROW(2), Q6K_ROW(3), Q6K_ROW(4), Q6K_ROW(5), Q6K_ROW(6), Q6K_ROW(7)
#undef Q6K_ROW
};

#define Q6K_XS_MAX 512 /* 32-code chunks of one token's row whose 32 * (pair sums) are formed once per call */

static void mm_q6_k_fused(MM_ARGS) {
    const int nb = n_cols / QKK;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    /* one token: maddubs(32, x) of each chunk depends on the activation only, so it is formed once per call */
    __m256i xs[Q6K_XS_MAX];
    const int have_xs = n_tok == 1 && nb * 8 <= Q6K_XS_MAX;
    if (have_xs)
        for (int c = 0; c < nb * 8; c++)
            xs[c] = _mm256_maddubs_epi16(k32, _mm256_loadu_si256(
                (const __m256i *)(((const act_q8_k *)xq[0])[c / 8].q + 32 * (c % 8))));
    MM_HEAD
    acc_b acc[TOK_TILE];
    for (int k = 0; k < nt; k++) acc_b_zero(&acc[k]);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wr + (size_t)b * 210;
        PF_BLOCK(blk, 210);
        const float d = rdh(blk + 208);
        const __m128i scb = _mm_loadu_si128((const __m128i *)(blk + 192));
        __m256i scv[8];
        for (int c = 0; c < 8; c++)
            scv[c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scb, _mm_loadu_si128((const __m128i *)Q6K_SCALE_SHUF[c])));
        __m256i q[8]; /* unsigned codes 0..63 */
        for (int n = 0; n < 2; n++) {
            const __m256i L0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i L1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i H = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            q[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
            q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
            q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
            q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
        }
        if (nt == 1) {
            const act_q8_k *x = (const act_q8_k *)xq[t0] + b;
            __m256i isc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                              _mm256_setzero_si256()}; /* four chains (chunk c mod 4) */
            for (int c = 0; c < 8; c++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * c));
                const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[c], xv),
                                                   have_xs ? xs[8 * b + c] : _mm256_maddubs_epi16(k32, xv));
#if defined(MS_ISA_AVX512)
                isc[c & 3] = _mm256_dpwssd_epi32(isc[c & 3], p, scv[c]);
#else
                isc[c & 3] = _mm256_add_epi32(isc[c & 3], _mm256_madd_epi16(p, scv[c]));
#endif
            }
            const __m256i is = _mm256_add_epi32(_mm256_add_epi32(isc[0], isc[1]), _mm256_add_epi32(isc[2], isc[3]));
            acc[0].v = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(is), acc[0].v);
            continue;
        }
        __m256i aq[8];
        for (int c = 0; c < 8; c++) {
            q[c] = _mm256_sub_epi8(q[c], k32);
            aq[c] = _mm256_sign_epi8(q[c], q[c]);
        }
        for (int k = 0; k < nt; k++) {
            const act_q8_k *x = (const act_q8_k *)xq[t0 + k] + b;
            __m256i is = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * c));
                const __m256i p = _mm256_maddubs_epi16(aq[c], _mm256_sign_epi8(xv, q[c]));
#if defined(MS_ISA_AVX512)
                is = _mm256_dpwssd_epi32(is, p, scv[c]);
#else
                is = _mm256_add_epi32(is, _mm256_madd_epi16(p, scv[c]));
#endif
            }
            acc[k].v = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(is), acc[k].v);
        }
    }
    for (int k = 0; k < nt; k++) res[k] = acc_b_total(&acc[k]);
    MM_TAIL
}

/* F32 weights and one token: each row's sum is the unpack path's one chain of FMAs over the row in order, read
 * straight from the weights (no widened copy), four rows at once so that their chains overlap (same bits). */
static void mm_f32_fused(MM_ARGS) {
    if (n_tok != 1) { mm_f32(W, row_bytes, r0, r1, n_cols, xq, n_tok, out, out_stride, scale); return; }
    const float *x = (const float *)xq[0];
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const float *w0 = (const float *)(W + (size_t)r * row_bytes);
        const float *w1 = (const float *)(W + (size_t)(r + 1) * row_bytes);
        const float *w2 = (const float *)(W + (size_t)(r + 2) * row_bytes);
        const float *w3 = (const float *)(W + (size_t)(r + 3) * row_bytes);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < n_cols; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        const float s = scale ? scale[0] : 1.0f;
        out[r] = scale ? s * hsum_ps(a0) : hsum_ps(a0);
        out[r + 1] = scale ? s * hsum_ps(a1) : hsum_ps(a1);
        out[r + 2] = scale ? s * hsum_ps(a2) : hsum_ps(a2);
        out[r + 3] = scale ? s * hsum_ps(a3) : hsum_ps(a3);
    }
    if (r < r1) mm_f32(W, row_bytes, r, r1, n_cols, xq, n_tok, out, out_stride, scale);
}
/* F16 / BF16 weights and one token: as mm_f32_fused, with each 8 weights widened in registers by widen_block's own
 * conversion (exact) straight into the row's one chain of FMAs, four rows at once: the unpack path's bits, without
 * the widened copy of each block (at one token that copy cost more than the FMAs: MLA's per-head up-projections,
 * kernels.linear_heads, on BF16 attn_k_b / attn_v_b). */
static inline __m256 widen8(int bf16, const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
#define DEFINE_MM_HALF_FUSED(NAME, BF16, UNPACKED)                                                            \
    static void NAME(MM_ARGS) {                                                                               \
        if (n_tok != 1) { UNPACKED(W, row_bytes, r0, r1, n_cols, xq, n_tok, out, out_stride, scale); return; } \
        const float *x = (const float *)xq[0];                                                                \
        int r = r0;                                                                                           \
        for (; r + 4 <= r1; r += 4) {                                                                         \
            const uint8_t *w0 = W + (size_t)r * row_bytes, *w1 = w0 + row_bytes, *w2 = w1 + row_bytes,        \
                          *w3 = w2 + row_bytes;                                                               \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                       \
            for (int i = 0; i < n_cols; i += 8) {                                                             \
                const __m256 xv = _mm256_loadu_ps(x + i);                                                     \
                a0 = _mm256_fmadd_ps(widen8(BF16, w0 + 2 * i), xv, a0);                                       \
                a1 = _mm256_fmadd_ps(widen8(BF16, w1 + 2 * i), xv, a1);                                       \
                a2 = _mm256_fmadd_ps(widen8(BF16, w2 + 2 * i), xv, a2);                                       \
                a3 = _mm256_fmadd_ps(widen8(BF16, w3 + 2 * i), xv, a3);                                       \
            }                                                                                                 \
            const float s = scale ? scale[0] : 1.0f;                                                          \
            out[r] = scale ? s * hsum_ps(a0) : hsum_ps(a0);                                                   \
            out[r + 1] = scale ? s * hsum_ps(a1) : hsum_ps(a1);                                               \
            out[r + 2] = scale ? s * hsum_ps(a2) : hsum_ps(a2);                                               \
            out[r + 3] = scale ? s * hsum_ps(a3) : hsum_ps(a3);                                               \
        }                                                                                                     \
        if (r < r1) UNPACKED(W, row_bytes, r, r1, n_cols, xq, n_tok, out, out_stride, scale);                 \
    }
DEFINE_MM_HALF_FUSED(mm_f16_fused, 0, mm_f16)
DEFINE_MM_HALF_FUSED(mm_bf16_fused, 1, mm_bf16)

/* Family A, register-blocked (x86): a group of RG_A rows against a tile of up to TB_A tokens per pass over the
 * blocks, the group's accumulators in registers; each unpacked weight block meets TB_A tokens and each activation
 * block RG_A rows. Per (row, token) the float operations are the unpack path's, in the same order: per block the
 * same 8 int32 lanes (exact integers), the same cvtepi32_ps, fmadd(set1(d_w * d_x), p, acc) in block order, then
 * hsum_ps + m. AVX512 builds hold two rows' 8 lanes in one 512-bit vector (lane-wise the same operations; the two
 * halves are summed apart at the end) and form the integer lanes as dpbusd(-128 * sum4(w), x + 128, w): x + 128 as
 * unsigned bytes, the correction per lane from the weights alone (no saturation, no overflow: the same int32
 * values); AVX2 builds as dot32_epi32 does. m: for the types without an offset (m_w = +0) the chain m += 0.0f * s_x
 * is +0 whenever the lanes' sum is finite (total_a; else the chain itself is formed); Q4_1 and Q5_1 keep the
 * per (row, token) chain m += m_w * s_x. With more than TB_A tokens the group's blocks are unpacked once into a
 * per-thread scratch and read back for each token tile. A group past the last row repeats the last row (computed,
 * not written). */
#define MS_AI static inline __attribute__((always_inline))
#if defined(MS_ISA_AVX512)
#define RG_A 4 /* rows per group */
#define TB_A 8 /* tokens per tile */
#define VR_A 2 /* rows per vector */
typedef __m512 vf_a;
typedef __m512i vi_a;
#else
#define RG_A 2
#define TB_A 4
#define VR_A 1
typedef __m256 vf_a;
typedef __m256i vi_a;
#endif
#define NV_A (RG_A / VR_A) /* vectors per group */
typedef struct { vi_a a, b; vf_a d; float m[VR_A]; } wprep_a; /* VR_A rows' prepared block (see wprep_make) */

MS_AI void wprep_make(const ublk_a *u, wprep_a *p) { /* u: VR_A unpacked blocks, one per row */
#if defined(MS_ISA_AVX512)
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)u[0].q)),
                                         _mm256_loadu_si256((const __m256i *)u[1].q), 1);
    p->a = w; /* signed codes; b: -128 * (sum of each lane's 4 codes) */
    p->b = _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), w));
    p->d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(u[0].d))),
                                               _mm256_castps_pd(_mm256_set1_ps(u[1].d)), 1));
    p->m[0] = u[0].m;
    p->m[1] = u[1].m;
#else
    const __m256i w = _mm256_loadu_si256((const __m256i *)u[0].q);
    p->a = _mm256_sign_epi8(w, w); /* |w|; b: w (the signs) */
    p->b = w;
    p->d = _mm256_set1_ps(u[0].d);
    p->m[0] = u[0].m;
#endif
}
MS_AI vi_a xprep_a(const act_q8_0 *x) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)x->q);
#if defined(MS_ISA_AVX512)
    return _mm512_xor_si512(_mm512_broadcast_i64x4(v), _mm512_set1_epi8((char)0x80)); /* x + 128, unsigned */
#else
    return v;
#endif
}
MS_AI vf_a mac_a(const wprep_a *w, vi_a x, vf_a bx, vf_a acc) { /* acc + set1(d_w * d_x) * cvt(lanes(w . x)) */
#if defined(MS_ISA_AVX512)
    const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(w->b, x, w->a));
    return _mm512_fmadd_ps(_mm512_mul_ps(w->d, bx), p, acc);
#else
    const __m256 p = _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(w->a, _mm256_sign_epi8(x, w->b)), _mm256_set1_epi16(1)));
    return _mm256_fmadd_ps(_mm256_mul_ps(w->d, bx), p, acc);
#endif
}

/* hsum + m for the types without an offset: the unpack path's chain m += 0.0f * s_x over the row's blocks is +0
 * while every s_x is finite (+0 + +-0 = +0), and every s_x is finite when every d_x is (|s_x| <= 65504 * 32 * 127);
 * a non-finite d_x makes the sum of that token's lanes non-finite (d_w * d_x is inf or NaN, and so is each fmadd
 * after it: inf * 0 and inf - inf are NaN). So a finite sum adds +0.0f (which turns -0.0 into +0.0, as the chain
 * does); a non-finite one takes the chain itself. */
MS_AI float add_hm(float h, float m) { /* h + m, h the first operand (as acc_a_total): of two NaNs, h's */
    return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(h), _mm_set_ss(m)));
}
MS_AI float total_a(float h, const act_q8_0 *x, int nb) {
    if (isfinite(h)) return h + 0.0f;
    float m = 0.0f;
    for (int b = 0; b < nb; b++) m += 0.0f * x[b].s;
    return add_hm(h, m);
}

/* the group's rows wrow[0..RG_A) (its VR_A-row vectors' blocks prepared into prep[v * nb + b] (prep given), or
 * unpacked here) against tokens xt[0..TB); res[i * TB_A + k] */
MS_AI void tile_a(void (*unpack)(const uint8_t *, ublk_a *), int bytes, int has_m, int TB,
                  const uint8_t *const *wrow, size_t row_bytes, int nb, const wprep_a *prep,
                  const act_q8_0 *const *xt, int pf, float *res) {
    vf_a acc[NV_A][TB_A];
    float macc[RG_A][TB_A];
    for (int v = 0; v < NV_A; v++)
        for (int k = 0; k < TB; k++) {
#if defined(MS_ISA_AVX512)
            acc[v][k] = _mm512_setzero_ps();
#else
            acc[v][k] = _mm256_setzero_ps();
#endif
        }
    if (has_m)
        for (int i = 0; i < RG_A; i++)
            for (int k = 0; k < TB; k++) macc[i][k] = 0.0f;
    for (int b = 0; b < nb; b++) {
        wprep_a wl[NV_A];
        const wprep_a *w[NV_A];
        for (int v = 0; v < NV_A; v++) {
            if (prep) {
                w[v] = prep + (size_t)v * nb + b;
            } else {
                ublk_a u[VR_A];
                for (int j = 0; j < VR_A; j++) {
                    const uint8_t *blk = wrow[v * VR_A + j] + (size_t)b * bytes;
                    if (pf)
                        for (int l = 0; l < bytes; l += 64)
                            _mm_prefetch((const char *)blk + RG_A * row_bytes + l, _MM_HINT_T0);
                    unpack(blk, &u[j]);
                }
                wprep_make(u, &wl[v]);
                w[v] = &wl[v];
            }
        }
        for (int k = 0; k < TB; k++) {
            const act_q8_0 *x = xt[k] + b;
            const vi_a xv = xprep_a(x);
#if defined(MS_ISA_AVX512)
            const vf_a bx = _mm512_set1_ps(x->d);
#else
            const vf_a bx = _mm256_broadcast_ss(&x->d);
#endif
            for (int v = 0; v < NV_A; v++) acc[v][k] = mac_a(w[v], xv, bx, acc[v][k]);
            if (has_m)
                for (int v = 0; v < NV_A; v++)
                    for (int j = 0; j < VR_A; j++)
                        macc[v * VR_A + j][k] = macc[v * VR_A + j][k] + w[v]->m[j] * x->s;
        }
    }
    for (int v = 0; v < NV_A; v++)
        for (int k = 0; k < TB; k++) {
#if defined(MS_ISA_AVX512)
            const float h0 = hsum_ps(_mm512_castps512_ps256(acc[v][k]));
            const float h1 = hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[v][k]), 1)));
            res[(2 * v) * TB_A + k] = has_m ? add_hm(h0, macc[2 * v][k]) : total_a(h0, xt[k], nb);
            res[(2 * v + 1) * TB_A + k] = has_m ? add_hm(h1, macc[2 * v + 1][k]) : total_a(h1, xt[k], nb);
#else
            res[v * TB_A + k] = has_m ? add_hm(hsum_ps(acc[v][k]), macc[v][k]) : total_a(hsum_ps(acc[v][k]), xt[k], nb);
#endif
        }
}

#if defined(MS_ISA_AVX512)
/* Few tokens (decode, small expert groups): 4 rows x up to NT1_A tokens in 256-bit vectors, the weight codes as unsigned bytes
 * u = q + bias (Q4_0: the nibbles, bias 8; Q5_0: 16; Q8_0: q xor 0x80, bias 128; IQ4_NL and MXFP4: their code
 * books + 128; Q4_1, Q5_1: the codes, bias 0) and the lanes dpbusd(-bias * sum4(x), u, x) = sum4(q * x): the same
 * int32 values, the correction per token and block formed once per call (cx); the weights are read as they are
 * stored, no scratch copy. */
#define NT1_A 4
static const int8_t KVALUES_IQ4NL_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15};
static const int8_t KVALUES_MXFP4_U[16] = {-128, -127, -126, -125, -124, -122, -120, -116,
                                           -128, 127, 126, 125, 124, 122, 120, 116};
MS_AI int bias_a(int type) {
    switch (type) {
    case T_Q4_0: return 8;
    case T_Q5_0: return 16;
    case T_Q8_0: case T_IQ4_NL: case T_MXFP4: return 128;
    default: return 0;
    }
}
MS_AI __m256i ucodes_a(int type, const uint8_t *b, float *d, float *m) {
    *m = 0.0f;
    switch (type) {
    case T_Q4_0: *d = rdh(b); return nib_split(_mm_loadu_si128((const __m128i *)(b + 2)));
    case T_Q4_1: *d = rdh(b); *m = rdh(b + 2); return nib_split(_mm_loadu_si128((const __m128i *)(b + 4)));
    case T_Q5_0:
        *d = rdh(b);
        return _mm256_or_si256(nib_split(_mm_loadu_si128((const __m128i *)(b + 6))),
                               _mm256_and_si256(bits_to_bytes(rd32(b + 2)), _mm256_set1_epi8(0x10)));
    case T_Q5_1:
        *d = rdh(b); *m = rdh(b + 2);
        return _mm256_or_si256(nib_split(_mm_loadu_si128((const __m128i *)(b + 8))),
                               _mm256_and_si256(bits_to_bytes(rd32(b + 4)), _mm256_set1_epi8(0x10)));
    case T_Q8_0:
        *d = rdh(b);
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    case T_IQ4_NL: *d = rdh(b); return lut16(nib_split(_mm_loadu_si128((const __m128i *)(b + 2))), KVALUES_IQ4NL_U);
    default: { /* T_MXFP4 */
        const uint32_t e = b[0];
        *d = fp32_from_bits(e < 2 ? (e + 1) * 0x00200000u : (e - 1) << 23);
        return lut16(nib_split(_mm_loadu_si128((const __m128i *)(b + 1))), KVALUES_MXFP4_U);
    }
    }
}
MS_AI void tile_a1(int type, int bytes, int has_m, int TB, const uint8_t *const *wrow, size_t row_bytes, int nb,
                   const act_q8_0 *const *xt, const __m256i *cx, int pf, float *res) {
    __m256 acc[4][NT1_A];
    float macc[4][NT1_A];
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < TB; k++) { acc[i][k] = _mm256_setzero_ps(); macc[i][k] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        __m256i xv[NT1_A], cv[NT1_A];
        __m256 bx[NT1_A];
        for (int k = 0; k < TB; k++) {
            const act_q8_0 *x = xt[k] + b;
            xv[k] = _mm256_loadu_si256((const __m256i *)x->q);
            cv[k] = cx[(size_t)k * nb + b];
            bx[k] = _mm256_broadcast_ss(&x->d);
        }
        for (int i = 0; i < 4; i++) {
            const uint8_t *blk = wrow[i] + (size_t)b * bytes;
            if (pf)
                for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk + 4 * row_bytes + l, _MM_HINT_T0);
            float d, m;
            const __m256i u = ucodes_a(type, blk, &d, &m);
            const __m256 bw = _mm256_set1_ps(d);
            for (int k = 0; k < TB; k++) {
                const __m256 p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(cv[k], u, xv[k]));
                acc[i][k] = _mm256_fmadd_ps(_mm256_mul_ps(bw, bx[k]), p, acc[i][k]);
                if (has_m) macc[i][k] = macc[i][k] + m * xt[k][b].s;
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < TB; k++)
            res[i * NT1_A + k] = has_m ? add_hm(hsum_ps(acc[i][k]), macc[i][k]) : total_a(hsum_ps(acc[i][k]), xt[k], nb);
}
#define MM_A_FEW(TYPE)                                                                                        \
    if (n_tok <= NT1_A) {                                                                                     \
        __m256i *cx = (__m256i *)sc;                                                                          \
        const __m256i bias = _mm256_set1_epi8((char)bias_a(TYPE));                                            \
        for (int k = 0; k < n_tok; k++)                                                                       \
            for (int b = 0; b < nb; b++)                                                                      \
                cx[(size_t)k * nb + b] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(        \
                    _mm256_setzero_si256(), bias, _mm256_loadu_si256((const __m256i *)((const act_q8_0 *)xq[k])[b].q))); \
        const act_q8_0 *xt[NT1_A];                                                                            \
        for (int k = 0; k < NT1_A; k++) xt[k] = (const act_q8_0 *)xq[k < n_tok ? k : 0];                      \
        float res[4 * NT1_A];                                                                                 \
        for (int r = r0; r < r1; r += 4) {                                                                    \
            const uint8_t *wrow[4];                                                                           \
            for (int i = 0; i < 4; i++) wrow[i] = W + (size_t)(r + i < r1 ? r + i : r1 - 1) * row_bytes;      \
            const int pf = r + 8 <= r1;                                                                       \
            switch (n_tok) {                                                                                  \
            case 4: tile_a1(TYPE, bytes_, has_m_, 4, wrow, row_bytes, nb, xt, cx, pf, res); break;         \
            case 3: tile_a1(TYPE, bytes_, has_m_, 3, wrow, row_bytes, nb, xt, cx, pf, res); break;         \
            case 2: tile_a1(TYPE, bytes_, has_m_, 2, wrow, row_bytes, nb, xt, cx, pf, res); break;         \
            default: tile_a1(TYPE, bytes_, has_m_, 1, wrow, row_bytes, nb, xt, cx, pf, res); break;        \
            }                                                                                                 \
            for (int i = 0; i < 4 && r + i < r1; i++)                                                         \
                for (int k = 0; k < n_tok; k++)                                                               \
                    out[(size_t)k * out_stride + r + i] = scale ? scale[k] * res[i * NT1_A + k] : res[i * NT1_A + k]; \
        }                                                                                                     \
        return;                                                                                               \
    }
#define MM_A_SCRATCH_FEW(nb) (n_tok <= NT1_A ? (size_t)n_tok * (nb) * sizeof(__m256i) : 0)
#else
#define MM_A_FEW(TYPE)
#define MM_A_SCRATCH_FEW(nb) 0
#endif

/* per-thread scratch of the tiled kernels (grown as needed, kept for the thread's life) */
static __thread void *tl_scratch;
static __thread size_t tl_scratch_cap;
static void *scratch(size_t n) {
    if (n > tl_scratch_cap) {
        free(tl_scratch);
        n = (n + 4095) / 4096 * 4096;
        tl_scratch = aligned_alloc(64, n);
        tl_scratch_cap = tl_scratch ? n : 0;
    }
    return tl_scratch;
}

#define TILE_A_CASE(TB)                                                                                       \
    case TB: tile_a(unpack_, bytes_, has_m_, TB, wrow, row_bytes, nb, many ? prep : NULL, xt, pf && !many, res); break;
#if TB_A == 8
#define TILE_A_CASES_HI TILE_A_CASE(8) TILE_A_CASE(7) TILE_A_CASE(6) TILE_A_CASE(5)
#else
#define TILE_A_CASES_HI
#endif

#define DEFINE_MM_A_TILED(NAME, TYPE, UNPACK, BYTES, HAS_M, UNPACKED)                                               \
    static void NAME(MM_ARGS) {                                                                               \
        const int nb = n_cols / QK;                                                                           \
        const int many = n_tok > TB_A; /* several token tiles: the group's blocks are prepared once */       \
        void (*const unpack_)(const uint8_t *, ublk_a *) = UNPACK;                                            \
        const int bytes_ = BYTES, has_m_ = HAS_M;                                                             \
        const size_t need = (many ? (size_t)NV_A * nb * sizeof(wprep_a) : 0) + MM_A_SCRATCH_FEW(nb);          \
        uint8_t *sc = need ? (uint8_t *)scratch(need) : NULL;                                                 \
        if (need && !sc) { UNPACKED(W, row_bytes, r0, r1, n_cols, xq, n_tok, out, out_stride, scale); return; } \
        wprep_a *prep = (wprep_a *)sc;                                                                        \
        MM_A_FEW(TYPE)                                                                                        \
        float res[RG_A * TB_A];                                                                               \
        for (int r = r0; r < r1; r += RG_A) {                                                                 \
            const uint8_t *wrow[RG_A];                                                                        \
            for (int i = 0; i < RG_A; i++) wrow[i] = W + (size_t)(r + i < r1 ? r + i : r1 - 1) * row_bytes;    \
            const int pf = r + 2 * RG_A <= r1;                                                                \
            if (many)                                                                                         \
                for (int v = 0; v < NV_A; v++)                                                                \
                    for (int b = 0; b < nb; b++) {                                                            \
                        ublk_a u[VR_A];                                                                       \
                        for (int j = 0; j < VR_A; j++) {                                                      \
                            const uint8_t *blk = wrow[v * VR_A + j] + (size_t)b * (BYTES);                    \
                            if (pf)                                                                           \
                                for (int l = 0; l < (BYTES); l += 64)                                         \
                                    _mm_prefetch((const char *)blk + RG_A * row_bytes + l, _MM_HINT_T0);      \
                            UNPACK(blk, &u[j]);                                                               \
                        }                                                                                     \
                        wprep_make(u, &prep[(size_t)v * nb + b]);                                             \
                    }                                                                                         \
            for (int t0 = 0; t0 < n_tok; t0 += TB_A) {                                                        \
                const int nt = n_tok - t0 < TB_A ? n_tok - t0 : TB_A;                                         \
                const act_q8_0 *xt[TB_A];                                                                     \
                for (int k = 0; k < nt; k++) xt[k] = (const act_q8_0 *)xq[t0 + k];                           \
                switch (nt) {                                                                                 \
                    TILE_A_CASES_HI TILE_A_CASE(4) TILE_A_CASE(3) TILE_A_CASE(2) default: TILE_A_CASE(1)      \
                }                                                                                             \
                for (int i = 0; i < RG_A && r + i < r1; i++)                                                  \
                    for (int k = 0; k < nt; k++)                                                              \
                        out[(size_t)(t0 + k) * out_stride + r + i] =                                          \
                            scale ? scale[t0 + k] * res[i * TB_A + k] : res[i * TB_A + k];                    \
            }                                                                                                 \
        }                                                                                                     \
    }
DEFINE_MM_A_TILED(mm_q4_0_tiled, T_Q4_0, unpack_q4_0, 18, 0, mm_q4_0)
DEFINE_MM_A_TILED(mm_q4_1_tiled, T_Q4_1, unpack_q4_1, 20, 1, mm_q4_1)
DEFINE_MM_A_TILED(mm_q5_0_tiled, T_Q5_0, unpack_q5_0, 22, 0, mm_q5_0)
DEFINE_MM_A_TILED(mm_q5_1_tiled, T_Q5_1, unpack_q5_1, 24, 1, mm_q5_1)
DEFINE_MM_A_TILED(mm_q8_0_tiled, T_Q8_0, unpack_q8_0, 34, 0, mm_q8_0)
DEFINE_MM_A_TILED(mm_iq4_nl_tiled, T_IQ4_NL, unpack_iq4_nl, 18, 0, mm_iq4_nl)
DEFINE_MM_A_TILED(mm_mxfp4_tiled, T_MXFP4, unpack_mxfp4, 17, 0, mm_mxfp4)
#endif

#if defined(MS_ISA_AVX512)
/* Family B, several tokens (AVX512): Q4_K, Q5_K and Q6_K super-blocks prepared once per row and tile of up to TB_B
 * tokens (codes, scale lanes and the d / dmin pair in registers), then met by each token of the tile. The 8 chunks
 * of 32 codes go in pairs (2j, 2j + 1), one per 512-bit vector, against the token's 64 contiguous codes; the pair
 * sums are the unpack path's int16 lanes (Q4_K / Q5_K: maddubs of the unsigned codes; Q6_K: maddubs(|q - 32|, x
 * negated where q - 32 < 0), as mm_q6_k_fused's tile: x is in -127..127, so negation is exact), and dpwssd adds
 * them times the scales into int32 lanes; the two 256-bit halves (even and odd chunks) added give each of the 8
 * int32 lanes of dot_b exactly (integers, no overflow). Then per token and block the unpack path's float operations:
 * v += (d * d_x) * cvt(lanes), m += (dmin * d_x) * cvt(madd(mins, bsum)) as one 512-bit fmadd on [v | m] lanes, and
 * at the end hsum(v) - hsum(m): the same bits (benchmarks/gemm_b_ab.py checks them against the previous kernels). */
#define TB_B 8 /* tokens per tile */
#define RCH_B 32 /* rows per chunk: each chunk's blocks meet every tile of tokens while they are in L2 */
typedef struct {
    __m512i w[4];      /* chunk pairs: unsigned codes (Q4_K, Q5_K) or |q - 32| (Q6_K) */
    __mmask64 neg[4];  /* Q6_K: the lanes where q - 32 < 0 */
    __m512i sc[4];     /* int16 scale lanes of each pair */
    __m512 dd;         /* [d x 8 | dmin x 8] */
    __m256i mn;        /* int16 mins, each twice (as bsum's 16 groups) */
} bprep;

MS_AI __m512i cat256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

MS_AI void bprep_make(int type, const uint8_t *blk, bprep *p) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == T_Q6_K) {
        const __m128i scb = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m512i m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
        for (int n = 0; n < 2; n++) {
            const __m512i L = _mm512_loadu_si512((const void *)(blk + 64 * n));
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            for (int h = 0; h < 2; h++) { /* pair (4n + 2h, 4n + 2h + 1): L's nibble h, H's bits 4h + (0 | 2) */
                const __m512i lo = _mm512_and_si512(h ? _mm512_srli_epi16(L, 4) : L, m4);
                const __m512i hb = _mm512_and_si512(
                    _mm512_srlv_epi64(H, _mm512_set_epi64(4 * h + 2, 4 * h + 2, 4 * h + 2, 4 * h + 2, 4 * h, 4 * h,
                                                          4 * h, 4 * h)), m3);
                const __m512i w = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hb, 4)), k32);
                const int j = 2 * n + h, c = 2 * j;
                p->w[j] = _mm512_abs_epi8(w);
                p->neg[j] = _mm512_movepi8_mask(w);
                p->sc[j] = cat256(
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scb, _mm_loadu_si128((const __m128i *)Q6K_SCALE_SHUF[c]))),
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scb, _mm_loadu_si128((const __m128i *)Q6K_SCALE_SHUF[c + 1]))));
            }
        }
        p->dd = _mm512_set1_ps(rdh(blk + 208));
        return;
    }
    const __m128i sm = q4k_scales(blk + 4);
    const __m256i smv = _mm256_broadcastsi128_si256(sm);
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    const __m512i qh = type == T_Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                                      : _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m512i w = _mm512_and_si512(cat256(v, _mm256_srli_epi16(v, 4)), m4);
        if (type == T_Q5_K) /* bit 2j of qh for the low chunk, 2j + 1 for the high one: code + 16 */
            w = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(qh, cat256(_mm256_set1_epi8((char)(1 << (2 * j))),
                                                                        _mm256_set1_epi8((char)(1 << (2 * j + 1))))),
                                     w, _mm512_set1_epi8(16));
        p->w[j] = w;
        p->sc[j] = cat256(_mm256_shuffle_epi8(smv, _mm256_set1_epi16((short)(0x8000 | (2 * j)))),
                          _mm256_shuffle_epi8(smv, _mm256_set1_epi16((short)(0x8000 | (2 * j + 1)))));
    }
    const __m128i m8 = _mm_unpackhi_epi64(sm, sm);
    p->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    p->dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(rdh(blk)), _mm512_set1_ps(rdh(blk + 2)));
}

/* one row's blocks against tokens xt[0..TB): res[k] */
MS_AI void tile_b(int type, int bytes, int TB, const uint8_t *wr, size_t row_bytes, int nb,
                  const act_q8_k *const *xt, int pf, float *res) {
    __m512 acc[TB_B];
    for (int k = 0; k < TB; k++) acc[k] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wr + (size_t)b * bytes;
        PF_BLOCK(blk, bytes);
        bprep p;
        bprep_make(type, blk, &p);
        for (int k = 0; k < TB; k++) {
            const act_q8_k *x = xt[k] + b;
            __m512i is = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x->q + 64 * j));
                if (type == T_Q6_K) xv = _mm512_mask_sub_epi8(xv, p.neg[j], _mm512_setzero_si512(), xv);
                is = _mm512_dpwssd_epi32(is, _mm512_maddubs_epi16(p.w[j], xv), p.sc[j]);
            }
            const __m256i lanes = _mm256_add_epi32(_mm512_castsi512_si256(is), _mm512_extracti64x4_epi64(is, 1));
            const __m256i mins = type == T_Q6_K ? _mm256_setzero_si256()
                                                : _mm256_madd_epi16(p.mn, _mm256_loadu_si256((const __m256i *)x->bsum));
            const __m512 f = _mm512_mul_ps(p.dd, _mm512_set1_ps(x->d)), l = _mm512_cvtepi32_ps(cat256(lanes, mins));
            /* Q6_K has no mins: its m lanes stay +0, as the unpack path's m (no operation on them) */
            acc[k] = type == T_Q6_K ? _mm512_mask3_fmadd_ps(f, l, acc[k], 0x00FF) : _mm512_fmadd_ps(f, l, acc[k]);
        }
    }
    for (int k = 0; k < TB; k++)
        res[k] = hsum_ps(_mm512_castps512_ps256(acc[k])) -
                 hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[k]), 1)));
}

#define TILE_B_CASE(TB) case TB: tile_b(type_, bytes_, TB, wr, row_bytes, nb, xt, pf && t0 == 0, res); break;
#define DEFINE_MM_B_TILED(NAME, TYPE, BYTES, ONE, MIN_TOK)                                                           \
    static void NAME(MM_ARGS) {                                                                               \
        if (n_tok < (MIN_TOK)) { ONE(W, row_bytes, r0, r1, n_cols, xq, n_tok, out, out_stride, scale); return; } \
        const int nb = n_cols / QKK, type_ = TYPE, bytes_ = BYTES;                                            \
        float res[TB_B];                                                                                      \
        for (int rc = r0; rc < r1; rc += RCH_B) { /* a chunk of rows (in L2) against each tile of tokens (in L1) */ \
            const int rc1 = rc + RCH_B < r1 ? rc + RCH_B : r1;                                                \
            for (int t0 = 0; t0 < n_tok; t0 += TB_B) {                                                        \
                const int nt = n_tok - t0 < TB_B ? n_tok - t0 : TB_B;                                         \
                const act_q8_k *xt[TB_B];                                                                     \
                for (int k = 0; k < nt; k++) xt[k] = (const act_q8_k *)xq[t0 + k];                            \
                for (int r = rc; r < rc1; r++) {                                                              \
                    const uint8_t *wr = W + (size_t)r * row_bytes;                                            \
                    const int pf = r + PF_ROWS < r1;                                                          \
                    switch (nt) {                                                                             \
                        TILE_B_CASE(8) TILE_B_CASE(7) TILE_B_CASE(6) TILE_B_CASE(5) TILE_B_CASE(4)            \
                        TILE_B_CASE(3) TILE_B_CASE(2) default: TILE_B_CASE(1)                                 \
                    }                                                                                         \
                    for (int k = 0; k < nt; k++)                                                              \
                        out[(size_t)(t0 + k) * out_stride + r] = scale ? scale[t0 + k] * res[k] : res[k];     \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
#ifndef MIN_TOK_B
#define MIN_TOK_B 2 /* Q4_K, Q6_K: fewer tokens take the one-token fused kernels */
#endif
DEFINE_MM_B_TILED(mm_q4_k_tiled, T_Q4_K, 144, mm_q4_k_fused, MIN_TOK_B)
DEFINE_MM_B_TILED(mm_q5_k_tiled, T_Q5_K, 176, mm_q5_k, 1)
DEFINE_MM_B_TILED(mm_q6_k_tiled, T_Q6_K, 210, mm_q6_k_fused, MIN_TOK_B)
#endif

#include "iquants.h" /* unpackers and tile kernels of the 1-3 bit i-quants and the ternary types */

typedef struct {
    int family;
    int block;       /* elements per block */
    int block_bytes; /* bytes per block */
    mm_fn mm;
} type_info;

/* MS_NO_FUSED=1 in the environment selects the unpack path for every type (tests: fused == unpacked, bitwise) */
static int no_fused(void) {
    static int v = -1;
    if (v < 0) v = getenv("MS_NO_FUSED") != NULL;
    return v;
}

#if defined(MS_ISA_AVX512)
#define MM_B_TILED(name) name##_tiled
#else
#define MM_B_TILED(name) name##_fused
#endif
static int type_of(int t, type_info *ti) {
    switch (t) {
#ifdef MS_X86_SIMD
    case T_F32: *ti = (type_info){FAM_C, QK, 128, no_fused() ? mm_f32 : mm_f32_fused}; return 1;
#else
    case T_F32: *ti = (type_info){FAM_C, QK, 128, mm_f32}; return 1;
#endif
#ifdef MS_X86_SIMD
    case T_F16: *ti = (type_info){FAM_C, QK, 64, no_fused() ? mm_f16 : mm_f16_fused}; return 1;
    case T_BF16: *ti = (type_info){FAM_C, QK, 64, no_fused() ? mm_bf16 : mm_bf16_fused}; return 1;
#else
    case T_F16: *ti = (type_info){FAM_C, QK, 64, mm_f16}; return 1;
    case T_BF16: *ti = (type_info){FAM_C, QK, 64, mm_bf16}; return 1;
#endif
#ifdef MS_X86_SIMD
    case T_Q4_0: *ti = (type_info){FAM_A, QK, 18, no_fused() ? mm_q4_0 : mm_q4_0_tiled}; return 1;
    case T_Q4_1: *ti = (type_info){FAM_A, QK, 20, no_fused() ? mm_q4_1 : mm_q4_1_tiled}; return 1;
    case T_Q5_0: *ti = (type_info){FAM_A, QK, 22, no_fused() ? mm_q5_0 : mm_q5_0_tiled}; return 1;
    case T_Q5_1: *ti = (type_info){FAM_A, QK, 24, no_fused() ? mm_q5_1 : mm_q5_1_tiled}; return 1;
    case T_Q8_0: *ti = (type_info){FAM_A, QK, 34, no_fused() ? mm_q8_0 : mm_q8_0_tiled}; return 1;
    case T_IQ4_NL: *ti = (type_info){FAM_A, QK, 18, no_fused() ? mm_iq4_nl : mm_iq4_nl_tiled}; return 1;
    case T_MXFP4: *ti = (type_info){FAM_A, QK, 17, no_fused() ? mm_mxfp4 : mm_mxfp4_tiled}; return 1;
#else
    case T_Q4_0: *ti = (type_info){FAM_A, QK, 18, mm_q4_0}; return 1;
    case T_Q4_1: *ti = (type_info){FAM_A, QK, 20, mm_q4_1}; return 1;
    case T_Q5_0: *ti = (type_info){FAM_A, QK, 22, mm_q5_0}; return 1;
    case T_Q5_1: *ti = (type_info){FAM_A, QK, 24, mm_q5_1}; return 1;
    case T_Q8_0: *ti = (type_info){FAM_A, QK, 34, mm_q8_0}; return 1;
    case T_IQ4_NL: *ti = (type_info){FAM_A, QK, 18, mm_iq4_nl}; return 1;
    case T_MXFP4: *ti = (type_info){FAM_A, QK, 17, mm_mxfp4}; return 1;
#endif
    case T_Q2_K: *ti = (type_info){FAM_B, QKK, 84, mm_q2_k}; return 1;
    case T_Q3_K: *ti = (type_info){FAM_B, QKK, 110, mm_q3_k}; return 1;
#ifdef MS_X86_SIMD
    case T_Q4_K: *ti = (type_info){FAM_B, QKK, 144, no_fused() ? mm_q4_k : MM_B_TILED(mm_q4_k)}; return 1;
#else
    case T_Q4_K: *ti = (type_info){FAM_B, QKK, 144, mm_q4_k}; return 1;
#endif
#if defined(MS_ISA_AVX512)
    case T_Q5_K: *ti = (type_info){FAM_B, QKK, 176, no_fused() ? mm_q5_k : mm_q5_k_tiled}; return 1;
#else
    case T_Q5_K: *ti = (type_info){FAM_B, QKK, 176, mm_q5_k}; return 1;
#endif
#ifdef MS_X86_SIMD
    case T_Q6_K: *ti = (type_info){FAM_B, QKK, 210, no_fused() ? mm_q6_k : MM_B_TILED(mm_q6_k)}; return 1;
#else
    case T_Q6_K: *ti = (type_info){FAM_B, QKK, 210, mm_q6_k}; return 1;
#endif
    case T_IQ4_XS: *ti = (type_info){FAM_B, QKK, 136, mm_iq4_xs}; return 1;
    default: {
        int fam = 0, block = 0, bytes = 0;
        mm_fn f = iquant_mm(t, &fam, &block, &bytes);
        if (!f) return 0;
        *ti = (type_info){fam, block, bytes, f};
        return 1;
    }
    }
}

/* ------------------------------------------------------------------------------------------------------ */
/* thread pool: one job at a time; idle workers spin briefly on the job generation, then sleep on a         */
/* condition variable. Items are claimed with an atomic counter, so a thread the OS does not schedule      */
/* delays only the item it holds. Joining a job takes no lock: a worker registers (refs), then claims one   */
/* of the job's helper places by a compare-and-swap on a word tagged with the job's generation; the caller  */
/* closes the job (the word's places to 0) and waits for the registered workers. A decode step runs a few  */
/* hundred jobs per token: with a mutex per join, 15 workers queued on it for every job at 16 threads.     */

typedef void (*task_fn)(void *ctx, int item);

static struct {
    pthread_mutex_t mu;     /* sleeping workers only */
    pthread_cond_t cv;
    pthread_mutex_t run_mu; /* one job at a time */
    pthread_t th[MAX_THREADS];
    int n_workers;
    int sleepers;           /* under mu */
    /* the current job: written by the caller before the generation is published */
    task_fn fn;
    void *ctx;
    int n_items;
    atomic_int next;
    atomic_ulong gen;       /* the job's generation; a worker that sees it change looks for the job */
    atomic_ulong places;    /* (generation << 16) | helper places left; 0 places: closed */
    atomic_int refs;        /* workers registered inside the join protocol */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

static void job_work(void) {
    const task_fn fn = P.fn;
    void *ctx = P.ctx;
    const int n = P.n_items;
    for (;;) {
        int i = atomic_fetch_add(&P.next, 1);
        if (i >= n) break;
        fn(ctx, i);
    }
}

static inline void cpu_relax(void) {
#ifdef MS_X86_SIMD
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* How long an idle worker waits for the next job before it sleeps (MS_SPIN_US, microseconds, default 1000): a
 * decode step's matmuls come every few tens to hundreds of microseconds, and waking a sleeping thread costs
 * several microseconds per thread. While it waits it yields the CPU (sched_yield) after a short pause loop, so a
 * runnable thread -- an expert read, another job -- gets the core instead of a spinning worker. */
static long spin_us(void) {
    static long v = -1;
    if (v < 0) { const char *e = getenv("MS_SPIN_US"); v = e ? atol(e) : 1000; }
    return v;
}

static inline double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int wait_for_job(unsigned long seen) {
    const long budget = spin_us();
    if (budget <= 0) return 0;
    for (int s = 0; s < 200; s++) {
        if (atomic_load_explicit(&P.gen, memory_order_acquire) != seen) return 1;
        cpu_relax();
    }
    const double end = now_us() + (double)budget;
    while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen) {
        sched_yield();
        for (int s = 0; s < 20; s++) cpu_relax();
        if (now_us() > end) return 0;
    }
    return 1;
}

/* A worker's join of job generation g: registered first (refs), then one helper place taken if the job is still
 * g's and open. The caller closes the job (places 0) before it waits for refs to reach 0, both sequentially
 * consistent: a worker either registered before the caller read refs (and is waited for) or finds the job closed
 * or replaced (and touches nothing of it). The successful compare-and-swap acquires the caller's release of
 * places, after which the job's fields were written. */
static void join_job(unsigned long g) {
    atomic_fetch_add(&P.refs, 1);
    unsigned long v = atomic_load(&P.places);
    while ((v >> 16) == g && (v & 0xFFFF) > 0) {
        if (atomic_compare_exchange_weak(&P.places, &v, v - 1)) {
            job_work();
            break;
        }
    }
    atomic_fetch_sub_explicit(&P.refs, 1, memory_order_release);
}

static void *worker_main(void *arg) {
    (void)arg;
    unsigned long seen = atomic_load(&P.gen);
    for (;;) {
        if (!wait_for_job(seen)) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.gen) == seen) {
                P.sleepers++;
                pthread_cond_wait(&P.cv, &P.mu);
                P.sleepers--;
            }
            pthread_mutex_unlock(&P.mu);
        }
        seen = atomic_load(&P.gen);
        join_job(seen);
    }
    return NULL;
}

static void pool_run(int n_threads, task_fn fn, void *ctx, int n_items) {
    if (n_items <= 0) return;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads <= 1 || n_items == 1) {
        for (int i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&P.run_mu);
    while (P.n_workers < n_threads - 1) {
        if (pthread_create(&P.th[P.n_workers], NULL, worker_main, NULL) != 0) break;
        pthread_detach(P.th[P.n_workers]);
        P.n_workers++;
    }
    const int helpers = n_threads - 1 < n_items - 1 ? n_threads - 1 : n_items - 1;
    P.fn = fn; P.ctx = ctx; P.n_items = n_items;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    const unsigned long g = atomic_load_explicit(&P.gen, memory_order_relaxed) + 1;
    atomic_store(&P.places, (g << 16) | (unsigned long)(helpers > 0xFFFF ? 0xFFFF : helpers));
    atomic_store(&P.gen, g);
    pthread_mutex_lock(&P.mu); /* after the generation: a worker that checked it under mu is asleep by now */
    if (P.sleepers) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    job_work();
    atomic_store(&P.places, g << 16); /* closed: late workers take no place */
    for (int s = 0; atomic_load(&P.refs) > 0; s++) {
        if (s > 4000) sched_yield(); else cpu_relax();
    }
    pthread_mutex_unlock(&P.run_mu);
}

/* The pool for the step kernels (stepkern.c, linked into the same library). */
void ms_pool_run(int n_threads, task_fn fn, void *ctx, int n_items) { pool_run(n_threads, fn, ctx, n_items); }

/* ------------------------------------------------------------------------------------------------------ */
/* public API                                                                                              */

/* The build's ISA: 2 = AVX512 (F, BW, VL, VNNI), 1 = AVX2+FMA+F16C, 0 = portable. */
int ms_isa(void) {
#if defined(MS_ISA_AVX512)
    return 2;
#elif defined(MS_ISA_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Elements per block and bytes per block of ggml type t; 0 if the kernels cannot compute t. */
int ms_block_size(int t) { type_info ti; return type_of(t, &ti) ? ti.block : 0; }
int ms_block_bytes(int t) { type_info ti; return type_of(t, &ti) ? ti.block_bytes : 0; }

/* Hand in the i-quant code books (format data from the gguf package): name 0..6 as listed. */
void ms_set_table(int which, const uint8_t *p) {
    switch (which) {
    case 0: G_IQ2XXS = p; break;
    case 1: G_IQ2XS = p; break;
    case 2: G_IQ2S = p; break;
    case 3: G_IQ3XXS = p; break;
    case 4: G_IQ3S = p; break;
    case 5: G_IQ1S = p; break;
    case 6: G_KSIGNS = p; break;
    default: break;
    }
}

/* Quantize n_rows float rows of n_cols to the activation format of weight type t (tests' use). */
size_t ms_act_row_bytes(int t, int n_cols) { type_info ti; return type_of(t, &ti) ? act_row_bytes(ti.family, n_cols) : 0; }
void ms_quantize_rows(int t, const float *x, int n_rows, int n_cols, uint8_t *out) {
    type_info ti;
    if (!type_of(t, &ti)) return;
    size_t rb = act_row_bytes(ti.family, n_cols);
    for (int r = 0; r < n_rows; r++) quantize_row(ti.family, x + (size_t)r * n_cols, out + rb * r, n_cols);
}

typedef struct {
    int t; type_info ti;
    const uint8_t *W; size_t row_bytes; int n_rows, n_cols;
    const uint8_t *const *xq; int n_tok;
    float *y; int rows_per_item;
} linear_ctx;

static void linear_item(void *c, int item) {
    linear_ctx *L = (linear_ctx *)c;
    int r0 = item * L->rows_per_item, r1 = r0 + L->rows_per_item;
    if (r1 > L->n_rows) r1 = L->n_rows;
    L->ti.mm(L->W, L->row_bytes, r0, r1, L->n_cols, L->xq, L->n_tok, L->y, (size_t)L->n_rows, NULL);
}

typedef struct { int fam; const float *x; uint8_t *xq; size_t rb; int n_cols; } quant_ctx;
static void quant_item(void *c, int item) {
    quant_ctx *Q = (quant_ctx *)c;
    quantize_row(Q->fam, Q->x + (size_t)item * Q->n_cols, Q->xq + Q->rb * item, Q->n_cols);
}

static int rows_per_item(int n_rows, int n_threads, int n_tok) {
    /* enough items to balance threads (8 per thread), at least 4 rows, fewer rows for long token tiles */
    int per = n_rows / (8 * (n_threads > 0 ? n_threads : 1));
    int cap = n_tok >= 16 ? 16 : 256;
    if (per > cap) per = cap;
    if (per < 4) per = 4;
    return per;
}

/* y[n_tok, n_rows] = x[n_tok, n_cols] . W^T with W = n_rows rows of row_bytes bytes of ggml type t.
 * Returns 0, or -1 for a type the kernels cannot compute / n_cols not a multiple of its block, -2 out of memory. */
int ms_linear(int t, const uint8_t *W, size_t row_bytes, int n_rows, int n_cols, const float *x, int n_tok,
              float *y, int n_threads) {
    type_info ti;
    if (!type_of(t, &ti) || n_cols % ti.block) return -1;
    if (n_tok <= 0 || n_rows <= 0) return 0;
    const size_t rb = act_row_bytes(ti.family, n_cols);
    uint8_t *xq = NULL;
    const uint8_t **rows = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)n_tok);
    if (!rows) return -2;
    if (ti.family == FAM_C && t == T_F32) {
        for (int k = 0; k < n_tok; k++) rows[k] = (const uint8_t *)(x + (size_t)k * n_cols);
    } else {
        xq = (uint8_t *)aligned_alloc(64, ((rb * (size_t)n_tok) + 63) / 64 * 64);
        if (!xq) { free(rows); return -2; }
        quant_ctx Q = {ti.family, x, xq, rb, n_cols};
        pool_run(n_tok >= 4 ? n_threads : 1, quant_item, &Q, n_tok);
        for (int k = 0; k < n_tok; k++) rows[k] = xq + rb * k;
    }
    linear_ctx L = {t, ti, W, row_bytes, n_rows, n_cols, rows, n_tok, y, rows_per_item(n_rows, n_threads, n_tok)};
    pool_run(n_threads, linear_item, &L, (n_rows + L.rows_per_item - 1) / L.rows_per_item);
    free(xq);
    free(rows);
    return 0;
}

/* --- the routed experts of one MoE layer in one call ------------------------------------------------------
 *
 * n_groups experts; group g's matrices start at gate[g], up[g], down[g] (for a merged gate_up tensor, up[g]
 * is gate[g] + n_ff rows). Its pairs are pair_tok[pair_start[g] .. pair_start[g+1]) (token rows of x) with
 * routing weights pair_w[...] and output rows pair_out[...] of y (each y row written by exactly one pair).
 * y[pair_out[p], :] = pair_w[p] * down(act(gate(x[pair_tok[p]]), up(x[pair_tok[p]]))).
 * act: 0 = SiLU(gate) * up, 1 = GELU-tanh(gate) * up, 2 = ggml's swiglu_oai (GPT-OSS, below).
 *
 * Optional per-expert biases: bias_gate / bias_up float32 [n_experts, n_ff], bias_down float32 [n_experts, n_embd]
 * (each NULL: none), rows indexed by the group's REAL expert id real[g] (int64 [n_groups]; the weight addresses
 * may be slots, the biases are not). A bias is one float32 add per output element after its dot product, as
 * torch's ``y + b``; with a down bias the routing weight multiplies the biased row, (dot + b) * w, as llama.cpp's
 * build_moe_ffn (ggml_add_id, then ggml_mul by the weights) and the eager per-expert path compute it.
 */

typedef struct {
    int t_gu, t_down; type_info ti_gu, ti_down;
    const uint8_t *const *gate, *const *up, *const *down;
    size_t rb_gu, rb_down; /* weight row bytes */
    int n_embd, n_ff, act;
    const float *b_gate, *b_up, *b_down; const int64_t *real; /* per-expert biases by real id (or NULL) */
    const int *pair_start, *pair_tok, *pair_out; const float *pair_w;
    const uint8_t **x_rows;   /* per pair: its token's quantized x row */
    const uint8_t **h_rows;   /* per pair: its quantized hidden row */
    float *G, *U;             /* [n_pairs, n_ff] gate / up outputs */
    uint8_t *hq; size_t rb_h; /* quantized hidden rows */
    float *y;
    int items_per_group_gu, rows_gu, items_per_group_down, rows_down;
} moe_ctx;

static void moe_gu_item(void *c, int item) {
    moe_ctx *M = (moe_ctx *)c;
    int g = item / M->items_per_group_gu, part = item % M->items_per_group_gu;
    int p0 = M->pair_start[g], np = M->pair_start[g + 1] - p0;
    if (np <= 0) return;
    /* parts alternate gate / up over row chunks */
    int which = part & 1, chunk = part >> 1;
    int r0 = chunk * M->rows_gu, r1 = r0 + M->rows_gu;
    if (r1 > M->n_ff) r1 = M->n_ff;
    if (r0 >= r1) return;
    const uint8_t *W = which ? M->up[g] : M->gate[g];
    float *out = (which ? M->U : M->G) + (size_t)p0 * M->n_ff;
    M->ti_gu.mm(W, M->rb_gu, r0, r1, M->n_embd, M->x_rows + p0, np, out, (size_t)M->n_ff, NULL);
    const float *bias = which ? M->b_up : M->b_gate;
    if (bias) {
        const float *b = bias + (size_t)M->real[g] * M->n_ff;
        for (int k = 0; k < np; k++) {
            float *o = out + (size_t)k * M->n_ff;
            for (int r = r0; r < r1; r++) o[r] = o[r] + b[r];
        }
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }
static inline float gelu_tanh(float v) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}

/* ggml's swiglu_oai (ggml-cpu ops.cpp ggml_compute_forward_swiglu_oai_f32), GPT-OSS's expert activation with
 * llama.cpp's constants (llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE; transformers' swiglu_alpha / swiglu_limit):
 * x = min(gate, limit) (std::min: NaN stays NaN), y = clamp(up, -limit, limit), x / (1 + expf(alpha * -x)) * (y + 1),
 * each operation rounded to float32 on its own. */
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f
static inline float swiglu_oai(float g, float u) {
    const float x = SWIGLU_OAI_LIMIT < g ? SWIGLU_OAI_LIMIT : g;
    const float y = u < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : (SWIGLU_OAI_LIMIT < u ? SWIGLU_OAI_LIMIT : u);
    const float glu = x / (1.0f + expf(SWIGLU_OAI_ALPHA * (-x)));
    return glu * (y + 1.0f);
}

static void moe_act_item(void *c, int p) {
    moe_ctx *M = (moe_ctx *)c;
    float *g = M->G + (size_t)p * M->n_ff;
    const float *u = M->U + (size_t)p * M->n_ff;
    if (M->act == 2) for (int i = 0; i < M->n_ff; i++) g[i] = swiglu_oai(g[i], u[i]);
    else if (M->act == 1) for (int i = 0; i < M->n_ff; i++) g[i] = gelu_tanh(g[i]) * u[i];
    else for (int i = 0; i < M->n_ff; i++) g[i] = silu(g[i]) * u[i];
    if (M->ti_down.family == FAM_C && M->t_down == T_F32) M->h_rows[p] = (const uint8_t *)g;
    else {
        quantize_row(M->ti_down.family, g, M->hq + M->rb_h * p, M->n_ff);
        M->h_rows[p] = M->hq + M->rb_h * p;
    }
}

static void moe_down_item(void *c, int item) {
    moe_ctx *M = (moe_ctx *)c;
    int g = item / M->items_per_group_down, chunk = item % M->items_per_group_down;
    int p0 = M->pair_start[g], np = M->pair_start[g + 1] - p0;
    if (np <= 0) return;
    int r0 = chunk * M->rows_down, r1 = r0 + M->rows_down;
    if (r1 > M->n_embd) r1 = M->n_embd;
    if (r0 >= r1) return;
    /* each pair has its own output row: write through a per-pair tile of one token. With a down bias the dot
     * products come unscaled, then (dot + b) * w per element. */
    const float *bias = M->b_down ? M->b_down + (size_t)M->real[g] * M->n_embd : NULL;
    for (int p = p0; p < p0 + np; p += TOK_TILE) {
        int n = p0 + np - p < TOK_TILE ? p0 + np - p : TOK_TILE;
        float tmp[TOK_TILE * 64];
        const int span = r1 - r0;
        if (span <= 64) {
            /* compute into tmp[k * span + (r - r0)] then scatter to the pairs' output rows */
            M->ti_down.mm(M->down[g] + (size_t)r0 * M->rb_down, M->rb_down, 0, span, M->n_ff,
                    M->h_rows + p, n, tmp, (size_t)span, bias ? NULL : M->pair_w + p);
            for (int k = 0; k < n; k++) {
                float *dst = M->y + (size_t)M->pair_out[p + k] * M->n_embd + r0;
                const float *src = tmp + (size_t)k * span;
                if (bias) {
                    const float w = M->pair_w[p + k];
                    for (int r = 0; r < span; r++) dst[r] = (src[r] + bias[r0 + r]) * w;
                } else {
                    memcpy(dst, src, sizeof(float) * (size_t)span);
                }
            }
        } else {
            for (int k = 0; k < n; k++) {
                float *row = M->y + (size_t)M->pair_out[p + k] * M->n_embd;
                M->ti_down.mm(M->down[g], M->rb_down, r0, r1, M->n_ff, M->h_rows + p + k, 1, row, 0,
                              bias ? NULL : M->pair_w + p + k);
                if (bias) {
                    const float w = M->pair_w[p + k];
                    for (int r = r0; r < r1; r++) row[r] = (row[r] + bias[r]) * w;
                }
            }
        }
    }
}

int ms_moe(int t_gu, int t_down, const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
           size_t rb_gu, size_t rb_down, int n_embd, int n_ff, int act,
           const float *bias_gate, const float *bias_up, const float *bias_down, const int64_t *real,
           int n_groups, const int *pair_start, const int *pair_tok, const float *pair_w, const int *pair_out,
           const float *x, int n_tok, float *y, int n_threads) {
    moe_ctx M;
    memset(&M, 0, sizeof M);
    if (!type_of(t_gu, &M.ti_gu) || !type_of(t_down, &M.ti_down)) return -1;
    if (act < 0 || act > 2 || ((bias_gate || bias_up || bias_down) && !real)) return -1;
    M.b_gate = bias_gate; M.b_up = bias_up; M.b_down = bias_down; M.real = real;
    if (n_embd % M.ti_gu.block || n_ff % M.ti_down.block) return -1;
    const int n_pairs = pair_start[n_groups];
    if (n_pairs <= 0) return 0;
    M.t_gu = t_gu; M.t_down = t_down; M.gate = gate; M.up = up; M.down = down;
    M.rb_gu = rb_gu; M.rb_down = rb_down; M.n_embd = n_embd; M.n_ff = n_ff; M.act = act;
    M.pair_start = pair_start; M.pair_tok = pair_tok; M.pair_out = pair_out; M.pair_w = pair_w; M.y = y;

    const size_t rbx = act_row_bytes(M.ti_gu.family, n_embd);
    uint8_t *xq = NULL;
    M.x_rows = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)n_pairs);
    M.h_rows = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)n_pairs);
    M.G = (float *)malloc(sizeof(float) * (size_t)n_pairs * n_ff);
    M.U = (float *)malloc(sizeof(float) * (size_t)n_pairs * n_ff);
    M.rb_h = act_row_bytes(M.ti_down.family, n_ff);
    M.hq = (uint8_t *)malloc(M.rb_h * (size_t)n_pairs + 64);
    int rc = 0;
    if (!M.x_rows || !M.h_rows || !M.G || !M.U || !M.hq) { rc = -2; goto done; }
    if (M.ti_gu.family == FAM_C && t_gu == T_F32) {
        for (int p = 0; p < n_pairs; p++) M.x_rows[p] = (const uint8_t *)(x + (size_t)pair_tok[p] * n_embd);
    } else {
        xq = (uint8_t *)malloc(rbx * (size_t)n_tok + 64);
        if (!xq) { rc = -2; goto done; }
        quant_ctx Q = {M.ti_gu.family, x, xq, rbx, n_embd};
        pool_run(n_tok >= 4 ? n_threads : 1, quant_item, &Q, n_tok);
        for (int p = 0; p < n_pairs; p++) M.x_rows[p] = xq + rbx * pair_tok[p];
    }
    /* gate / up: items = groups x (2 matrices x row chunks) */
    int nth = n_threads > 0 ? n_threads : 1;
    int want = 8 * nth / (n_groups > 0 ? n_groups : 1); /* items per group for balance */
    if (want < 2) want = 2;
    int chunks = (want + 1) / 2;
    M.rows_gu = (n_ff + chunks - 1) / chunks;
    if (M.rows_gu < 4) M.rows_gu = 4;
    chunks = (n_ff + M.rows_gu - 1) / M.rows_gu;
    M.items_per_group_gu = 2 * chunks;
    pool_run(n_threads, moe_gu_item, &M, n_groups * M.items_per_group_gu);
    pool_run(n_pairs >= 4 ? n_threads : 1, moe_act_item, &M, n_pairs);
    int dchunks = 8 * nth / (n_groups > 0 ? n_groups : 1);
    if (dchunks < 1) dchunks = 1;
    M.rows_down = (n_embd + dchunks - 1) / dchunks;
    /* Groups of several pairs share each weight row across a tile of tokens through the 64-row tmp tile of
     * moe_down_item. With one pair per group (a decode step) there is no tile to share: each item streams its
     * rows straight into the pair's output row, and long items keep the prefetch running (64-row items left one
     * token's down projections at 22 GB/s on 2 threads of the 2-core EPYC, against 30 GB/s with whole halves;
     * which thread computes which rows changes no bit) */
    int max_np = 0;
    for (int g = 0; g < n_groups; g++)
        if (pair_start[g + 1] - pair_start[g] > max_np) max_np = pair_start[g + 1] - pair_start[g];
    if (max_np > 1 && M.rows_down > 64) M.rows_down = 64;
    if (M.rows_down < 4) M.rows_down = 4;
    M.items_per_group_down = (n_embd + M.rows_down - 1) / M.rows_down;
    pool_run(n_threads, moe_down_item, &M, n_groups * M.items_per_group_down);
done:
    free(xq); free(M.x_rows); free(M.h_rows); free(M.G); free(M.U); free(M.hq);
    return rc;
}

/* --- per-head linears: one call for every head of a batched per-head matmul -------------------------------
 *
 * y[t, h, :] = W_h . x[t, h, :] for every head h < n_heads and token t < n_tok, with W_h = W + h * head_bytes
 * (n_rows rows of row_bytes bytes of ggml type t, n_cols elements each): MLA's absorbed up-projections (deepseek2's
 * attn_k_b [H, r, nope] and attn_v_b [H, dv, r], whose heads are contiguous row ranges of the tensor).
 * x: float32, row (t, h) at x + t * xs_t + h * xs_h (elements; each row n_cols contiguous floats); y: float32, row
 * (t, h) at y + t * ys_t + h * ys_h (n_rows contiguous floats). Each activation row is quantized on its own and each
 * output element is one tile kernel's dot of one weight row and one activation row, exactly as ms_linear computes
 * it on W_h alone: the bits depend neither on n_heads, nor on n_tok, nor on the thread count.
 * Returns 0, or -1 for a type the kernels cannot compute / n_cols not a multiple of its block / negative strides,
 * -2 out of memory. */

typedef struct {
    type_info ti;
    const uint8_t *W; size_t head_bytes, row_bytes; int n_rows, n_cols;
    const uint8_t *const *xq; int n_tok; /* per head h: xq[h * n_tok + t] */
    float *y; size_t ys_t, ys_h;
    int rows_per_item, items_per_head;
} heads_ctx;

static void heads_item(void *c, int item) {
    heads_ctx *L = (heads_ctx *)c;
    const int h = item / L->items_per_head, part = item % L->items_per_head;
    int r0 = part * L->rows_per_item, r1 = r0 + L->rows_per_item;
    if (r1 > L->n_rows) r1 = L->n_rows;
    L->ti.mm(L->W + (size_t)h * L->head_bytes, L->row_bytes, r0, r1, L->n_cols, L->xq + (size_t)h * L->n_tok,
             L->n_tok, L->y + (size_t)h * L->ys_h, L->ys_t, NULL);
}

typedef struct { int fam; const float *x; long xs_t, xs_h; int n_tok, n_cols; uint8_t *xq; size_t rb; } heads_quant_ctx;
static void heads_quant_item(void *c, int item) { /* item = h * n_tok + t */
    heads_quant_ctx *Q = (heads_quant_ctx *)c;
    const int h = item / Q->n_tok, t = item % Q->n_tok;
    quantize_row(Q->fam, Q->x + (long)t * Q->xs_t + (long)h * Q->xs_h, Q->xq + Q->rb * item, Q->n_cols);
}

int ms_linear_heads(int t, const uint8_t *W, size_t head_bytes, size_t row_bytes, int n_rows, int n_cols,
                    int n_heads, const float *x, long xs_t, long xs_h, int n_tok, float *y, long ys_t, long ys_h,
                    int n_threads) {
    type_info ti;
    if (!type_of(t, &ti) || n_cols % ti.block || xs_t < 0 || xs_h < 0 || ys_t < 0 || ys_h < 0) return -1;
    if (n_tok <= 0 || n_rows <= 0 || n_heads <= 0) return 0;
    const size_t n = (size_t)n_tok * (size_t)n_heads, rb = act_row_bytes(ti.family, n_cols);
    uint8_t *xq = NULL;
    const uint8_t **rows = (const uint8_t **)malloc(sizeof(uint8_t *) * n);
    if (!rows) return -2;
    if (ti.family == FAM_C && t == T_F32) {
        for (int h = 0; h < n_heads; h++)
            for (int k = 0; k < n_tok; k++)
                rows[(size_t)h * n_tok + k] = (const uint8_t *)(x + (long)k * xs_t + (long)h * xs_h);
    } else {
        xq = (uint8_t *)aligned_alloc(64, ((rb * n) + 63) / 64 * 64);
        if (!xq) { free(rows); return -2; }
        heads_quant_ctx Q = {ti.family, x, xs_t, xs_h, n_tok, n_cols, xq, rb};
        pool_run(n >= 4 ? n_threads : 1, heads_quant_item, &Q, (int)n);
        for (size_t i = 0; i < n; i++) rows[i] = xq + rb * i;
    }
    heads_ctx L = {ti, W, head_bytes, row_bytes, n_rows, n_cols, rows, n_tok, y, (size_t)ys_t, (size_t)ys_h,
                   rows_per_item(n_rows, n_threads, n_tok), 0};
    L.items_per_head = (n_rows + L.rows_per_item - 1) / L.rows_per_item;
    pool_run(n_threads, heads_item, &L, n_heads * L.items_per_head);
    free(xq);
    free(rows);
    return 0;
}
