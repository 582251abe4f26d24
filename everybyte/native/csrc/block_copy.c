/* A strided byte-chunk copy (in the codec library, formats/cpu_kernels.py).
 *
 * Moving KV blocks between a tier's buffers and the device pool copies thousands of 1-2 KiB
 * chunks (one per layer field and block) whose bytes are not read again soon. Streaming
 * (non-temporal) stores skip the cache, so the CPU does not first read every destination line:
 * 1.5x a plain memcpy's speed on a 13 MB batch here, against 0.67x for torch's strided copy_.
 * Threads split the blocks; each thread fences its streaming stores before the call returns.
 */
#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

/* dst, src: [rows, n, chunk] bytes at the given row and block strides (chunks contiguous). */
void copy_chunks(uint8_t* dst, int64_t d_row, int64_t d_blk, const uint8_t* src, int64_t s_row, int64_t s_blk,
                 int64_t rows, int64_t n, int64_t chunk, int nt) {
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < n; b++)
            for (int64_t r = 0; r < rows; r++) {
                uint8_t* d = dst + r * d_row + b * d_blk;
                const uint8_t* s = src + r * s_row + b * s_blk;
#if defined(__AVX__)
                if (((uintptr_t)d & 31) == 0 && (chunk & 31) == 0) {
                    for (int64_t i = 0; i < chunk; i += 32)
                        _mm256_stream_si256((__m256i*)(d + i), _mm256_loadu_si256((const __m256i*)(s + i)));
                    continue;
                }
#elif defined(__SSE2__)
                if (((uintptr_t)d & 15) == 0 && (chunk & 15) == 0) {
                    for (int64_t i = 0; i < chunk; i += 16)
                        _mm_stream_si128((__m128i*)(d + i), _mm_loadu_si128((const __m128i*)(s + i)));
                    continue;
                }
#endif
                memcpy(d, s, chunk);
            }
#if defined(__AVX__) || defined(__SSE2__)
        _mm_sfence();
#endif
    }
}
