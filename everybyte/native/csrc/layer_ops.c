/* Two fused float32 model ops (in the codec library and the model-op library).
 *
 * add_rmsnorm: residual += x (when given), out = w * (r / sqrt(mean(r^2) + eps)), one pass a row
 * instead of seven torch ops. rope: the rotate-half RoPE of q and k heads read from strided rows
 * (the fused QKV output) into contiguous outputs, with the torch form's exact float steps
 * (x1 cos - x2 sin, x2 cos + x1 sin). Both matter most at decode, where a torch op's dispatch
 * costs more than its arithmetic.
 */
#include <math.h>

/* one row of n: r += x (r may be NULL), o = w * (r_or_x / sqrt(mean(^2) + eps)) */
static inline void rmsnorm_row(const float* xi, float* ri, const float* w, float* oi, int64_t n, float eps) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < n; j++) {
        float v = xi[j];
        if (ri) { v = v + ri[j]; ri[j] = v; }
        acc[j & 7] += v * v;
    }
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    const float* src = ri ? ri : xi;
    for (int64_t j = 0; j < n; j++) oi[j] = w[j] * (src[j] * inv);
}

void add_rmsnorm_f32(const float* x, float* r, const float* w, float* out, int64_t rows, int64_t n,
                     float eps, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) rmsnorm_row(x + i * n, r ? r + i * n : 0, w, out + i * n, n, eps);
}

/* one head of d: rotate-half RoPE with the cos (c) and sin (s) halves of its position's table row */
static inline void rope_head(const float* x, const float* c, const float* s, int64_t d, float* o) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        o[j] = x1 * c[j] - x2 * s[j];
        o[j + half] = x2 * c[j] + x1 * s[j];
    }
}

/* q_out [T, hq, d], k_out [T, hk, d] contiguous; source rows t at q + t * q_stride (hq heads of d)
   and k + t * k_stride; table rows [pos] = cos (d/2) then sin (d/2). */
void rope_f32(const float* q, int64_t q_stride, int64_t hq, const float* k, int64_t k_stride, int64_t hk,
              int64_t T, int64_t d, const float* table, const int64_t* pos, float* q_out, float* k_out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = table + pos[t] * d;
        for (int64_t h = 0; h < hq + hk; h++) {
            const float* x = h < hq ? q + t * q_stride + h * d : k + t * k_stride + (h - hq) * d;
            float* o = h < hq ? q_out + (t * hq + h) * d : k_out + (t * hk + h - hq) * d;
            rope_head(x, c, c + d / 2, d, o);
        }
    }
}

/* out[i, j] = silu(gu[i, j]) * gu[i, inter + j] for rows of [gate | up] (SiLU as x / (1 + e^-x)) */
static inline void silu_mul_row(const float* gu, int64_t inter, float* out) {
    for (int64_t j = 0; j < inter; j++) {
        const float g = gu[j];
        out[j] = g / (1.0f + expf(-g)) * gu[inter + j];
    }
}

void silu_mul_f32(const float* gu, int64_t rows, int64_t inter, float* out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) silu_mul_row(gu + i * 2 * inter, inter, out + i * inter);
}
