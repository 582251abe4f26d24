/* Fused NVFP4-weight linear layer for small batches: out[M, N] = x[M, K] @ W^T (+ bias).
 *
 * W is one or more segments of rows (a fused q/k/v or gate/up projection keeps each part's own
 * tensors and global scale, so memory-mapped checkpoint tensors are used in place). Each segment:
 * packed E2M1 codes [rows, K/2] (low nibble first), E4M3 block scales [rows, K/16] and one float32
 * decode-form scale. Codes and scales are decoded in registers, multiplied in float32, and summed
 * in float32: per row, sum_b (E2M1 * e4m3[b]) . x, times the segment's scale at the end.
 *
 * Tiles: NR weight rows x MR activation rows, the weight rows' bytes (NR * (K/2 + K/16)) stay in
 * L1 while every activation tile passes over them. Threads split the output rows.
 * AVX-512F, AVX2 or portable C, chosen by what the compiler targets (-march=native).
 */
/* dst[m][r] = sum over the K/16 blocks of nr weight rows (q, s: their first bytes) times mr
 * activation rows; inlined with constant nr, mr for full tiles so the accumulators stay in registers */
static inline __attribute__((always_inline)) void tile(const uint8_t* q, const uint8_t* s, int64_t K, int nr,
                                                       const float* x, int mr, float* dst, int64_t ldd) {
    vec acc[NR][MR];
    for (int r = 0; r < nr; r++) for (int m = 0; m < mr; m++) acc[r][m] = vzero();
    const int64_t nb = K / 16, qs = K / 2;
    for (int64_t b = 0; b < nb; b++) {
        vec w[NR][NV];
        for (int r = 0; r < nr; r++) decode16(q + r * qs + 8 * b, E4M3[s[r * nb + b]], w[r]);
        for (int m = 0; m < mr; m++) {
            const float* xm = x + m * K + 16 * b;
            for (int v = 0; v < NV; v++) {
                vec xv = vload(xm + v * VW);
                for (int r = 0; r < nr; r++) acc[r][m] = vfma(w[r][v], xv, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < nr; r++) for (int m = 0; m < mr; m++) dst[m * ldd + r] = vsum(acc[r][m]);
}

static void tile_any(const uint8_t* q, const uint8_t* s, int64_t K, int nr, const float* x, int mr, float* dst,
                     int64_t ldd) {
    if (nr == NR && mr == MR) tile(q, s, K, NR, x, MR, dst, ldd);
    else if (nr == NR && mr == 1) tile(q, s, K, NR, x, 1, dst, ldd);
    else if (nr == NR && mr == 2) tile(q, s, K, NR, x, 2, dst, ldd);
    else tile(q, s, K, nr, x, mr, dst, ldd);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_DOT 1
/* bfloat16 activations as they are: two blocks of weights (E2M1 x E4M3 has at most 6 significant
 * bits, so exact in bf16) against 32 bf16 activations in one vdpbf16ps (float32 sums), twice the
 * multiply-adds of an fp32 FMA an instruction */
static inline __attribute__((always_inline)) void tile_bf16(const uint8_t* q, const uint8_t* s, int64_t K, int nr,
                                                            const uint16_t* x, int mr, float* dst, int64_t ldd) {
    __m512 acc[NR][MR];
    for (int r = 0; r < nr; r++) for (int m = 0; m < mr; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t nb = K / 16, qs = K / 2;
    for (int64_t b = 0; b < nb; b += 2) {
        __m512bh w[NR];
        for (int r = 0; r < nr; r++) {
            vec lo, hi;
            decode16(q + r * qs + 8 * b, E4M3[s[r * nb + b]], &lo);
            decode16(q + r * qs + 8 * (b + 1), E4M3[s[r * nb + b + 1]], &hi);
            w[r] = _mm512_cvtne2ps_pbh(hi, lo);
        }
        for (int m = 0; m < mr; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + m * K + 16 * b));
            for (int r = 0; r < nr; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
        }
    }
    for (int r = 0; r < nr; r++) for (int m = 0; m < mr; m++) dst[m * ldd + r] = _mm512_reduce_add_ps(acc[r][m]);
}

static void tile_any_bf16(const uint8_t* q, const uint8_t* s, int64_t K, int nr, const uint16_t* x, int mr,
                          float* dst, int64_t ldd) {
    if (nr == NR && mr == MR) tile_bf16(q, s, K, NR, x, MR, dst, ldd);
    else if (nr == NR && mr == 1) tile_bf16(q, s, K, NR, x, 1, dst, ldd);
    else tile_bf16(q, s, K, nr, x, mr, dst, ldd);
}
#else
#define BF16_DOT 0
static void tile_any_bf16(const uint8_t* q, const uint8_t* s, int64_t K, int nr, const uint16_t* x, int mr,
                          float* dst, int64_t ldd) { (void)q; (void)s; (void)K; (void)nr; (void)x; (void)mr; (void)dst; (void)ldd; }
#endif

/* A packed weight as the kernels take it: nseg segments of rows, each with its codes q[i] and
 * scales s[i] (addresses), rows[i] rows and decode-form scale gs[i]; bias: N floats or NULL. */
typedef struct {
    int64_t nseg;
    const int64_t *q, *s;
    const float* gs;
    const int64_t* rows;
    const float* bias;
} nvfp4_weight;

static int64_t weight_tiles(const nvfp4_weight* w, int64_t* N) {
    int64_t tiles = 0;
    *N = 0;
    for (int64_t i = 0; i < w->nseg; i++) { *N += w->rows[i]; tiles += (w->rows[i] + NR - 1) / NR; }
    return tiles;
}

/* output tile t (up to NR rows of one segment) for all M activation rows: x float32, or xb
 * bfloat16 taken by the bf16 dot products when not NULL; res [M, N] float32 */
static void linear_tile(const nvfp4_weight* w, int64_t K, int64_t N, int64_t t, const float* x, const uint16_t* xb,
                        int64_t M, float* res) {
    int64_t seg = 0, t0 = 0, n0 = 0;               /* the segment of tile t, its first tile and row */
    while ((w->rows[seg] + NR - 1) / NR <= t - t0) { t0 += (w->rows[seg] + NR - 1) / NR; n0 += w->rows[seg]; seg++; }
    int64_t r0 = (t - t0) * NR;
    int nr = (int)(w->rows[seg] - r0 < NR ? w->rows[seg] - r0 : NR);
    const uint8_t* qs = (const uint8_t*)(intptr_t)w->q[seg] + r0 * (K / 2);
    const uint8_t* ss = (const uint8_t*)(intptr_t)w->s[seg] + r0 * (K / 16);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int mr = (int)(M - m0 < MR ? M - m0 : MR);
        float* d = res + m0 * N + n0 + r0;
        if (xb) tile_any_bf16(qs, ss, K, nr, xb + m0 * K, mr, d, N);
        else tile_any(qs, ss, K, nr, x + m0 * K, mr, d, N);
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++)
                d[m * N + r] = d[m * N + r] * w->gs[seg] + (w->bias ? w->bias[n0 + r0 + r] : 0.0f);
    }
}

/* x: M x K float32 (or bfloat16 when x_bf16), out: M x N float32 (or bfloat16), N = sum(rows);
 * the weight's fields as nvfp4_weight's. nt: threads. */
void nvfp4_linear(const void* x_in, int x_bf16, int64_t M, int64_t K, int64_t nseg, const int64_t* q,
                  const int64_t* s, const float* gs, const int64_t* rows, const float* bias, void* out,
                  int out_bf16, int nt) {
    const nvfp4_weight w = {nseg, q, s, gs, rows, bias};
    int64_t N;
    const int64_t tiles = weight_tiles(&w, &N);
    const float* x = (const float*)x_in;
    float* xf = NULL;
    /* bf16 dot products on bf16 x: twice the multiply-adds an instruction, which pays from batches
       of more than MR rows (measured); smaller ones are bound by decoding, not by multiply-adds */
    const int dot16 = BF16_DOT && x_bf16 && K % 32 == 0 && M > MR;
    if (x_bf16 && !dot16) {
        xf = (float*)malloc(sizeof(float) * M * K);
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(((const uint16_t*)x_in)[i]);
        x = xf;
    }
    float* res = out_bf16 ? (float*)malloc(sizeof(float) * M * N) : (float*)out;
    (void)nt;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) linear_tile(&w, K, N, t, x, dot16 ? (const uint16_t*)x_in : NULL, M, res);
    if (out_bf16) {
        for (int64_t i = 0; i < M * N; i++) ((uint16_t*)out)[i] = f32_to_bf16(res[i]);
        free(res);
    }
    free(xf);
}
