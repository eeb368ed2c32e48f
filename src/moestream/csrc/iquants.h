/* Tile kernels of the 1-3 bit i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
 * types (TQ1_0, TQ2_0), included by moekern.c after the family A/B machinery.
 *
 * Every type here is a family B type (256-element super-blocks against Q8_K activations): each unpacker
 * writes 256 int8 codes, 16 integer scales (one per 16 codes; a type with one scale per 32 writes it into
 * both halves) and a float d, such that w_i = d * sc[i / 16] * q_i exactly (no min terms):
 *
 *   IQ2_XXS / IQ2_XS / IQ2_S   w = fp16 d * (0.5 + ls) * 0.25 * grid * sign = (d / 8) * (2 ls + 1) * (+-grid)
 *                              grid values 8, 25, 43; ls 4-bit (per 32: XXS; per 16: XS, S)
 *   IQ3_XXS                    w = d * (0.5 + ls) * 0.5 * grid * sign = (d / 4) * (2 ls + 1) * (+-grid)
 *                              grid values 4 .. 62; ls 4-bit per 32
 *   IQ3_S                      w = d * (1 + 2 ls) * grid * sign; grid values 1 .. 15; ls 4-bit per 32
 *   IQ1_S / IQ1_M              w = d * (2 s + 1) * (g +- 1/8) = (d / 8) * (2 s + 1) * (8 g +- 1)
 *                              g in {-1, 0, 1}: codes in {-9, -7, -1, 1, 7, 9}; s 3-bit (per 32: IQ1_S, per 16:
 *                              IQ1_M); the sign of the delta per 32 (IQ1_S) or per 8 (IQ1_M)
 *   TQ1_0 / TQ2_0              w = d * (digit - 1): codes -1, 0, 1, sc = 1
 *
 * d / 8 and d / 4 are exact (powers of two; an fp16 value divided by 8 is still a normal float32), so the
 * product d * sc * q is the weight exactly. The dot's constraints hold: |code| <= 62 (<= 128), pair sums
 * 2 * 62 * 127 < 32767 per int16 lane, sc <= 31, and |sum| <= 256 * 62 * 127 * 31 < 2^31.
 *
 * Block layouts: ggml-common.h (block_iq2_xxs etc.); the code books come from Python (kernels._set_tables:
 * int8 grids of values, ksigns_iq2xs as bytes: bit j set = element j of the group of 8 negative).
 *
 * iquant_mm(t, &family, &block, &block_bytes): the tile kernel of ggml type t, or NULL when the kernels do
 * not compute t (Python then falls back to dequantize-then-matmul for it).
 */

/* 8 grid values (signed int8 table of width 8) with the signs of bit mask s (bit j set: element j negative) */
static inline void grid8_signed(const int8_t *g, uint8_t s, int8_t *out) {
    for (int j = 0; j < 8; j++) out[j] = (int8_t)((s >> j) & 1 ? -g[j] : g[j]);
}

static inline void no_min(ublk_b *u) {
    u->dmin = 0.0f;
    u->has_min = 0;
}

/* block_iq2_xxs (66 bytes): fp16 d | 8 x (4 bytes: grid indices of 4 groups of 8; u32: 4 x 7-bit ksigns
 * indices in bits 0-27, the 4-bit scale in bits 28-31), one pair of u32 per 32 elements. */
static void unpack_iq2_xxs(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ2XXS;
    u->d = rdh(b) * 0.125f;
    no_min(u);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *idx = b + 2 + 8 * ib;
        const uint32_t aux = rd32(b + 2 + 8 * ib + 4);
        const int16_t sc = (int16_t)(2 * (int)(aux >> 28) + 1);
        u->sc[2 * ib] = u->sc[2 * ib + 1] = sc;
        for (int l = 0; l < 4; l++)
            grid8_signed(grid + 8 * idx[l], G_KSIGNS[(aux >> (7 * l)) & 127], u->q + 32 * ib + 8 * l);
    }
}

/* block_iq2_xs (74 bytes): fp16 d | 32 u16 (bits 0-8 a grid index, bits 9-15 a ksigns index), one per 8
 * elements | 8 bytes of 4-bit scales, one per 16 elements (low nibble first). */
static void unpack_iq2_xs(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ2XS;
    u->d = rdh(b) * 0.125f;
    no_min(u);
    for (int i = 0; i < 32; i++) {
        const uint16_t v = rd16(b + 2 + 2 * i);
        grid8_signed(grid + 8 * (v & 511), G_KSIGNS[v >> 9], u->q + 8 * i);
    }
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * ((b[66 + g / 2] >> (4 * (g & 1))) & 15) + 1);
}

/* block_iq2_s (82 bytes): fp16 d | 32 bytes: low 8 bits of the grid index per 8 elements | 32 bytes of sign
 * bits (byte i for group i, bit j for its element j) | 8 bytes: 2-bit high index parts (4 per byte, low
 * first) | 8 bytes of 4-bit scales, one per 16 elements (low nibble first). */
static void unpack_iq2_s(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ2S;
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    u->d = rdh(b) * 0.125f;
    no_min(u);
    for (int i = 0; i < 32; i++) {
        const int idx = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
        grid8_signed(grid + 8 * idx, signs[i], u->q + 8 * i);
    }
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * ((scales[g / 2] >> (4 * (g & 1))) & 15) + 1);
}

/* block_iq3_xxs (98 bytes): fp16 d | 64 bytes of grid indices (4 values each) | 8 u32, one per 32 elements:
 * 4 x 7-bit ksigns indices (one per 8) in bits 0-27, the 4-bit scale in bits 28-31. */
static void unpack_iq3_xxs(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ3XXS;
    const uint8_t *qs = b + 2;
    u->d = rdh(b) * 0.25f;
    no_min(u);
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = rd32(b + 66 + 4 * ib);
        const int16_t sc = (int16_t)(2 * (int)(aux >> 28) + 1);
        u->sc[2 * ib] = u->sc[2 * ib + 1] = sc;
        for (int l = 0; l < 4; l++) {
            const uint8_t s = G_KSIGNS[(aux >> (7 * l)) & 127];
            const int8_t *g0 = grid + 4 * qs[8 * ib + 2 * l], *g1 = grid + 4 * qs[8 * ib + 2 * l + 1];
            int8_t *q = u->q + 32 * ib + 8 * l;
            for (int j = 0; j < 4; j++) {
                q[j] = (int8_t)((s >> j) & 1 ? -g0[j] : g0[j]);
                q[j + 4] = (int8_t)((s >> (j + 4)) & 1 ? -g1[j] : g1[j]);
            }
        }
    }
}

/* block_iq3_s (110 bytes): fp16 d | 64 bytes: low 8 bits of the grid index per 4 elements | 8 bytes: the 9th
 * index bits (bit k % 8 of byte k / 8 for index k) | 32 bytes of sign bits (bit e % 8 of byte e / 8 for
 * element e) | 4 bytes of 4-bit scales, one per 32 elements (low nibble first). */
static void unpack_iq3_s(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ3S;
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    u->d = rdh(b);
    no_min(u);
    for (int k = 0; k < 64; k++) {
        const int idx = qs[k] | (((qh[k / 8] >> (k % 8)) & 1) << 8);
        const int8_t *g = grid + 4 * idx;
        const uint8_t s = (uint8_t)(signs[k / 2] >> (4 * (k & 1)));
        for (int j = 0; j < 4; j++) u->q[4 * k + j] = (int8_t)((s >> j) & 1 ? -g[j] : g[j]);
    }
    for (int ib = 0; ib < 8; ib++) {
        const int16_t sc = (int16_t)(2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15) + 1);
        u->sc[2 * ib] = u->sc[2 * ib + 1] = sc;
    }
}

/* 8 IQ1 codes 8 * g + delta8 (g the -1/0/1 grid values, delta8 = +1 or -1) */
static inline void iq1_codes8(const int8_t *g, int delta8, int8_t *out) {
    for (int j = 0; j < 8; j++) out[j] = (int8_t)(8 * g[j] + delta8);
}

/* block_iq1_s (50 bytes): fp16 d | 32 bytes: low 8 bits of the grid index per 8 elements | 8 u16, one per 32
 * elements: bits 0-11 four 3-bit high index parts, bits 12-14 the scale, bit 15 the sign of the delta. */
static void unpack_iq1_s(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ1S;
    const uint8_t *qs = b + 2;
    u->d = rdh(b) * 0.125f;
    no_min(u);
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = rd16(b + 34 + 2 * ib);
        const int16_t sc = (int16_t)(2 * ((qh >> 12) & 7) + 1);
        const int delta8 = (qh & 0x8000) ? -1 : 1;
        u->sc[2 * ib] = u->sc[2 * ib + 1] = sc;
        for (int l = 0; l < 4; l++) {
            const int idx = qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
            iq1_codes8(grid + 8 * idx, delta8, u->q + 32 * ib + 8 * l);
        }
    }
}

/* block_iq1_m (56 bytes): 32 bytes: low 8 bits of the grid index per 8 elements | 16 bytes: per nibble (low
 * first, one per 8 elements) a 3-bit high index part and the sign of the delta (bit 3) | 4 u16: four 3-bit
 * scales each (one per 16 elements) in bits 0-11, and nibble k of the fp16 super-scale in the top nibble of
 * u16 k. */
static void unpack_iq1_m(const uint8_t *b, ublk_b *u) {
    const int8_t *grid = (const int8_t *)G_IQ1S; /* IQ1_M shares IQ1_S's code book */
    const uint8_t *qs = b, *qh = b + 32;
    uint16_t sw[4];
    for (int k = 0; k < 4; k++) sw[k] = rd16(b + 48 + 2 * k);
    const uint16_t dbits = (uint16_t)((sw[0] >> 12) | ((sw[1] >> 8) & 0x00F0) | ((sw[2] >> 4) & 0x0F00) |
                                      (sw[3] & 0xF000));
    u->d = f16_to_f32(dbits) * 0.125f;
    no_min(u);
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * ((sw[g / 4] >> (3 * (g % 4))) & 7) + 1);
    for (int i = 0; i < 32; i++) {
        const int nib = (qh[i / 2] >> (4 * (i & 1))) & 15;
        const int idx = qs[i] | ((nib & 7) << 8);
        iq1_codes8(grid + 8 * idx, (nib & 8) ? -1 : 1, u->q + 8 * i);
    }
}

/* base-3 digit m of a TQ1_0 byte (a fixed-point fraction of 3^5 or 3^4): ((byte * 3^m mod 256) * 3) >> 8 */
static inline int8_t tq1_digit(uint8_t v, int pow3) {
    const uint8_t x = (uint8_t)(v * pow3);
    return (int8_t)(((int)x * 3 >> 8) - 1);
}

/* block_tq1_0 (54 bytes): 48 bytes qs (5 digits each) | 4 bytes qh (4 digits each) | fp16 d. Digit m of
 * qs[j] (j < 32) is element 32 m + j, of qs[32 + j] (j < 16) element 160 + 16 m + j, of qh[j] element
 * 240 + 4 m + j; w = d * (digit - 1). */
static void unpack_tq1_0(const uint8_t *b, ublk_b *u) {
    static const int pow3[5] = {1, 3, 9, 27, 81};
    const uint8_t *qs = b, *qh = b + 48;
    u->d = rdh(b + 52);
    no_min(u);
    for (int g = 0; g < 16; g++) u->sc[g] = 1;
    for (int m = 0; m < 5; m++) {
        for (int j = 0; j < 32; j++) u->q[32 * m + j] = tq1_digit(qs[j], pow3[m]);
        for (int j = 0; j < 16; j++) u->q[160 + 16 * m + j] = tq1_digit(qs[32 + j], pow3[m]);
    }
    for (int m = 0; m < 4; m++)
        for (int j = 0; j < 4; j++) u->q[240 + 4 * m + j] = tq1_digit(qh[j], pow3[m]);
}

/* block_tq2_0 (66 bytes): 64 bytes of 2-bit codes | fp16 d. Element 128 c + 32 k + j is bits 2k.. of byte
 * 32 c + j; w = d * (code - 1). */
static void unpack_tq2_0(const uint8_t *b, ublk_b *u) {
    u->d = rdh(b + 64);
    no_min(u);
    for (int g = 0; g < 16; g++) u->sc[g] = 1;
    for (int c = 0; c < 2; c++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 32; j++)
                u->q[128 * c + 32 * k + j] = (int8_t)(((b[32 * c + j] >> (2 * k)) & 3) - 1);
}

DEFINE_MM_B(mm_iq2_xxs, unpack_iq2_xxs, 66)
DEFINE_MM_B(mm_iq2_xs, unpack_iq2_xs, 74)
DEFINE_MM_B(mm_iq2_s, unpack_iq2_s, 82)
DEFINE_MM_B(mm_iq3_xxs, unpack_iq3_xxs, 98)
DEFINE_MM_B(mm_iq3_s, unpack_iq3_s, 110)
DEFINE_MM_B(mm_iq1_s, unpack_iq1_s, 50)
DEFINE_MM_B(mm_iq1_m, unpack_iq1_m, 56)
DEFINE_MM_B(mm_tq1_0, unpack_tq1_0, 54)
DEFINE_MM_B(mm_tq2_0, unpack_tq2_0, 66)

static mm_fn iquant_mm(int t, int *fam, int *block, int *bytes) {
    mm_fn f;
    int nb, ok; /* ok: the code books the type reads have been handed in (kernels._set_tables) */
    switch (t) {
    case T_IQ2_XXS: f = mm_iq2_xxs; nb = 66; ok = G_IQ2XXS && G_KSIGNS; break;
    case T_IQ2_XS: f = mm_iq2_xs; nb = 74; ok = G_IQ2XS && G_KSIGNS; break;
    case T_IQ2_S: f = mm_iq2_s; nb = 82; ok = G_IQ2S != NULL; break;
    case T_IQ3_XXS: f = mm_iq3_xxs; nb = 98; ok = G_IQ3XXS && G_KSIGNS; break;
    case T_IQ3_S: f = mm_iq3_s; nb = 110; ok = G_IQ3S != NULL; break;
    case T_IQ1_S: f = mm_iq1_s; nb = 50; ok = G_IQ1S != NULL; break;
    case T_IQ1_M: f = mm_iq1_m; nb = 56; ok = G_IQ1S != NULL; break;
    case T_TQ1_0: f = mm_tq1_0; nb = 54; ok = 1; break;
    case T_TQ2_0: f = mm_tq2_0; nb = 66; ok = 1; break;
    default: return NULL;
    }
    if (!ok) return NULL;
    *fam = FAM_B;
    *block = QKK;
    *bytes = nb;
    return f;
}
