/* The fused NVFP4 block codec for CPU (formats/cpu_kernels.py builds and calls it).
 *
 * AVX-512 intrinsics where the compiler targets them (a transposing max tree for 16 block scales
 * at once, boundary-bucket lookup for the codes, a permute lookup for decoding), portable GCC
 * vector extensions otherwise; both give the torch reference's bytes (tests/test_nvfp4.py).
 */
#include <stdint.h>
#include <string.h>
#define CH 64                                /* blocks per chunk: 4 KiB of float32, stays in L1 */
typedef float vf __attribute__((vector_size(64)));            /* one block of 16 */
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef int64_t vl __attribute__((vector_size(64)));
typedef uint8_t v8b __attribute__((vector_size(8)));
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline vi sel(vi m, vi a, vi b) { return (m & a) | (~m & b); }
static float PAIRS[256][2];                  /* byte -> its two E2M1 values, low nibble first */

void init_tables(void) {
    static const float v[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
    for (int p = 0; p < 256; p++) { PAIRS[p][0] = v[p & 15]; PAIRS[p][1] = v[p >> 4]; }
}

#ifdef __AVX512F__
#include <immintrin.h>
static inline float block_amax(vf x) { return _mm512_reduce_max_ps(_mm512_abs_ps((__m512)x)); }

static inline __m512i max_pairs(__m512i a, __m512i b, __m512i lo, __m512i hi) {
    return _mm512_max_epi32(_mm512_permutex2var_epi32(a, lo, b), _mm512_permutex2var_epi32(a, hi, b));
}

/* 16 blocks at once: their |x| maxima in one vector (a transposing max tree), then the scales. */
static inline void scales16(const vf* x, const float* s, int64_t ss, uint8_t* scales, float* d) {
    const __m512i L1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i H1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i L2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i H2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i L3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i H3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i L4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i H4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_and_si512((__m512i)x[i], abs);
    for (int i = 0; i < 8; i++) a[i] = max_pairs(a[2 * i], a[2 * i + 1], L1, H1);
    for (int i = 0; i < 4; i++) a[i] = max_pairs(a[2 * i], a[2 * i + 1], L2, H2);
    for (int i = 0; i < 2; i++) a[i] = max_pairs(a[2 * i], a[2 * i + 1], L3, H3);
    __m512 vmax = _mm512_castsi512_ps(max_pairs(a[0], a[1], L4, H4));
    __m512 sk = ss ? _mm512_loadu_ps(s) : _mm512_set1_ps(s[0]);
    __m512 v = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sk, _mm512_setzero_ps(), _CMP_GT_OQ), vmax,
                                   _mm512_mul_ps(_mm512_set1_ps(6.0f), sk));
    __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFFF)),
                                 _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1)));
    __m512i code = _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(r, 23), _mm512_set1_epi32(120)), 3),
                                   _mm512_and_si512(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(7)));
    __m512i val = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFF00000));
    __m512 sub = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(512.0f)), _mm512_set1_ps(8388608.0f)),
                               _mm512_set1_ps(8388608.0f));
    __mmask16 small = _mm512_cmp_ps_mask(v, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    code = _mm512_mask_mov_epi32(code, small, _mm512_cvttps_epi32(sub));
    val = _mm512_mask_mov_epi32(val, small, _mm512_castps_si512(_mm512_mul_ps(sub, _mm512_set1_ps(0.001953125f))));
    __mmask16 sat = _mm512_cmp_ps_mask(v, _mm512_set1_ps(448.0f), _CMP_NLT_UQ);
    code = _mm512_mask_mov_epi32(code, sat, _mm512_set1_epi32(0x7E));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
    val = _mm512_mask_mov_epi32(val, sat, _mm512_castps_si512(_mm512_set1_ps(448.0f)));
    _mm_storeu_si128((__m128i*)scales, _mm512_cvtepi32_epi8(code));
    _mm512_storeu_ps(d, _mm512_mul_ps(_mm512_castsi512_ps(val), sk));
}

/* One block's codes. |x / d| is looked up by its exponent and top two mantissa bits (E2M1 bucket
   boundaries 0.25 .. 5 all fall on such edges); a value exactly on a boundary that rounds down
   (0.25, 1.25, 2.5, 5: ties to the even code) takes the code below. Plus the input's sign bit. */
static inline void codes16(vf xv, float dk, uint8_t* out) {
    const __m512i lut_lo = _mm512_setr_epi32(0, 17, 1, 1, 1, 1, 1, 2, 2, 2, 19, 3, 4, 4, 21, 5);
    const __m512i lut_hi = _mm512_setr_epi32(6, 6, 23, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7);
    __m512i xi = _mm512_castps_si512((__m512)xv);
    __m512i sign = _mm512_and_si512(_mm512_srai_epi32(xi, 28), _mm512_set1_epi32(8));
    __m512 y = _mm512_maskz_div_ps(dk > 0.0f ? 0xFFFF : 0, (__m512)xv, _mm512_set1_ps(dk));
    __m512i ab = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
    __m512i idx = _mm512_sub_epi32(_mm512_srli_epi32(ab, 21), _mm512_set1_epi32(499));
    idx = _mm512_min_epi32(_mm512_max_epi32(idx, _mm512_setzero_si512()), _mm512_set1_epi32(31));
    __m512i e = _mm512_permutex2var_epi32(lut_lo, idx, lut_hi);          /* code | 16 if its edge rounds down */
    __mmask16 down = _mm512_test_epi32_mask(e, _mm512_set1_epi32(16)) & _mm512_testn_epi32_mask(ab, _mm512_set1_epi32(0x1FFFFF));
    __m512i code = _mm512_and_si512(_mm512_mask_sub_epi32(e, down, e, _mm512_set1_epi32(1)), _mm512_set1_epi32(15));
    code = _mm512_or_si512(code, sign);
    __m512i q = _mm512_and_si512(_mm512_or_si512(code, _mm512_srli_epi64(code, 28)), _mm512_set1_epi64(0xFF));
    _mm_storel_epi64((__m128i*)out, _mm512_cvtepi64_epi8(q));   /* byte j = code[2j] | code[2j+1] << 4 */
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline __m256i lo8(vf x) { __m256i a; memcpy(&a, &x, 32); return a; }
static inline __m256i hi8(vf x) { __m256i a; memcpy(&a, (const char*)&x + 32, 32); return a; }

static inline float block_amax(vf x) {   /* as the portable form: max of the |x| bit patterns */
    const __m256i m = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i a = _mm256_max_epi32(_mm256_and_si256(lo8(x), m), _mm256_and_si256(hi8(x), m));
    __m128i b = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    return u2f((uint32_t)_mm_cvtsi128_si32(b));
}

/* The portable codes16 below, step for step, 8 lanes at a time. */
static inline __m256i codes8(__m256i xi, float dk) {
    __m256i code = _mm256_and_si256(_mm256_srai_epi32(xi, 28), _mm256_set1_epi32(8));
    if (!(dk > 0.0f)) return code;
    __m256i ab = _mm256_and_si256(_mm256_castps_si256(_mm256_div_ps(_mm256_castsi256_ps(xi), _mm256_set1_ps(dk))),
                                  _mm256_set1_epi32(0x7FFFFFFF));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(ab, _mm256_set1_epi32(0x1FFFFF)),
                                 _mm256_and_si256(_mm256_srai_epi32(ab, 22), _mm256_set1_epi32(1)));
    __m256i hi = _mm256_sub_epi32(_mm256_srai_epi32(r, 22), _mm256_set1_epi32(252));
    __m256i seven = _mm256_set1_epi32(7);
    hi = _mm256_blendv_epi8(hi, seven, _mm256_cmpgt_epi32(hi, seven));
    __m256 big = _mm256_set1_ps(8388608.0f);
    __m256 half = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(ab), _mm256_set1_ps(2.0f)), big), big);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3F800000), ab);
    return _mm256_or_si256(code, _mm256_blendv_epi8(hi, _mm256_cvttps_epi32(half), small));
}

static inline void codes16(vf xv, float dk, uint8_t* out) {
    uint32_t c[16];
    _mm256_storeu_si256((__m256i*)c, codes8(lo8(xv), dk));
    _mm256_storeu_si256((__m256i*)(c + 8), codes8(hi8(xv), dk));
    for (int j = 0; j < 8; j++)      /* the low byte of (int64)(c[2j] | c[2j+1] << 32) >> 28 | c[2j] */
        out[j] = (uint8_t)(c[2 * j] | (c[2 * j] >> 28) | (c[2 * j + 1] << 4));
}
#else
static inline float block_amax(vf x) {
    vi a = (vi)x & 0x7FFFFFFF, b;        /* |x| bit patterns order like the values */
    b = __builtin_shuffle(a, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}); a = sel(a > b, a, b);
    b = __builtin_shuffle(a, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}); a = sel(a > b, a, b);
    b = __builtin_shuffle(a, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}); a = sel(a > b, a, b);
    b = __builtin_shuffle(a, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}); a = sel(a > b, a, b);
    return u2f((uint32_t)a[0]);
}

/* One block's codes (portable form of the AVX-512 codes16 above). */
static inline void codes16(vf xv, float dk, uint8_t* out) {
    vi code = ((vi)xv >> 28) & 8;                                 /* the input's sign bit */
    if (dk > 0.0f) {
        vi ab = (vi)(xv / dk) & 0x7FFFFFFF;
        vi hi = ((ab + 0x1FFFFF + ((ab >> 22) & 1)) >> 22) - 252;  /* >= 1: keep one mantissa bit */
        hi = sel(hi > 7, (vi){} + 7, hi);
        vf half = ((vf)ab * 2.0f + 8388608.0f) - 8388608.0f;       /* < 1: steps of 0.5 */
        code |= sel(ab < 0x3F800000, __builtin_convertvector(half, vi), hi);
    }
    vl q = (vl)code;                                               /* lanes: code[2j] | code[2j+1] << 32 */
    v8b bytes = __builtin_convertvector((q | (q >> 28)) & 0xFF, v8b);
    memcpy(out, &bytes, 8);
}
#endif

/* Same IEEE float32 steps as the torch reference: sf = vmax / (6 s) -> E4M3 (nearest even,
   saturating at 448), d = float(sf8) * s, code = E2M1(x / d) (nearest, ties to the even code),
   sign bit = the input's sign bit. */
/* max |x| as a bit pattern (NaN > Inf > finite values, so non-finite input shows) */
uint32_t absmax_f32(const uint32_t* x, int64_t n, int nt) {
    uint32_t m = 0;
    #pragma omp parallel for num_threads(nt) reduction(max: m) schedule(dynamic, 1 << 16)
    for (int64_t i = 0; i < n; i++) { uint32_t a = x[i] & 0x7FFFFFFFu; m = a > m ? a : m; }
    return m;
}

uint32_t absmax_bf16(const uint16_t* x, int64_t n, int nt) {
    uint16_t m = 0;
    #pragma omp parallel for num_threads(nt) reduction(max: m) schedule(dynamic, 1 << 16)
    for (int64_t i = 0; i < n; i++) { uint16_t a = x[i] & 0x7FFFu; m = a > m ? a : m; }
    return (uint32_t)m << 16;
}

static inline uint8_t to_e4m3(float v, float* val) {   /* v >= 0 -> E4M3 byte, nearest even, saturating */
    if (!(v < 448.0f)) { *val = 448.0f; return v != v ? 0x7F : 0x7E; }
    if (v < 0.015625f) { float m = (v * 512.0f + 8388608.0f) - 8388608.0f; *val = m * 0.001953125f; return (uint8_t)m; }
    uint32_t r = f2u(v) + 0x7FFFFu + ((f2u(v) >> 20) & 1u);
    *val = u2f(r & 0xFFF00000u);
    return (uint8_t)((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}

static inline void quant_chunk(const vf* x, int n, const float* s, int64_t ss, uint8_t* out, uint8_t* scales) {
    float d[CH];
    int k0 = 0;
#ifdef __AVX512F__
    for (; k0 + 16 <= n; k0 += 16) scales16(x + k0, s + k0 * ss, ss, scales + k0, d + k0);
#endif
    for (int k = k0; k < n; k++) {
        float val, sk = s[k * ss], vmax = block_amax(x[k]);
        scales[k] = to_e4m3(sk > 0.0f ? vmax / (6.0f * sk) : 0.0f, &val);
        d[k] = val * sk;
    }
    for (int k = 0; k < n; k++) codes16(x[k], d[k], out + 8 * k);
}

void quantize_f32(const float* x, int64_t nb, const float* s, int64_t ss, uint8_t* out, uint8_t* scales, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 16)
    for (int64_t b = 0; b < nb; b += CH) {
        int n = nb - b < CH ? (int)(nb - b) : CH;
        if (((uintptr_t)(x + 16 * b) & 63) == 0) { quant_chunk((const vf*)(x + 16 * b), n, s + b * ss, ss, out + 8 * b, scales + b); continue; }
        vf v[CH];
        memcpy(v, x + 16 * b, 64 * (size_t)n);
        quant_chunk(v, n, s + b * ss, ss, out + 8 * b, scales + b);
    }
}

void quantize_bf16(const uint16_t* x, int64_t nb, const float* s, int64_t ss, uint8_t* out, uint8_t* scales, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 16)
    for (int64_t b = 0; b < nb; b += CH) {
        vf v[CH];
        int n = nb - b < CH ? (int)(nb - b) : CH;
        for (int k = 0; k < n; k++) {
            vh h;
            memcpy(&h, x + 16 * (b + k), 32);
            v[k] = (vf)(__builtin_convertvector(h, vi) << 16);
        }
        quant_chunk(v, n, s + b * ss, ss, out + 8 * b, scales + b);
    }
}

static inline void dequant_block(const uint8_t* p, float sc, float sb, float* v) {
#ifdef __AVX512F__
    __m512i w = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)p));      /* byte j in qword j */
    __m512i idx = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi64(15)), _mm512_slli_epi64(_mm512_srli_epi64(w, 4), 32));
    __m512 e2m1 = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
    __m512 r = _mm512_mul_ps(_mm512_mul_ps(_mm512_permutexvar_ps(idx, e2m1), _mm512_set1_ps(sc)), _mm512_set1_ps(sb));
    _mm512_storeu_ps(v, r);
#elif defined(__AVX2__)
    /* nibbles in order, magnitude by an 8-entry permute, the code's bit 3 moved to the sign bit */
    __m128i b = _mm_loadl_epi64((const __m128i*)p);
    __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    __m256 vsc = _mm256_set1_ps(sc), vsb = _mm256_set1_ps(sb);
    for (int h = 0; h < 2; h++) {
        __m256i code = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(c, 8) : c);
        __m256 x = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, code), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28)));
        _mm256_storeu_ps(v + 8 * h, _mm256_mul_ps(_mm256_mul_ps(x, vsc), vsb));
    }
#else
    for (int j = 0; j < 8; j++) memcpy(v + 2 * j, PAIRS[p[j]], 8);
    for (int i = 0; i < 16; i++) v[i] = (v[i] * sc) * sb;
#endif
}

static inline void dequant_block_bf16(const uint8_t* p, float sc, float sb, uint16_t* out) {
    vu u;
    dequant_block(p, sc, sb, (float*)&u);
    vh h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vh);       /* nearest even */
    memcpy(out, &h, 32);
}

void dequantize_f32(const uint8_t* packed, const uint8_t* scales, int64_t nb, const float* s, int64_t ss,
                    const float* e4m3, float* out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 1024)
    for (int64_t b = 0; b < nb; b++) dequant_block(packed + 8 * b, e4m3[scales[b]], s[b * ss], out + 16 * b);
}

void dequantize_bf16(const uint8_t* packed, const uint8_t* scales, int64_t nb, const float* s, int64_t ss,
                     const float* e4m3, uint16_t* out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 1024)
    for (int64_t b = 0; b < nb; b++) dequant_block_bf16(packed + 8 * b, e4m3[scales[b]], s[b * ss], out + 16 * b);
}
