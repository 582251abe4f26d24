/* Two fused float32 model ops and SiLU x up (in the model-op library, models/native_ops.py).
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

/* e^x for 16 lanes, Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial;
 * within 2 ulp): the same float steps for every lane and every row count, so SiLU does not depend
 * on the batch (torch's vectorised exp takes another path for a row tail) */
static inline vf exp16(vf x) {
    const vf hi = (vf){0} + 88.3762626647949f, lo = (vf){0} - 87.3365447505531f;
    x = (vf)sel((vi)(x > hi), (vi)hi, (vi)sel((vi)(x < lo), (vi)lo, (vi)x));
    const vf magic = (vf){0} + 12582912.0f;                  /* 1.5 * 2^23: rounds to an integer */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    vf y = p * (r * r) + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

/* out[j] = silu(gu[j]) * gu[inter + j] for one row of [gate | up] (SiLU as x / (1 + e^-x)) */
static inline void silu_mul_row(const float* gu, int64_t inter, float* out) {
    for (int64_t j = 0; j < inter; j += 16) {
        const int64_t n = inter - j < 16 ? inter - j : 16;
        vf g = {0}, u = {0};
        memcpy(&g, gu + j, 4 * n);
        memcpy(&u, gu + inter + j, 4 * n);
        vf y = g / (1.0f + exp16(-g)) * u;
        memcpy(out + j, &y, 4 * n);
    }
}

void silu_mul_f32(const float* gu, int64_t rows, int64_t inter, float* out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) silu_mul_row(gu + i * 2 * inter, inter, out + i * inter);
}
