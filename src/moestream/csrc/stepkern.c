/* moestream's step kernels: the operations of a forward step between the matmuls, on float32 rows.
 *
 *   ms_rms_norm   RMSNorm of rows (ggml's arithmetic: the squares summed in double, in order)
 *   ms_rope       RoPE from precomputed cos/sin tables (NEOX halves or interleaved pairs; partial rotation)
 *   ms_attention  attention of T new queries over a KV cache (GQA without copies, causal, sliding window,
 *                 sinks, softcap, K = V through strides)
 *   ms_route      the router: softmax / sigmoid / given scores, bias, expert groups, top-k, renormalisation
 *   ms_delta_step the gated delta rule's recurrent step (Gated DeltaNet decode, one token)
 *   ms_dnet_decode a Gated DeltaNet layer's decode step between its matmuls (conv, norms, gates, the step above)
 *
 * Determinism: every output element (a row of a norm, a (token, head) of attention, a token's top-k) is
 * computed by one thread with a sequence of float operations fixed by this source, never by the thread
 * count or by the other rows of the call; -ffp-contract=off (kernels.py) keeps every multiply and add
 * rounded on its own, so a plain numpy reference with the same order gets the same bits (tests/test_stepkern.py
 * writes one per operation). exp and tanh are the C library's expf / tanhf.
 *
 * Threads: the pool of moekern.c (ms_pool_run, the same library), items claimed from an atomic counter.
 * Buffers: attention's score row is a per-thread buffer that grows to the longest row seen and is kept
 * (no allocation per step once it has grown).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void ms_pool_run(int n_threads, void (*fn)(void *, int), void *ctx, int n_items);

/* Elements an item of a row-parallel op should cover before another thread is worth waking. */
#define GRAIN 16384

static int items_for(long rows, long per_row, long *rows_per_item) {
    long rpi = GRAIN / (per_row > 0 ? per_row : 1);
    if (rpi < 1) rpi = 1;
    *rows_per_item = rpi;
    return (int)((rows + rpi - 1) / rpi);
}

/* ------------------------------------------------------------------------------------------------------ */
/* RMSNorm: y = x * (1 / sqrtf(mean + eps)) [* w], mean = (float)(sum_i (double)(x_i * x_i) / n) summed in  */
/* index order (ggml_compute_forward_rms_norm_f32, then ggml_mul by the weight).                            */

typedef struct {
    long rows, rpi;
    int n;
    const float *x; long xs;
    const float *w;
    float eps;
    float *y; long ys;
} norm_ctx;

/* one row: x [n] -> y [n] (y may be x) */
static inline void norm_row(const float *x, float *y, int n, const float *w, float eps) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    if (w) {
        for (int i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
    } else {
        for (int i = 0; i < n; i++) y[i] = x[i] * scale;
    }
}

static void norm_rows(void *vc, int item) {
    const norm_ctx *c = vc;
    long r1 = (item + 1) * c->rpi < c->rows ? (item + 1) * c->rpi : c->rows;
    for (long r = item * c->rpi; r < r1; r++) norm_row(c->x + r * c->xs, c->y + r * c->ys, c->n, c->w, c->eps);
}

/* rows rows of n floats, row r at x + r * xs (y + r * ys); w: [n] or NULL. y may be x. */
void ms_rms_norm(long rows, int n, const float *x, long xs, const float *w, float eps, float *y, long ys,
                 int n_threads) {
    norm_ctx c = {rows, 0, n, x, xs, w, eps, y, ys};
    int n_items = items_for(rows, n, &c.rpi);
    ms_pool_run(n_threads, norm_rows, &c, n_items);
}

/* ------------------------------------------------------------------------------------------------------ */
/* RoPE from tables: y_i = x_i * cos_i + p_i * sin_i (each product and the sum rounded on their own: the    */
/* arithmetic of layers.Rope in torch, so the same bits), p_i the partner of dim i: NEOX x_{i +- n_rot/2},  */
/* interleaved x_{i ^ 1}. Dims past n_rot are copied. Token t reads table row t (cos, sin: [T][n_rot]).     */

typedef struct {
    int T, heads, d, n_rot, interleaved;
    const float *x; long xs_t, xs_h;
    const float *cos, *sin;
    float *y; long ys_t, ys_h;
    long rpi;
} rope_ctx;

/* one head's row: x [d] -> y [d]; y may be x (each pair read before it is written) */
static inline void rope_row(const float *x, float *y, int d, int n_rot, int interleaved, const float *cs,
                            const float *sn) {
    if (interleaved) {
        for (int i = 0; i < n_rot; i += 2) {
            const float a = x[i], b = x[i + 1];
            y[i] = a * cs[i] + b * sn[i];
            y[i + 1] = b * cs[i + 1] + a * sn[i + 1];
        }
    } else {
        const int h = n_rot / 2;
        for (int i = 0; i < h; i++) {
            const float a = x[i], b = x[i + h];
            y[i] = a * cs[i] + b * sn[i];
            y[i + h] = b * cs[i + h] + a * sn[i + h];
        }
    }
    if (y != x)
        for (int i = n_rot; i < d; i++) y[i] = x[i];
}

static void rope_rows(void *vc, int item) {
    const rope_ctx *c = vc;
    const long rows = (long)c->T * c->heads;
    long r1 = (item + 1) * c->rpi < rows ? (item + 1) * c->rpi : rows;
    for (long r = item * c->rpi; r < r1; r++) {
        const long t = r / c->heads, hd = r % c->heads;
        rope_row(c->x + t * c->xs_t + hd * c->xs_h, c->y + t * c->ys_t + hd * c->ys_h, c->d, c->n_rot,
                 c->interleaved, c->cos + t * c->n_rot, c->sin + t * c->n_rot);
    }
}

/* x: [T][heads][d] at x + t * xs_t + h * xs_h (dims contiguous); y likewise (must not overlap x). */
void ms_rope(int T, int heads, int d, int n_rot, int interleaved, const float *x, long xs_t, long xs_h,
             const float *cos, const float *sin, float *y, long ys_t, long ys_h, int n_threads) {
    rope_ctx c = {T, heads, d, n_rot, interleaved, x, xs_t, xs_h, cos, sin, y, ys_t, ys_h, 0};
    int n_items = items_for((long)T * heads, d, &c.rpi);
    ms_pool_run(n_threads, rope_rows, &c, n_items);
}

/* ------------------------------------------------------------------------------------------------------ */
/* Attention of T new queries (positions start..start+T-1) over the cache rows 0..start+T-1, in the arithmetic  */
/* of llama.cpp's CPU attention (ggml's AVX2 build, F32 KV cache, flash attention off: ggml_mul_mat for the     */
/* scores, ggml_soft_max_ext, ggml_mul_mat for the values), every step rounded as it rounds there:             */
/*   score_j = vdot(k_j, q) * scale; vdot = ggml_vec_dot_f32: 32 float lanes, lane c accumulating             */
/*             fmaf(k_i, q_i, .) over the dims i = c mod 32 below d & ~31, in order; lanes folded               */
/*             x_r = (L_r + L_{16+r}) + (L_{8+r} + L_{24+r}), t_r = x_r + x_{4+r} (r < 4, r < 8),                */
/*             (t_0 + t_1) + (t_2 + t_3); the dims past d & ~31 then added one by one (product, sum);          */
/*   softcap > 0: score_j = softcap * tanhf(score_j / softcap);                                                */
/*   m = max(scores, sink); e_j = gexpf(score_j - m), gexpf = ggml_v_expf (the AVX2 polynomial, one lane);     */
/*   sum = the double sum, block after block of keys 8b..8b+7 (masked keys count 0), of each block's float    */
/*         hsum8 ((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7)); plus (double)expf(sink - m);               */
/*   p_j = e_j * (float)(1.0 / sum);                                                                            */
/*   out_i: T = 1 (decode): vdot over the keys (v_ji, p_j), lanes by key index j mod 32 (ggml's sgemm refuses */
/*          one column); T > 1 (prefill): 8 lanes by j mod 8 of fmaf(v_ji, p_j, .), then hsum8 (llamafile's    */
/*          tinyBLAS).                                                                                          */
/* Keys are indexed from cache row 0 (a masked key's term is an exact +0 and is skipped). Query head h reads KV */
/* head h / (n_head / n_kv); query t sees keys j <= pos_t and, with window > 0, j > pos_t - window.             */
/* fmaf is the fused multiply-add of the ISA (one rounding; the C library's on the portable build: the same     */
/* bits). Measured 2026-12-03 on llama.cpp's own q/k/v (qwen3moe-tiny Q4_K_M, 4 layers x 64 positions): every  */
/* output bit equal to llama.cpp's kqv_out.                                                                    */

#if defined(MS_ISA_AVX2) || defined(MS_ISA_AVX512)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(MS_ISA_AVX2) || defined(MS_ISA_AVX512)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8f r;
    for (int i = 0; i < 8; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

static inline float hsum8(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

/* ggml_vec_dot_f32's fold of its 32 lanes (4 vectors of 8) */
static inline float fold32(const v8f *l) {
    const v8f x = (l[0] + l[2]) + (l[1] + l[3]);
    const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
    return (t0 + t1) + (t2 + t3);
}

/* ggml_vdot: ggml_vec_dot_f32 of x, y [n] */
static inline float vdot(const float *x, const float *y, int n) {
    const int n32 = n & ~31;
    v8f l[4] = {{0}, {0}, {0}, {0}};
    for (int i = 0; i < n32; i += 32)
        for (int u = 0; u < 4; u++) l[u] = fma8(ld8(x + i + 8 * u), ld8(y + i + 8 * u), l[u]);
    float s = fold32(l);
    for (int i = n32; i < n; i++) s = s + x[i] * y[i];
    return s;
}

/* ggml_vdot of 8 rows x + u * xs (u < 8) with y, n a multiple of 32: each row's 32 lanes as vdot accumulates
 * them, then fold32's adds on the 8 rows at once (lane r of the 8 rows' partial sums gathered by a transpose). */
static inline v8f vdot8(const float *x, long xs, const float *y, int n) {
    v8f X[8];
    for (int u = 0; u < 8; u++) {
        v8f l[4] = {{0}, {0}, {0}, {0}};
        const float *xu = x + u * xs;
        for (int i = 0; i < n; i += 32)
            for (int w = 0; w < 4; w++) l[w] = fma8(ld8(xu + i + 8 * w), ld8(y + i + 8 * w), l[w]);
        X[u] = (l[0] + l[2]) + (l[1] + l[3]);
    }
    v8f T[8]; /* T[r][u] = X[u][r] */
#if defined(MS_ISA_AVX2) || defined(MS_ISA_AVX512)
    const __m256 a0 = _mm256_unpacklo_ps((__m256)X[0], (__m256)X[1]), a1 = _mm256_unpackhi_ps((__m256)X[0], (__m256)X[1]);
    const __m256 a2 = _mm256_unpacklo_ps((__m256)X[2], (__m256)X[3]), a3 = _mm256_unpackhi_ps((__m256)X[2], (__m256)X[3]);
    const __m256 a4 = _mm256_unpacklo_ps((__m256)X[4], (__m256)X[5]), a5 = _mm256_unpackhi_ps((__m256)X[4], (__m256)X[5]);
    const __m256 a6 = _mm256_unpacklo_ps((__m256)X[6], (__m256)X[7]), a7 = _mm256_unpackhi_ps((__m256)X[6], (__m256)X[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xee);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xee);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xee);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xee);
    T[0] = (v8f)_mm256_permute2f128_ps(b0, b4, 0x20); T[1] = (v8f)_mm256_permute2f128_ps(b1, b5, 0x20);
    T[2] = (v8f)_mm256_permute2f128_ps(b2, b6, 0x20); T[3] = (v8f)_mm256_permute2f128_ps(b3, b7, 0x20);
    T[4] = (v8f)_mm256_permute2f128_ps(b0, b4, 0x31); T[5] = (v8f)_mm256_permute2f128_ps(b1, b5, 0x31);
    T[6] = (v8f)_mm256_permute2f128_ps(b2, b6, 0x31); T[7] = (v8f)_mm256_permute2f128_ps(b3, b7, 0x31);
#else
    for (int r = 0; r < 8; r++)
        for (int u = 0; u < 8; u++) T[r][u] = X[u][r];
#endif
    return ((T[0] + T[4]) + (T[1] + T[5])) + ((T[2] + T[6]) + (T[3] + T[7]));
}

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ggml_v_expf (ggml-cpu/vec.h, AVX2 + FMA), one lane: max error 1.45 + 0.5 ulp; flushes to 0 below -103.97 */
static inline float gexpf(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = f2u(z) << 23;
    const float k = u2f(e + f2u(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(k, j, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = u2f(g + 0x7f000000u), s2 = u2f(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat8(float a) { return (v8f){a, a, a, a, a, a, a, a}; }

/* gexpf of 8 lanes: the same operations lane by lane (lanes past the polynomial's range recomputed by gexpf) */
static inline v8f gexpf8(v8f x) {
    const v8f r = splat8(0x1.8p23f);
    const v8f z = fma8(x, splat8(0x1.715476p+0f), r);
    const v8f n = z - r;
    const v8f b = fma8(-n, splat8(0x1.7f7d1cp-20f), fma8(-n, splat8(0x1.62e4p-1f), x));
    v8i e;
    memcpy(&e, &z, sizeof e);
    e = e << 23;
    const v8i one = {0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000};
    const v8i ki = e + one;
    v8f k;
    memcpy(&k, &ki, sizeof k);
    const v8f u = b * b;
    const v8f j = fma8(fma8(fma8(splat8(0x1.0e4020p-7f), b, splat8(0x1.573e2ep-5f)), u,
                            fma8(splat8(0x1.555e66p-3f), b, splat8(0x1.fffdb6p-2f))), u, splat8(0x1.ffffecp-1f) * b);
    v8f y = fma8(k, j, k);
    for (int l = 0; l < 8; l++)
        if (fabsf(n[l]) > 126.0f) y[l] = gexpf(x[l]);
    return y;
}

static _Thread_local float *tl_buf;
static _Thread_local long tl_cap;

static float *scratch(long n) {
    if (n > tl_cap) {
        long cap = tl_cap ? tl_cap : 1024;
        while (cap < n) cap *= 2;
        float *p = realloc(tl_buf, (size_t)cap * sizeof(float));
        if (!p) return NULL;
        tl_buf = p;
        tl_cap = cap;
    }
    return tl_buf;
}

#define MAX_HC 16 /* query heads of one KV head computed by one item (each on its own: the bits do not depend on it) */

typedef struct {
    int T, n_head, n_kv, d, dv, hc, n_chunks;
    const float *q; long qs_t, qs_h;
    const float *k; long ks_p, ks_h;
    const float *v; long vs_p, vs_h;
    int start, window;
    const float *sinks;
    float scale, softcap;
    float *out; long os_t;
    int failed;
} attn_ctx;

/* Cache rows a few keys ahead are asked for early by the first query head of an item (the others find them in
 * the caches): a decode step finds them in memory (the matmuls before it streamed their weights through the
 * caches). Hints only: no value depends on them. */
#define PF_AHEAD 4
static inline void prefetch_row(const float *p, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

/* The values of one (token, head): p [keys lo..hi-1 at p[j - lo]] -> o [dv]. acc: 32 * dv8 floats of scratch
 * (dv8 = dv rounded up to 8), lane c of dim i at acc[c * dv8 + i]: lane c accumulates fmaf(v_ji, p_j, .) over the
 * keys j = c mod lanes, in key order, from +0. A lane's 64 dims at a time stay in registers over its keys (the
 * same fmas in the same order as one key at a time over every lane). */
static void weighted_values(const float *p, const float *v, long vs, int lo, int hi, int dv, int lanes, float *acc,
                            float *o) {
    const int dv8 = (dv + 7) & ~7;
    const int full = dv & ~63; /* dims in whole runs of 64 */
    for (int c = 0; c < lanes; c++) {
        float *a = acc + (long)c * dv8;
        const int j0 = lo + ((c - lo) & (lanes - 1)); /* the lane's first key (lanes: 8 or 32) */
        for (int i0 = 0; i0 < full; i0 += 64) {
            v8f r0 = {0}, r1 = {0}, r2 = {0}, r3 = {0}, r4 = {0}, r5 = {0}, r6 = {0}, r7 = {0};
            for (int j = j0; j < hi; j += lanes) {
                const v8f pb = splat8(p[j - lo]);
                const float *vj = v + (long)j * vs + i0;
                r0 = fma8(ld8(vj), pb, r0);
                r1 = fma8(ld8(vj + 8), pb, r1);
                r2 = fma8(ld8(vj + 16), pb, r2);
                r3 = fma8(ld8(vj + 24), pb, r3);
                r4 = fma8(ld8(vj + 32), pb, r4);
                r5 = fma8(ld8(vj + 40), pb, r5);
                r6 = fma8(ld8(vj + 48), pb, r6);
                r7 = fma8(ld8(vj + 56), pb, r7);
            }
            st8(a + i0, r0); st8(a + i0 + 8, r1); st8(a + i0 + 16, r2); st8(a + i0 + 24, r3);
            st8(a + i0 + 32, r4); st8(a + i0 + 40, r5); st8(a + i0 + 48, r6); st8(a + i0 + 56, r7);
        }
        if (full < dv) { /* the other dims, 8 at a time through the buffer; the last ones padded with zeros */
            memset(a + full, 0, (size_t)(dv8 - full) * sizeof(float));
            float tail[8];
            for (int j = j0; j < hi; j += lanes) {
                const v8f pb = splat8(p[j - lo]);
                const float *vj = v + (long)j * vs;
                int i = full;
                for (; i + 8 <= dv; i += 8) st8(a + i, fma8(ld8(vj + i), pb, ld8(a + i)));
                if (i < dv) {
                    memset(tail, 0, sizeof tail);
                    memcpy(tail, vj + i, (size_t)(dv - i) * sizeof(float));
                    st8(a + i, fma8(ld8(tail), pb, ld8(a + i)));
                }
            }
        }
    }
    /* the lanes folded as hsum8 / fold32 fold them, 8 dims at a time (the same adds, elementwise over the dims) */
    for (int i = 0; i < dv8; i += 8) {
        v8f V[32], res;
        for (int c = 0; c < lanes; c++) V[c] = ld8(acc + (long)c * dv8 + i);
        if (lanes == 8) {
            res = ((V[0] + V[4]) + (V[2] + V[6])) + ((V[1] + V[5]) + (V[3] + V[7]));
        } else {
            v8f X[8];
            for (int r = 0; r < 8; r++) X[r] = (V[r] + V[16 + r]) + (V[8 + r] + V[24 + r]);
            res = ((X[0] + X[4]) + (X[1] + X[5])) + ((X[2] + X[6]) + (X[3] + X[7]));
        }
        if (i + 8 <= dv) st8(o + i, res);
        else for (int r = 0; r < dv - i; r++) o[i + r] = res[r];
    }
}

/* item: token t, KV head g, query heads h0..h0+nh-1 of its group */
static void attn_item(void *vc, int item) {
    attn_ctx *c = vc;
    const int per_t = c->n_kv * c->n_chunks;
    const int t = item / per_t, g = (item % per_t) / c->n_chunks, chunk = item % c->n_chunks;
    const int group = c->n_head / c->n_kv;
    const int h0 = g * group + chunk * c->hc;
    const int nh = h0 + c->hc <= (g + 1) * group ? c->hc : (g + 1) * group - h0;
    const int pos = c->start + t;
    const int lo = c->window > 0 && pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
    const int hi = pos + 1, n = hi - lo;
    const int lanes = c->T == 1 ? 32 : 8;
    const int dv8 = (c->dv + 7) & ~7;
    float *s = scratch((long)n + (long)lanes * dv8);
    if (!s) { c->failed = 1; return; }
    float *acc = s + n;
    const float *k = c->k + (long)g * c->ks_h;
    const float *v = c->v + (long)g * c->vs_h;
    float *o = c->out + (long)t * c->os_t;
    for (int hh = 0; hh < nh; hh++) {
        const int h = h0 + hh;
        const float *q = c->q + (long)t * c->qs_t + (long)h * c->qs_h;
        int j = lo;
        if ((c->d & 31) == 0) /* 8 keys at a time: their 32 lanes folded together (vdot8) */
            for (; j + 8 <= hi; j += 8) {
                if (hh == 0 && j + 8 + PF_AHEAD <= hi)
                    for (int u = 0; u < 8; u++) prefetch_row(k + (long)(j + PF_AHEAD + u) * c->ks_p, c->d);
                st8(s + (j - lo), vdot8(k + (long)j * c->ks_p, c->ks_p, q, c->d) * splat8(c->scale));
            }
        for (; j < hi; j++) {
            if (hh == 0 && j + PF_AHEAD < hi) prefetch_row(k + (long)(j + PF_AHEAD) * c->ks_p, c->d);
            s[j - lo] = vdot(k + (long)j * c->ks_p, q, c->d) * c->scale;
        }
        if (c->softcap > 0.0f)
            for (int j = 0; j < n; j++) s[j] = c->softcap * tanhf(s[j] / c->softcap);
        float m = -INFINITY; /* the running max, in key order, after the scores (no compare waits on a dot product) */
        for (int j = 0; j < n; j++)
            if (s[j] > m) m = s[j];
        const float sink = c->sinks ? c->sinks[h] : 0.0f;
        if (c->sinks && sink > m) m = sink;
        double sum = 0.0;
        for (int b0 = lo & ~7; b0 < hi; b0 += 8) { /* blocks of 8 keys from key 0; masked keys count 0 */
            float e8[8];
            if (b0 >= lo && b0 + 8 <= hi) {
                st8(e8, gexpf8(ld8(s + (b0 - lo)) - splat8(m)));
                memcpy(s + (b0 - lo), e8, sizeof e8);
            } else {
                for (int r = 0; r < 8; r++) {
                    const int j = b0 + r;
                    e8[r] = j >= lo && j < hi ? (s[j - lo] = gexpf(s[j - lo] - m)) : 0.0f;
                }
            }
            sum += (double)hsum8(e8);
        }
        if (c->sinks) sum += (double)expf(sink - m);
        const float inv = (float)(1.0 / sum);
        for (int j = 0; j < n; j++) s[j] = s[j] * inv;
        weighted_values(s, v, c->vs_p, lo, hi, c->dv, lanes, acc, o + (long)h * c->dv);
    }
}

/* q: [T][n_head][d] at q + t * qs_t + h * qs_h; k: cache row j of KV head g at k + j * ks_p + g * ks_h (d
 * floats), v likewise (dv floats; v may point into k: K = V); out: [T][n_head * dv] at out + t * os_t.
 * window: 0 = none; sinks: [n_head] or NULL; softcap: 0 = none. Returns 0, or -2 when out of memory. */
int ms_attention(int T, int n_head, int n_kv, int d, int dv, const float *q, long qs_t, long qs_h,
                 const float *k, long ks_p, long ks_h, const float *v, long vs_p, long vs_h, int start, int window,
                 const float *sinks, float scale, float softcap, float *out, long os_t, int n_threads) {
    const int group = n_head / n_kv;
    int hc = group < MAX_HC ? group : MAX_HC; /* fewer heads per item while the items do not fill the threads */
    while (hc > 1 && (long)T * n_kv * ((group + hc - 1) / hc) < n_threads) hc = (hc + 1) / 2;
    const int n_chunks = (group + hc - 1) / hc;
    attn_ctx c = {T, n_head, n_kv, d, dv, hc, n_chunks, q, qs_t, qs_h, k, ks_p, ks_h, v, vs_p, vs_h, start, window,
                  sinks, scale, softcap, out, os_t, 0};
    ms_pool_run(n_threads, attn_item, &c, T * n_kv * n_chunks);
    return c.failed ? -2 : 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* The router, per token:                                                                                   */
/*   gating 0 (softmax): m = max; e_i = expf(l_i - m); sum in double, in order; s_i = e_i / (float)sum;     */
/*   gating 1 (sigmoid): s_i = 1.0f / (1.0f + expf(-l_i)); gating 2: s_i = l_i (scores given);              */
/*   choice_i = s_i [+ bias_i]; with n_group > 1 a group's score is its best choice plus its second best,   */
/*   and only the experts of the topk_group best groups stay choosable;                                     */
/*   ids = the top_k best choices, best first (ties: the lower index), w_r = s_{ids_r};                     */
/*   norm: w_r / max((float)sum_r (double)w_r, floor); then w_r * scale unless scale == 1.                  */

typedef struct {
    int n_exp;
    const float *logits;
    int gating;
    const float *bias;
    int n_group, topk_group, top_k, norm;
    float floor, scale;
    int64_t *ids;
    float *w;
    int failed;
} route_ctx;

static void route_tok(void *vc, int t) {
    route_ctx *c = vc;
    const int ne = c->n_exp, k = c->top_k;
    float *buf = scratch(2L * ne);
    if (!buf) { c->failed = 1; return; }
    float *s = buf, *ch = buf + ne;
    const float *l = c->logits + (long)t * ne;
    if (c->gating == 0) {
        float m = -INFINITY;
        for (int i = 0; i < ne; i++) if (l[i] > m) m = l[i];
        double sum = 0.0;
        for (int i = 0; i < ne; i++) { s[i] = expf(l[i] - m); sum += (double)s[i]; }
        const float den = (float)sum;
        for (int i = 0; i < ne; i++) s[i] = s[i] / den;
    } else if (c->gating == 1) {
        for (int i = 0; i < ne; i++) s[i] = 1.0f / (1.0f + expf(-l[i]));
    } else {
        for (int i = 0; i < ne; i++) s[i] = l[i];
    }
    for (int i = 0; i < ne; i++) ch[i] = c->bias ? s[i] + c->bias[i] : s[i];
    if (c->n_group > 1) {
        const int gs = ne / c->n_group;
        unsigned char keep[1024];
        float gscore[1024];
        for (int g = 0; g < c->n_group; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int i = g * gs; i < (g + 1) * gs; i++) {
                if (ch[i] > b1) { b2 = b1; b1 = ch[i]; }
                else if (ch[i] > b2) b2 = ch[i];
            }
            gscore[g] = b1 + b2;
            keep[g] = 0;
        }
        for (int r = 0; r < c->topk_group; r++) {
            int best = -1;
            for (int g = 0; g < c->n_group; g++)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = 1;
        }
        for (int g = 0; g < c->n_group; g++)
            if (!keep[g]) for (int i = g * gs; i < (g + 1) * gs; i++) ch[i] = -INFINITY;
    }
    int64_t *ids = c->ids + (long)t * k;
    float *w = c->w + (long)t * k;
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int i = 0; i < ne; i++) {
            int taken = 0;
            for (int q = 0; q < r; q++) if (ids[q] == i) { taken = 1; break; }
            if (taken) continue;
            /* a NaN choice is taken only when nothing else is left */
            if (best < 0 || ch[i] > ch[best] || (ch[best] != ch[best] && ch[i] == ch[i])) best = i;
        }
        ids[r] = best;
        w[r] = s[best];
    }
    if (c->norm) {
        double sum = 0.0;
        for (int r = 0; r < k; r++) sum += (double)w[r];
        float den = (float)sum;
        if (den < c->floor) den = c->floor;
        for (int r = 0; r < k; r++) w[r] = w[r] / den;
    }
    if (c->scale != 1.0f)
        for (int r = 0; r < k; r++) w[r] = w[r] * c->scale;
}

/* logits: [T][n_exp]; bias: [n_exp] or NULL; ids: int64 [T][top_k]; w: [T][top_k]. n_group <= 1024 divides
 * n_exp, topk_group <= n_group, top_k <= the experts of topk_group groups. Returns 0, -1 for a bad size, or
 * -2 when out of memory. */
int ms_route(int T, int n_exp, const float *logits, int gating, const float *bias, int n_group, int topk_group,
             int top_k, int norm, float floor, float scale, int64_t *ids, float *w, int n_threads) {
    if (n_group < 1 || n_group > 1024 || n_exp % n_group || topk_group < 1 || topk_group > n_group ||
        top_k < 1 || top_k > (n_group > 1 ? topk_group * (n_exp / n_group) : n_exp))
        return -1;
    route_ctx c = {n_exp, logits, gating, bias, n_group, topk_group, top_k, norm, floor, scale, ids, w, 0};
    ms_pool_run(T * (long)n_exp >= GRAIN ? n_threads : 1, route_tok, &c, T);
    return c.failed ? -2 : 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* The MoE call's bookkeeping: the (token, k) pairs of one call grouped by expert, and the sum of each token's */
/* top-k output rows.                                                                                        */

/* Pairs p = 0..n_pairs-1 (token p / top_k, its k-th choice: ids[p], int64 in [0, n_exp)) sorted by expert id,
 * ascending, the pairs of one expert in p order (a stable sort: numpy's argsort(kind="stable")). Writes
 * experts int64 [n_groups] (the distinct ids, ascending), pair_start int32 [n_groups + 1] (group g's pairs are
 * pair_start[g]..pair_start[g+1]-1), and per pair in that order pair_tok int32 (p / top_k), pair_w float32
 * (w[p]; skipped when w is NULL) and pair_out int32 (p). count: int32 [n_exp] scratch. tabs: NULL, or n_tabs
 * int64 tables of n_exp entries each (table m at tabs + m * n_exp; an address per expert): then addr + m *
 * addr_stride gets table m's entries of the n_groups experts. Returns n_groups, or -1 when an id is out of range
 * (nothing else is then valid). */
int ms_moe_pairs(int n_pairs, int top_k, const int64_t *ids, const float *w, int n_exp, const int64_t *tabs,
                 int n_tabs, int32_t *count, int64_t *experts, int32_t *pair_start, int32_t *pair_tok, float *pair_w,
                 int32_t *pair_out, int64_t *addr, long addr_stride) {
    for (int p = 0; p < n_pairs; p++)
        if (ids[p] < 0 || ids[p] >= n_exp) return -1;
    int n_groups = 0;
    if ((long)n_pairs * n_pairs <= 4L * n_exp) { /* few pairs (a decode step): insertion sort of the pair indices */
        for (int p = 0; p < n_pairs; p++) {
            int q = p;
            while (q > 0 && ids[pair_out[q - 1]] > ids[p]) { pair_out[q] = pair_out[q - 1]; q--; }
            pair_out[q] = p;
        }
    } else { /* counting sort */
        memset(count, 0, (size_t)n_exp * sizeof(int32_t));
        for (int p = 0; p < n_pairs; p++) count[ids[p]]++;
        int32_t run = 0;
        for (int e = 0; e < n_exp; e++) { const int32_t c = count[e]; count[e] = run; run += c; }
        for (int p = 0; p < n_pairs; p++) pair_out[count[ids[p]]++] = p;
    }
    for (int i = 0; i < n_pairs; i++) {
        const int p = pair_out[i];
        if (i == 0 || ids[p] != ids[pair_out[i - 1]]) {
            experts[n_groups] = ids[p];
            pair_start[n_groups++] = i;
        }
        pair_tok[i] = p / top_k;
        if (w) pair_w[i] = w[p];
    }
    pair_start[n_groups] = n_pairs;
    if (tabs)
        for (int m = 0; m < n_tabs; m++)
            for (int g = 0; g < n_groups; g++) addr[m * addr_stride + g] = tabs[(long)m * n_exp + experts[g]];
    return n_groups;
}

/* dst[t][i] = ((0 + src[t][0][i]) + src[t][1][i]) + ... + src[t][K-1][i]: src float32 [T][K][n], dst [T][n] (the
 * rows added in k order from +0, as torch's sum over dim 1 of a contiguous [T, K, n] tensor adds them). */
void ms_residual_norm(int rows, int n, float *x, const float *r, int K, const float *w, float eps, float *h,
                      int n_threads);

void ms_topk_sum(int T, int K, int n, const float *src, float *dst, int n_threads) {
    memset(dst, 0, (size_t)T * n * sizeof(float)); /* +0 + the sum (which starts from +0): the sum's own bits */
    ms_residual_norm(T, n, dst, src, K, NULL, 0.0f, NULL, n_threads);
}

/* ------------------------------------------------------------------------------------------------------ */
/* The attention block of one sequence's step in one call: per-head RMSNorm of the new queries and keys       */
/* (optional), RoPE (optional), the keys and values written into the cache rows of their positions, then      */
/* ms_attention. Each operation in the arithmetic of its own kernel above (norm_row, rope_row), so the same bits */
/* as the separate calls.                                                                                      */

typedef struct {
    int T, n_head, n_kv, d, dv;
    float *q; long qs_t, qs_h;
    const float *k; long kn_t, kn_h;
    const float *v; long vn_t, vn_h;
    const float *q_norm, *k_norm;
    float eps;
    int n_rot, interleaved;
    const float *cos, *sin;
    float *kc; long kc_p, kc_h;
    float *vc; long vc_p, vc_h;
    int start;
    long rpi;
    int failed;
} prep_ctx;

/* one head's dims (0, 2, 4, ..., 1, 3, 5, ...): x [d] -> y [d] (not overlapping) */
static inline void deinterleave_row(const float *x, float *y, int d) {
    for (int i = 0; i < d / 2; i++) { y[i] = x[2 * i]; y[d / 2 + i] = x[2 * i + 1]; }
}

static void prep_rows(void *vc, int item) {
    prep_ctx *c = vc;
    const long nq = (long)c->T * c->n_head, rows = nq + (long)c->T * c->n_kv;
    const int deint = c->interleaved == 2, mode = deint ? 0 : c->interleaved;
    long r1 = (item + 1) * c->rpi < rows ? (item + 1) * c->rpi : rows;
    for (long r = item * c->rpi; r < r1; r++) {
        if (r < nq) { /* a query head: normed and rotated in place */
            const long t = r / c->n_head, h = r % c->n_head;
            float *q = c->q + t * c->qs_t + h * c->qs_h;
            if (deint) {
                float *tmp = scratch(c->d);
                if (!tmp) { c->failed = 1; return; }
                deinterleave_row(q, tmp, c->d);
                memcpy(q, tmp, (size_t)c->d * sizeof(float));
            }
            if (c->q_norm) norm_row(q, q, c->d, c->q_norm, c->eps);
            if (c->n_rot) rope_row(q, q, c->d, c->n_rot, mode, c->cos + t * c->n_rot, c->sin + t * c->n_rot);
        } else { /* a KV head: the key normed, rotated into its cache row; the value copied */
            const long t = (r - nq) / c->n_kv, g = (r - nq) % c->n_kv;
            const float *k = c->k + t * c->kn_t + g * c->kn_h;
            float *kc = c->kc + (c->start + t) * c->kc_p + g * c->kc_h;
            if (c->k_norm || deint) {
                float *tmp = scratch(c->d);
                if (!tmp) { c->failed = 1; return; }
                if (deint) {
                    deinterleave_row(k, tmp, c->d);
                    if (c->k_norm) norm_row(tmp, tmp, c->d, c->k_norm, c->eps);
                } else {
                    norm_row(k, tmp, c->d, c->k_norm, c->eps);
                }
                k = tmp;
            }
            if (c->n_rot) rope_row(k, kc, c->d, c->n_rot, mode, c->cos + t * c->n_rot, c->sin + t * c->n_rot);
            else memcpy(kc, k, (size_t)c->d * sizeof(float));
            memcpy(c->vc + (c->start + t) * c->vc_p + g * c->vc_h, c->v + t * c->vn_t + g * c->vn_h,
                   (size_t)c->dv * sizeof(float));
        }
    }
}

/* q: [T][n_head][d] new queries at q + t * qs_t + h * qs_h, OVERWRITTEN with the normed, rotated queries; k: [T][n_kv][d]
 * and v: [T][n_kv][dv] new keys and values (read only); q_norm, k_norm: [d] RMSNorm weights or NULL (no norm);
 * n_rot: the rotated dims (0: no RoPE), cos, sin: the tables' rows of positions start.. ([T][n_rot]); interleaved:
 * 0 NEOX halves, 1 interleaved pairs, 2 NEOX after each query and key head's dims are first reordered (0, 2, 4,
 * ..., 1, 3, 5, ...: models/llama.py's deinterleave, a plain copy; then the norm, if any); kc, vc: the
 * layer's cache, row j of KV head g at kc + j * kc_p + g * kc_h (vc likewise); rows start..start+T-1 are written,
 * then ms_attention of the queries over rows 0..start+T-1 into out [T][n_head * dv] (os_t). Returns 0, or -2 when
 * out of memory. */
int ms_attn_block(int T, int n_head, int n_kv, int d, int dv, float *q, long qs_t, long qs_h, const float *k,
                  long kn_t, long kn_h, const float *v, long vn_t, long vn_h, const float *q_norm, const float *k_norm,
                  float eps, int n_rot, int interleaved, const float *cos, const float *sin, float *kc, long kc_p,
                  long kc_h, float *vc, long vc_p, long vc_h, int start, int window, const float *sinks, float scale,
                  float softcap, float *out, long os_t, int n_threads) {
    prep_ctx c = {T, n_head, n_kv, d, dv, q, qs_t, qs_h, k, kn_t, kn_h, v, vn_t, vn_h, q_norm, k_norm, eps, n_rot,
                  interleaved, cos, sin, kc, kc_p, kc_h, vc, vc_p, vc_h, start, 0, 0};
    int n_items = items_for((long)T * (n_head + n_kv), d, &c.rpi);
    ms_pool_run(n_threads, prep_rows, &c, n_items);
    if (c.failed) return -2;
    return ms_attention(T, n_head, n_kv, d, dv, q, qs_t, qs_h, kc, kc_p, kc_h, vc, vc_p, vc_h, start, window, sinks,
                        scale, softcap, out, os_t, n_threads);
}

/* ------------------------------------------------------------------------------------------------------ */
/* The logits' finiteness check                                                                              */

/* The index of the first element of x [n] that is NaN or +-Inf, or -1 when every one is finite (one pass:
 * x - x is 0 for a finite x, NaN otherwise, and a NaN stays in the lanes' sum). */
long ms_first_nonfinite(const float *x, long n) {
    v8f acc = {0};
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = ld8(x + i);
        acc += v - v;
    }
    float tail = 0.0f;
    for (; i < n; i++) tail += x[i] - x[i];
    int bad = tail != tail;
    for (int l = 0; l < 8; l++) bad |= acc[l] != acc[l];
    if (!bad) return -1;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return -1;
}

/* ------------------------------------------------------------------------------------------------------ */
/* The residual stream between the matmuls of a decode step                                                  */

typedef struct {
    int n, K;
    float *x;
    const float *r;
    const float *w;
    float eps;
    float *h;
    long rpi, rows;
} resid_ctx;

static void resid_rows(void *vc, int item) {
    const resid_ctx *c = vc;
    long r1 = (item + 1) * c->rpi < c->rows ? (item + 1) * c->rpi : c->rows;
    for (long t = item * c->rpi; t < r1; t++) {
        float *x = c->x + t * c->n;
        if (c->r && c->K == 0) {
            const float *r = c->r + t * c->n;
            for (int i = 0; i < c->n; i++) x[i] = x[i] + r[i];
        } else if (c->r) {
            const float *r = c->r + t * c->K * c->n;
            for (int i = 0; i < c->n; i++) {
                float s = 0.0f;
                for (int k = 0; k < c->K; k++) s = s + r[(long)k * c->n + i];
                x[i] = x[i] + s;
            }
        }
        if (c->h) norm_row(x, c->h + t * c->n, c->n, c->w, c->eps);
    }
}

/* x: float32 [rows][n], updated in place: x += r (r: [rows][n], K = 0), or x += the sum of r's K rows per row
 * (r: [rows][K][n], added in k order from +0: ms_topk_sum's sum), or nothing (r NULL); then, when h is not NULL,
 * h [rows][n] = RMSNorm of the new x (norm_row: ms_rms_norm's arithmetic) by w [n] (or NULL) with eps. */
void ms_residual_norm(int rows, int n, float *x, const float *r, int K, const float *w, float eps, float *h,
                      int n_threads) {
    resid_ctx c = {n, K, x, r, w, eps, h, 0, rows};
    int n_items = items_for(rows, (long)(K + 1) * n, &c.rpi);
    ms_pool_run(n_threads, resid_rows, &c, n_items);
}

/* ms_route of T tokens into ids / w, then ms_moe_pairs of its choice (tabs, addresses as there). Returns the
 * number of distinct experts, or ms_route's error (-1 bad sizes, -2 out of memory), or -3 for an id out of range. */
int ms_route_plan(int T, int n_exp, const float *logits, int gating, const float *bias, int n_group, int topk_group,
                  int top_k, int norm, float floor, float scale, int64_t *ids, float *w, const int64_t *tabs,
                  int n_tabs, int32_t *count, int64_t *experts, int32_t *pair_start, int32_t *pair_tok,
                  float *pair_w, int32_t *pair_out, int64_t *addr, long addr_stride, int n_threads) {
    const int rc = ms_route(T, n_exp, logits, gating, bias, n_group, topk_group, top_k, norm, floor, scale, ids, w,
                            n_threads);
    if (rc) return rc;
    const int n = ms_moe_pairs(T * top_k, top_k, ids, w, n_exp, tabs, n_tabs, count, experts, pair_start, pair_tok,
                               pair_w, pair_out, addr, addr_stride);
    return n < 0 ? -3 : n;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Embedding rows decoded from their ggml blocks, in quant.py's arithmetic (each product rounded on its own).  */

static inline float half_to_float(uint16_t h) {
#if defined(MS_ISA_AVX2) || defined(MS_ISA_AVX512)
    return _cvtsh_ss(h); /* the conversion torch's CPU kernels run on these builds */
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    return u2f(u);
#endif
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q8_0 blocks of 32: fp16 d | 32 int8; x = (float)q * d */
static void dq_q8_0(const uint8_t *b, float *y, int n_blocks) {
    for (int k = 0; k < n_blocks; k++, b += 34, y += 32) {
        const float d = half_to_float(rd16(b));
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
    }
}

/* Q4_K super-blocks of 256: fp16 d | fp16 dmin | 12 bytes of 6-bit scales and mins | 128 bytes of nibbles (group
 * 2c: low nibbles of bytes 32c.., group 2c+1: their high nibbles); x = (float)q * (d * sc) - (dmin * mn) */
static void dq_q4_k(const uint8_t *b, float *y, int n_blocks) {
    for (int k = 0; k < n_blocks; k++, b += 144, y += 256) {
        const float d = half_to_float(rd16(b)), dmin = half_to_float(rd16(b + 2));
        const uint8_t *sc = b + 4, *qs = b + 16;
        for (int g = 0; g < 8; g++) {
            int s, m;
            if (g < 4) { s = sc[g] & 63; m = sc[g + 4] & 63; }
            else { s = (sc[g + 4] & 0xf) | ((sc[g - 4] >> 6) << 4); m = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4); }
            const float dl = d * (float)s, ml = dmin * (float)m;
            const uint8_t *q = qs + 32 * (g / 2);
            for (int i = 0; i < 32; i++) y[32 * g + i] = (float)((g & 1) ? q[i] >> 4 : q[i] & 0xf) * dl - ml;
        }
    }
}

/* Q6_K super-blocks of 256: 128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | fp16 d; element
 * 128h + 32f + i: low nibble f / 2 of ql[64h + 32(f % 2) + i], high bits 2f.. of qh[32h + i];
 * x = (float)(q - 32) * (d * sc[element / 16]) */
static void dq_q6_k(const uint8_t *b, float *y, int n_blocks) {
    for (int k = 0; k < n_blocks; k++, b += 210, y += 256) {
        const float d = half_to_float(rd16(b + 208));
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++)
            for (int f = 0; f < 4; f++)
                for (int i = 0; i < 32; i++) {
                    const int e = 128 * h + 32 * f + i;
                    const uint8_t lo = ql[64 * h + 32 * (f % 2) + i];
                    const int q = ((f < 2 ? lo & 0xf : lo >> 4) | (((qh[32 * h + i] >> (2 * f)) & 3) << 4)) - 32;
                    y[e] = (float)q * (d * (float)sc[e / 16]);
                }
    }
}

/* Rows ids[0..n-1] of a matrix of n_rows rows of ggml type t (rows of n_cols elements, row r at raw + r *
 * row_bytes) into out [n][n_cols]. Types: Q8_0 (8), Q4_K (12), Q6_K (14), BF16 (30). Returns 0; -1 for another
 * type or n_cols not a multiple of its block, -2 for an id outside 0..n_rows-1 (nothing written: the caller
 * decodes those itself, or says what is wrong). */
int ms_dequant_rows(int t, const uint8_t *raw, long row_bytes, long n_rows, const int64_t *ids, int n, int n_cols,
                    float *out) {
    const int block = t == 8 ? 32 : t == 12 || t == 14 ? 256 : t == 30 ? 1 : 0;
    if (!block || n_cols % block) return -1;
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= n_rows) return -2;
    for (int r = 0; r < n; r++) {
        const uint8_t *b = raw + ids[r] * row_bytes;
        float *y = out + (long)r * n_cols;
        if (t == 8) dq_q8_0(b, y, n_cols / 32);
        else if (t == 12) dq_q4_k(b, y, n_cols / 256);
        else if (t == 14) dq_q6_k(b, y, n_cols / 256);
        else for (int i = 0; i < n_cols; i++) y[i] = u2f((uint32_t)rd16(b + 2 * i) << 16);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* The gated delta rule's recurrent step for one token (Gated DeltaNet's decode: transformers'               */
/* torch_recurrent_gated_delta_rule, one t): per value head h, with key head kh = h % n_k (the file's tiled   */
/* value heads), S = S_h [d_k][d_v] row-major:                                                               */
/*   S'[i][j] = decay_h * S[i][j];  kv[j] = (((0 + S'[0][j] k[0]) + S'[1][j] k[1]) + ...)  (i in order);      */
/*   delta[j] = (v[j] - kv[j]) * beta_h;  S[i][j] = S'[i][j] + k[i] delta[j];                                 */
/*   out[j] = (((0 + S[0][j] q[0]) + S[1][j] q[1]) + ...)  (i in order, over the updated S).                 */
/* Two passes over S (S' recomputed in the second: the same product, the same bits) instead of torch's five;  */
/* every product and sum rounded on its own (-ffp-contract=off). One head per item.                          */

#define MAX_DV 1024 /* value dims of a head the step takes (Qwen3.5: 128) */

typedef struct {
    int n_k, d_k, d_v;
    const float *q, *k, *v, *decay, *beta;
    float *S, *out;
} delta_ctx;

static void delta_head(void *vc, int h) {
    const delta_ctx *c = vc;
    const int dk = c->d_k, dv = c->d_v, kh = h % c->n_k;
    const float *q = c->q + (long)kh * dk, *k = c->k + (long)kh * dk, *v = c->v + (long)h * dv;
    const float decay = c->decay[h], beta = c->beta[h];
    float *S = c->S + (long)h * dk * dv, *out = c->out + (long)h * dv;
    float acc[MAX_DV];
    for (int j = 0; j < dv; j++) acc[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        const float *s = S + (long)i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; j++) acc[j] += (decay * s[j]) * ki;
    }
    for (int j = 0; j < dv; j++) acc[j] = (v[j] - acc[j]) * beta; /* delta */
    for (int j = 0; j < dv; j++) out[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *s = S + (long)i * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; j++) {
            const float u = decay * s[j] + ki * acc[j];
            s[j] = u;
            out[j] += u * qi;
        }
    }
}

/* q, k: [n_k][d_k]; v: [n_v][d_v]; decay, beta: [n_v]; S: [n_v][d_k][d_v] updated in place; out: [n_v][d_v].
 * Returns 0, or -1 when n_v is not a multiple of n_k or d_v is past MAX_DV. */
int ms_delta_step(int n_v, int n_k, int d_k, int d_v, const float *q, const float *k, const float *v,
                  const float *decay, const float *beta, float *S, float *out, int n_threads) {
    if (n_k <= 0 || n_v % n_k || d_v > MAX_DV) return -1;
    delta_ctx c = {n_k, d_k, d_v, q, k, v, decay, beta, S, out};
    ms_pool_run(n_threads, delta_head, &c, n_v);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* A Gated DeltaNet layer's decode step between its matmuls (Qwen 3.5; transformers' Qwen3NextGatedDeltaNet   */
/* for one token), given the projections qkv [conv_dim], beta_raw, alpha_raw [n_v] and z [n_v * d_v]:         */
/*   conv: y[c] = (((0 + w[c][0] st[0][c]) + w[c][1] st[1][c]) + ...) + w[c][K-1] qkv[c], the state shifted   */
/*         one row (its rows: the last K-1 inputs, oldest first), then y = silu(y) = y / (1 + expf(-y));      */
/*   q, k: the first two n_k * d_k of y, per key head x * (1 / sqrtf(sum_i x_i^2 + 1e-6)) (the sum in float, */
/*         in order: transformers' l2norm), q then times 1 / sqrtf(d_k); v: the rest, [n_v][d_v];           */
/*   beta = 1 / (1 + expf(-beta_raw)); g = a * softplus(alpha_raw + dt) (softplus(x) = x past 20, else       */
/*         log1pf(expf(x)): torch's threshold); decay = expf(g);                                              */
/*   the delta rule's step (delta_head above) into o [n_v][d_v];                                              */
/*   out = norm_row(o_h, norm_w, eps) * silu(z_h) per value head (the gated RMSNorm).                         */
/* Two pool runs: the conv and the key heads' norms by channel blocks, then one value head per item.          */

#define CONV_BLOCK 256

typedef struct {
    int conv_dim, K, n_k, n_v, d_k, d_v;
    float *qkv; float *st; const float *w;
    const float *beta_raw, *alpha_raw, *dt, *a;
    float *S; const float *z, *norm_w; float eps;
    float *out;
    float *beta, *decay;
} dnet_ctx;

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

static void dnet_conv(void *vc, int item) {
    const dnet_ctx *c = vc;
    const int K = c->K, C = c->conv_dim, lo = item * CONV_BLOCK, hi = lo + CONV_BLOCK < C ? lo + CONV_BLOCK : C;
    for (int ch = lo; ch < hi; ch++) {
        const float *w = c->w + (long)ch * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) acc += w[j] * c->st[(long)j * C + ch];
        const float x = c->qkv[ch];
        acc += w[K - 1] * x;
        for (int j = 0; j < K - 2; j++) c->st[(long)j * C + ch] = c->st[(long)(j + 1) * C + ch];
        if (K > 1) c->st[(long)(K - 2) * C + ch] = x;
        c->qkv[ch] = silu1(acc);
    }
}

static inline void l2_row(float *x, int n, float mul) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) x[i] = (x[i] * r) * mul;
}

static void dnet_head(void *vc, int h) {
    const dnet_ctx *c = vc;
    const int dv = c->d_v;
    const float *z = c->z + (long)h * dv;
    float *o = c->out + (long)h * dv;
    delta_ctx d = {c->n_k, c->d_k, dv, c->qkv, c->qkv + (long)c->n_k * c->d_k, c->qkv + 2L * c->n_k * c->d_k,
                   c->decay, c->beta, c->S, c->out};
    delta_head(&d, h);
    norm_row(o, o, dv, c->norm_w, c->eps);
    for (int j = 0; j < dv; j++) o[j] = o[j] * silu1(z[j]);
}

/* qkv [conv_dim] (overwritten: conv + silu, then the normed q, k); st [K-1][conv_dim] (shifted in place);
 * w [conv_dim][K]; beta_raw, alpha_raw, dt, a [n_v]; S [n_v][d_k][d_v] (updated); z [n_v][d_v]; norm_w [d_v];
 * out [n_v][d_v]. conv_dim = 2 n_k d_k + n_v d_v. Returns 0, or -1 for sizes that do not fit. */
int ms_dnet_decode(int conv_dim, int K, int n_k, int n_v, int d_k, int d_v, float *qkv, float *st, const float *w,
                   const float *beta_raw, const float *alpha_raw, const float *dt, const float *a, float *S,
                   const float *z, const float *norm_w, float eps, float *out, int n_threads) {
    if (n_k <= 0 || n_v % n_k || d_v > MAX_DV || n_v > 4096 || K < 1 || conv_dim != 2 * n_k * d_k + n_v * d_v)
        return -1;
    float beta[4096], decay[4096];
    dnet_ctx c = {conv_dim, K, n_k, n_v, d_k, d_v, qkv, st, w, beta_raw, alpha_raw, dt, a, S, z, norm_w, eps, out,
                  beta, decay};
    ms_pool_run(n_threads, dnet_conv, &c, (conv_dim + CONV_BLOCK - 1) / CONV_BLOCK);
    const float qmul = 1.0f / sqrtf((float)d_k);
    for (int h = 0; h < n_k; h++) {
        l2_row(qkv + (long)h * d_k, d_k, qmul);
        l2_row(qkv + (long)(n_k + h) * d_k, d_k, 1.0f);
    }
    for (int h = 0; h < n_v; h++) {
        beta[h] = 1.0f / (1.0f + expf(-beta_raw[h]));
        const float x = alpha_raw[h] + dt[h];
        decay[h] = expf(a[h] * (x > 20.0f ? x : log1pf(expf(x))));
    }
    ms_pool_run(n_threads, dnet_head, &c, n_v);
    return 0;
}
