/* Shared by the NVFP4 kernels (nvfp4_gemm.c, decode_attention.c): byte tables, bf16 conversion,
 * and one vector type `vec` with decode16(), which turns one 16-value block (8 bytes of codes
 * and its block scale) into 16 floats in NV vectors of VW lanes: AVX-512F, AVX2 or portable C,
 * chosen by what the compiler targets (-march=native). */
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

void nvfp4_init(void) {
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
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vbroadcast(float f) { return _mm512_set1_ps(f); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
/* one block of 16: codes -> values times the block scale, in one vector */
static inline void decode16(const uint8_t* q, float sc, vec* w) {
    static const float T[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
#if defined(__AVX512VBMI__)
    /* the 8 code bytes in every qword; one multishift moves nibble i to the low bits of dword i
       (vpermps reads only those 4 bits, so the rest may hold anything) */
    const __m512i at = _mm512_set_epi8(0, 0, 0, 60, 0, 0, 0, 56, 0, 0, 0, 52, 0, 0, 0, 48, 0, 0, 0, 44, 0, 0, 0, 40,
                                       0, 0, 0, 36, 0, 0, 0, 32, 0, 0, 0, 28, 0, 0, 0, 24, 0, 0, 0, 20, 0, 0, 0, 16,
                                       0, 0, 0, 12, 0, 0, 0, 8, 0, 0, 0, 4, 0, 0, 0, 0);
    int64_t bits;
    memcpy(&bits, q, 8);
    __m512i idx = _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(bits));
    w[0] = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_loadu_ps(T)), _mm512_set1_ps(sc));
    return;
#endif
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
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vbroadcast(float f) { return _mm256_set1_ps(f); }
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
static inline void vstore(float* p, vec v) { memcpy(p, &v, 64); }
static inline vec vbroadcast(float f) { vec v; for (int i = 0; i < 16; i++) v[i] = f; return v; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec a) { float s = 0; for (int i = 0; i < 16; i++) s += a[i]; return s; }
static inline void decode16(const uint8_t* q, float sc, vec* w) {
    for (int j = 0; j < 8; j++) { w[0][2 * j] = PAIR[q[j]][0] * sc; w[0][2 * j + 1] = PAIR[q[j]][1] * sc; }
}
#endif
#define NV (16 / VW)             /* vectors a block of 16 */

