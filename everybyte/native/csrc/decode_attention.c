/* Decode attention over an NVFP4 KV pool: one new query token per sequence, every query head of
 * a KV group at once, in one call for the whole batch (the torch path takes ~20 ops a layer).
 *
 * Per (sequence b, KV head h): the group's queries (rotated by the format's Hadamard matrix H and
 * scaled), scores against every key t < ctx[b], softmax in float32, the weighted sum of values,
 * rotated back by H. Keys and values come from the pool (block table row b: codes [bs, Hkv, D/2],
 * scales [bs, Hkv, D/16] a block, times the layer's K or V scale), except positions from
 * own[b] * span on, which come unquantized from the sequence's exact-tail slot (when slot[b] >= 0).
 * Same math as gather + dequantize + SDPA; only the summation order differs.
 */
#include <math.h>

static inline void load_row(const void* p, int bf16, int64_t n, float* out) {
    if (bf16) for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t*)p)[i]);
    else memcpy(out, p, sizeof(float) * n);
}

/* one KV head's D values of token `off` in pool block `blk` (or the tail row), as floats */
static inline void kv_row(const uint8_t* data, const uint8_t* scales, int64_t blk, int64_t off, int64_t hkv,
                          int64_t h, int64_t D, int64_t bs, float s, float* out) {
    int64_t row = (blk * bs + off) * hkv + h;
    const uint8_t* q = data + row * (D / 2);
    const uint8_t* sc = scales + row * (D / 16);
    for (int64_t j = 0; j < D / 16; j++) {
        vec w[NV];
        decode16(q + 8 * j, E4M3[sc[j]] * s, w);
        memcpy(out + 16 * j, w, 64);
    }
}

static inline float dot(const float* a, const float* b, int64_t n) {
    vec acc = vzero();
    for (int64_t i = 0; i < n; i += VW) acc = vfma(vload(a + i), vload(b + i), acc);
    return vsum(acc);
}

/* out = x @ H, D a multiple of 16 (at most 256): rows of H scaled by x[i] and summed in vectors */
static void rotate(const float* x, const float* H, int64_t D, float* out) {
    vec acc[256 / VW];
    const int64_t nv = D / VW;
    for (int64_t j = 0; j < nv; j++) acc[j] = vzero();
    for (int64_t i = 0; i < D; i++) {
        vec xi = vbroadcast(x[i]);
        for (int64_t j = 0; j < nv; j++) acc[j] = vfma(xi, vload(H + i * D + j * VW), acc[j]);
    }
    for (int64_t j = 0; j < nv; j++) vstore(out + j * VW, acc[j]);
}

/* out[i] = x[i] @ H for n rows of D (the KV format's rotation, as decode_step.c does it) */
void rotate_rows_f32(const float* x, int64_t n, const float* H, int64_t D, float* out, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; i++) rotate(x + i * D, H, D, out + i * D);
}

/* acc += w * row over D values */
static inline void axpy(float w, const float* row, int64_t D, float* acc) {
    vec wv = vbroadcast(w);
    for (int64_t i = 0; i < D; i += VW) vstore(acc + i, vfma(wv, vload(row + i), vload(acc + i)));
}

/* One layer's pool and the step's tables, as decode attention reads them. */
typedef struct {
    int bf16;                                /* q, out and the tails in bfloat16 (else float32) */
    int64_t hq, hkv, D, bs, max_blocks, span;
    const uint8_t *kd, *ks, *vd, *vs;
    float k_scale, v_scale;
    const int64_t *tables, *ctx, *slot, *own;
    const void *tail_k, *tail_v;
    const float* H;
    float scale;
} attn_args;

/* The G = hq / hkv query heads of KV head h of sequence b: q_in, out [hq, D] rows of that sequence. */
static void attend_group(const attn_args* a, int64_t b, int64_t h, const void* q_in, void* out) {
    const int64_t G = a->hq / a->hkv, D = a->D, n = a->ctx[b], hkv = a->hkv, bf16 = a->bf16;
    const int64_t tail0 = a->slot[b] >= 0 ? a->own[b] * a->span : n;
    float* p = (float*)malloc(sizeof(float) * (G * n + G * D * 3 + D));
    float *qr = p + G * n, *acc = qr + G * D, *tmp = acc + G * D, *row = tmp + G * D;
    for (int64_t g = 0; g < G; g++) {
        const int64_t qi = (h * G + g) * D;
        load_row(bf16 ? (const void*)((const uint16_t*)q_in + qi) : (const void*)((const float*)q_in + qi), bf16, D, tmp);
        if (a->H) rotate(tmp, a->H, D, qr + g * D); else memcpy(qr + g * D, tmp, sizeof(float) * D);
        for (int64_t i = 0; i < D; i++) qr[g * D + i] *= a->scale;
    }
    for (int pass = 0; pass < 2; pass++) {           /* 0: scores, 1: weighted values */
        const uint8_t *d = pass ? a->vd : a->kd, *sc = pass ? a->vs : a->ks;
        const void* tail = pass ? a->tail_v : a->tail_k;
        const float s = pass ? a->v_scale : a->k_scale;
        for (int64_t t = 0; t < n; t++) {
            if (t >= tail0) {
                int64_t at = ((a->slot[b] * a->span + (t - tail0)) * hkv + h) * D;
                load_row(bf16 ? (const void*)((const uint16_t*)tail + at) : (const void*)((const float*)tail + at),
                         bf16, D, row);
            } else {
                kv_row(d, sc, a->tables[b * a->max_blocks + t / a->bs], t % a->bs, hkv, h, D, a->bs, s, row);
            }
            if (!pass) {
                for (int64_t g = 0; g < G; g++) p[g * n + t] = dot(qr + g * D, row, D);
            } else {
                for (int64_t g = 0; g < G; g++) axpy(p[g * n + t], row, D, acc + g * D);
            }
        }
        if (!pass) {                                  /* softmax over each query head's scores */
            for (int64_t g = 0; g < G; g++) {
                float m = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < n; t++) m = fmaxf(m, p[g * n + t]);
                for (int64_t t = 0; t < n; t++) { p[g * n + t] = expf(p[g * n + t] - m); sum += p[g * n + t]; }
                for (int64_t t = 0; t < n; t++) p[g * n + t] /= sum;
            }
            memset(acc, 0, sizeof(float) * G * D);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float* res = tmp;
        if (a->H) rotate(acc + g * D, a->H, D, res); else res = acc + g * D;
        const int64_t oi = (h * G + g) * D;
        if (bf16) for (int64_t i = 0; i < D; i++) ((uint16_t*)out)[oi + i] = f32_to_bf16(res[i]);
        else memcpy((float*)out + oi, res, sizeof(float) * D);
    }
    free(p);
}

/* D > 256 (no such model here) would overflow rotate's accumulators: the caller checks */
void nvfp4_decode_attention(const void* q_in, void* out, int bf16, int64_t B, int64_t hq, int64_t hkv, int64_t D,
                            const uint8_t* kd, const uint8_t* ks, const uint8_t* vd, const uint8_t* vs,
                            float k_scale, float v_scale, int64_t bs, const int64_t* tables, int64_t max_blocks,
                            const int64_t* ctx, const void* tail_k, const void* tail_v, const int64_t* slot,
                            const int64_t* own, int64_t span, const float* H, float scale, int nt) {
    const attn_args a = {bf16, hq, hkv, D, bs, max_blocks, span, kd, ks, vd, vs, k_scale, v_scale, tables, ctx,
                         slot, own, tail_k, tail_v, H, scale};
    const int64_t es = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t task = 0; task < B * hkv; task++) {
        const int64_t b = task / hkv, h = task % hkv;
        attend_group(&a, b, h, (const char*)q_in + b * hq * D * es, (char*)out + b * hq * D * es);
    }
}
