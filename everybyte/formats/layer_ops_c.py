"""C source of two fused float32 model ops (appended to the CPU kernel library by `cpu_kernels`).

add_rmsnorm: residual += x (when given), out = w * (r / sqrt(mean(r^2) + eps)), one pass a row
instead of seven torch ops. rope: the rotate-half RoPE of q and k heads read from strided rows
(the fused QKV output) into contiguous outputs, with the torch form's exact float steps
(x1 cos - x2 sin, x2 cos + x1 sin). Both matter most at decode, where a torch op's dispatch
costs more than its arithmetic.
"""

LAYER_SOURCE = r"""
#include <math.h>

void add_rmsnorm_f32(const float* x, float* r, const float* w, float* out, int64_t rows, int64_t n,
                     float eps, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float* xi = x + i * n;
        float* ri = r ? r + i * n : 0;
        float* oi = out + i * n;
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
}

/* q_out [T, hq, d], k_out [T, hk, d] contiguous; source rows t at q + t * q_stride (hq heads of d)
   and k + t * k_stride; table rows [pos] = cos (d/2) then sin (d/2). */
void rope_f32(const float* q, int64_t q_stride, int64_t hq, const float* k, int64_t k_stride, int64_t hk,
              int64_t T, int64_t d, const float* table, const int64_t* pos, float* q_out, float* k_out, int nt) {
    int64_t half = d / 2;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = table + pos[t] * d;
        const float* s = c + half;
        for (int64_t h = 0; h < hq + hk; h++) {
            const float* x = h < hq ? q + t * q_stride + h * d : k + t * k_stride + (h - hq) * d;
            float* o = h < hq ? q_out + (t * hq + h) * d : k_out + (t * hk + h - hq) * d;
            for (int64_t j = 0; j < half; j++) {
                float x1 = x[j], x2 = x[j + half];
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + half] = x2 * c[j] + x1 * s[j];
            }
        }
    }
}
"""
