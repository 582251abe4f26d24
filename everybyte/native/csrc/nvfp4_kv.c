/* The NVFP4 KV cache kernels (after nvfp4_codec.c in one translation unit; formats/cpu_kernels.py).
 *
 * kv_write: each new token's K (or V) blocks of 16 are encoded with the best of several block
 * scales (least squared error, first best on ties) and stored straight into the pool's slots.
 * kv_gather: the blocks of a list of pool block ids dequantized into one contiguous tensor.
 * Both take the same IEEE float32 steps as the torch reference in formats.nvfp4_kv (the squared
 * error summed as a halving tree), so their bytes are the reference's (tests/test_nvfp4_kv.py).
 */
#ifdef __AVX2__
#include <immintrin.h>
#endif
static inline float block_err(vf x, const uint8_t* p, float d) {   /* sum (E2M1(code) * d - x)^2 */
#ifdef __AVX512F__
    __m512i w = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)p));
    __m512i idx = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi64(15)), _mm512_slli_epi64(_mm512_srli_epi64(w, 4), 32));
    __m512 e2m1 = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
    __m512 e = _mm512_sub_ps(_mm512_mul_ps(_mm512_permutexvar_ps(idx, e2m1), _mm512_set1_ps(d)), (__m512)x);
    e = _mm512_mul_ps(e, e);
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(e), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
#elif defined(__AVX2__)
    /* codes -> E2M1 magnitudes by an 8-entry permute (vpermps reads the low 3 bits, so the sign
       bit drops out); (|v| d - |x|)^2 equals (v d - x)^2 exactly since v and x share the sign */
    __m128i b = _mm_loadl_epi64((const __m128i*)p);
    __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), dd = _mm256_set1_ps(d);
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 xlo, xhi;
    memcpy(&xlo, &x, 32);
    memcpy(&xhi, (const float*)&x + 8, 32);
    __m256 lo = _mm256_sub_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(mag, _mm256_cvtepu8_epi32(c)), dd), _mm256_and_ps(xlo, nosign));
    __m256 hi = _mm256_sub_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(mag, _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8))), dd), _mm256_and_ps(xhi, nosign));
    __m256 h = _mm256_add_ps(_mm256_mul_ps(lo, lo), _mm256_mul_ps(hi, hi));     /* tree: [i] + [i + 8] */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
#else
    float sq[16];
    for (int j = 0; j < 8; j++) {
        float a = PAIRS[p[j]][0] * d - x[2 * j], b = PAIRS[p[j]][1] * d - x[2 * j + 1];
        sq[2 * j] = a * a;
        sq[2 * j + 1] = b * b;
    }
    for (int w = 8; w >= 1; w >>= 1)
        for (int i = 0; i < w; i++) sq[i] = sq[i] + sq[i + w];
    return sq[0];
#endif
}

static inline void best_block(vf x, float s, const float* divs, int nd, uint8_t* out, uint8_t* scale) {
    float vmax = block_amax(x), best = 0.0f;
    for (int c = 0; c < nd; c++) {
        float val;
        uint8_t sc = to_e4m3(s > 0.0f ? vmax / (divs[c] * s) : 0.0f, &val), p[8];
        float d = val * s;
        codes16(x, d, p);
        float e = block_err(x, p, d);
        if (c == 0 || e < best) { best = e; memcpy(out, p, 8); *scale = sc; }
    }
}

/* x: T tokens of bpt blocks of 16 (float32, or bfloat16 when bf16); token t goes to pool slot
   slots[t] (skipped when < 0). */
void kv_write(const void* x, int bf16, int64_t T, int64_t bpt, const int64_t* slots, float s, const float* divs, int nd, uint8_t* data, uint8_t* scales, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t j = 0; j < bpt; j++) {
            vf v;
            if (bf16) {
                vh h;
                memcpy(&h, (const uint16_t*)x + 16 * (t * bpt + j), 32);
                v = (vf)(__builtin_convertvector(h, vi) << 16);
            } else {
                memcpy(&v, (const float*)x + 16 * (t * bpt + j), 64);
            }
            best_block(v, s, divs, nd, data + 8 * (slot * bpt + j), scales + slot * bpt + j);
        }
    }
}

/* out[i] = the per 16-value blocks of pool block ids[i], dequantized (float32, or bfloat16). */
void kv_gather(const uint8_t* data, const uint8_t* scales, const int64_t* ids, int64_t n, int64_t per,
               float s, const float* e4m3, void* out, int bf16, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t* p = data + 8 * ids[i] * per;
        const uint8_t* sc = scales + ids[i] * per;
        for (int64_t j = 0; j < per; j++) {
            if (bf16) dequant_block_bf16(p + 8 * j, e4m3[sc[j]], s, (uint16_t*)out + 16 * (i * per + j));
            else dequant_block(p + 8 * j, e4m3[sc[j]], s, (float*)out + 16 * (i * per + j));
        }
    }
}
