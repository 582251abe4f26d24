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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


static float E4M3[256];          /* byte -> its value */
static float PAIR[256][2];       /* byte -> its two E2M1 values, low nibble first */
static int tables_ready;

static float e4m3_value(int b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 512.0f;   /* 2^(e-7), subnormal m/8 * 2^-6 */
    if ((b & 0x7F) == 0x7F) v = 0.0f;       /* NaN code: treated as an empty block */
    return (b & 0x80) ? -v : v;
}

void gemm_init(void) {
    static const float v[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
    if (tables_ready) return;
    for (int b = 0; b < 256; b++) {
        E4M3[b] = e4m3_value(b);
        PAIR[b][0] = v[b & 15];
        PAIR[b][1] = v[b >> 4];
    }
    tables_ready = 1;
}

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define NR 4
#define MR 4
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
/* one block of 16: codes -> values times the block scale, in one vector */
static inline void decode16(const uint8_t* q, float sc, vec* w) {
    static const float T[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
    const __m128i m = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadl_epi64((const __m128i*)q);
    __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    w[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), _mm512_loadu_ps(T)), _mm512_set1_ps(sc));
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define VW 8
#define NR 2                     /* 16 ymm registers: 8 accumulators, 4 weight vectors, x */
#define MR 4
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* codes -> twice their E2M1 value as int8 by one byte shuffle; the 1/2 goes into the scale */
static inline void decode16(const uint8_t* q, float sc, vec* w) {
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i b = _mm_loadl_epi64((const __m128i*)q);
    __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    __m128i v = _mm_shuffle_epi8(twice, c);
    __m256 s = _mm256_set1_ps(sc * 0.5f);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s);
}
#else
#define VW 16
#define NR 4
#define MR 2
typedef float vec __attribute__((vector_size(64)));
static inline vec vzero(void) { vec z = {0}; return z; }
static inline vec vload(const float* p) { vec v; memcpy(&v, p, 64); return v; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec a) { float s = 0; for (int i = 0; i < 16; i++) s += a[i]; return s; }
static inline void decode16(const uint8_t* q, float sc, vec* w) {
    for (int j = 0; j < 8; j++) { w[0][2 * j] = PAIR[q[j]][0] * sc; w[0][2 * j + 1] = PAIR[q[j]][1] * sc; }
}
#endif
#define NV (16 / VW)             /* vectors a block of 16 */

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

/* x: M x K float32 (or bfloat16 when x_bf16), out: M x N float32 (or bfloat16), N = sum(rows).
 * Segment i: codes q[i], scales s[i] (addresses), rows[i] rows, decode-form scale gs[i].
 * bias: N floats or NULL. nt: threads. */
void nvfp4_linear(const void* x_in, int x_bf16, int64_t M, int64_t K, int64_t nseg, const int64_t* q,
                  const int64_t* s, const float* gs, const int64_t* rows, const float* bias, void* out,
                  int out_bf16, int nt) {
    int64_t N = 0, tiles = 0;
    for (int64_t i = 0; i < nseg; i++) { N += rows[i]; tiles += (rows[i] + NR - 1) / NR; }
    const float* x = (const float*)x_in;
    float* xf = NULL;
    if (x_bf16) {
        xf = (float*)malloc(sizeof(float) * M * K);
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(((const uint16_t*)x_in)[i]);
        x = xf;
    }
    float* res = out_bf16 ? (float*)malloc(sizeof(float) * M * N) : (float*)out;
    (void)nt;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t seg = 0, t0 = 0, n0 = 0;               /* the segment of tile t, its first tile and row */
        while ((rows[seg] + NR - 1) / NR <= t - t0) { t0 += (rows[seg] + NR - 1) / NR; n0 += rows[seg]; seg++; }
        int64_t r0 = (t - t0) * NR;
        int nr = (int)(rows[seg] - r0 < NR ? rows[seg] - r0 : NR);
        const uint8_t* qs = (const uint8_t*)(intptr_t)q[seg] + r0 * (K / 2);
        const uint8_t* ss = (const uint8_t*)(intptr_t)s[seg] + r0 * (K / 16);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            float* d = res + m0 * N + n0 + r0;
            tile_any(qs, ss, K, nr, x + m0 * K, mr, d, N);
            for (int m = 0; m < mr; m++)
                for (int r = 0; r < nr; r++)
                    d[m * N + r] = d[m * N + r] * gs[seg] + (bias ? bias[n0 + r0 + r] : 0.0f);
        }
    }
    if (out_bf16) {
        for (int64_t i = 0; i < M * N; i++) ((uint16_t*)out)[i] = f32_to_bf16(res[i]);
        free(res);
    }
    free(xf);
}
