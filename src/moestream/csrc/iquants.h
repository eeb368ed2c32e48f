/* Tile kernels of the 1-3 bit i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
 * types (TQ1_0, TQ2_0), included by moekern.c after the family A/B machinery.
 *
 * iquant_mm(t, &family, &block, &block_bytes): the tile kernel of ggml type t, or NULL when the kernels do
 * not compute t (Python then falls back to dequantize-then-matmul for it).
 */

static mm_fn iquant_mm(int t, int *fam, int *block, int *bytes) {
    (void)t; (void)fam; (void)block; (void)bytes;
    return NULL;
}
