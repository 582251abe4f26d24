/* A whole decode step of a LLaMA-family decoder in one call: every layer's add+RMSNorm, fused
 * QKV projection, RoPE, the KV write into the NVFP4 pool (Hadamard-rotated, best-of-divisors block
 * scales) and the exact tail, decode attention, output projection, gate/up projection, SiLU * up
 * and down projection, then the final norm. One OpenMP team for the whole step, a barrier between
 * phases, instead of ~15 torch ops and ctypes calls a layer (models/decode_step.py).
 *
 * Each phase is the function the per-op path calls (linear_tile, rmsnorm_row, rope_head,
 * best_block, attend_group, silu_mul_row, rotate), so the result is theirs to the bit: the per-op
 * path takes the same C rotation and SiLU on float32 CPU tensors. Needs float32 activations,
 * NVFP4 weights, one new token per sequence.
 */

typedef struct {
    nvfp4_weight qkv, o, gate_up, down;
    const float *in_norm, *post_norm;
    uint8_t *kd, *ks, *vd, *vs;          /* this layer's pool tensors: codes and block scales of K, V */
    float k_scale, v_scale;
    float *tail_k, *tail_v;              /* [slots, span, hkv, D] float32, or NULL */
} step_layer;

typedef struct {
    int64_t B, hidden, hq, hkv, D, inter, bs, max_blocks, span, nd;
    float eps, attn_scale;
    const float *rope, *H, *divs, *final_norm;   /* H: D x D rotation or NULL */
    const int64_t* no_tail;                      /* B times -1: layers without tails */
    const int64_t *pos, *slots, *tables, *ctx, *tail_slot, *tail_own;  /* tail slot -1: none */
} step_args;

static void write_kv_head(const float* x, float s, const step_args* a, uint8_t* data, uint8_t* scales, int64_t slot,
                          int64_t h) {
    const int64_t nb = a->D / 16, bpt = a->hkv * nb;
    for (int64_t j = 0; j < nb; j++) {
        vf v;
        memcpy(&v, x + 16 * j, 64);
        best_block(v, s, a->divs, (int)a->nd, data + 8 * (slot * bpt + h * nb + j), scales + slot * bpt + h * nb + j);
    }
}

/* token b, KV head h: RoPE K and the group's queries, rotate K and V, store them (pool slot and
 * exact tail), then attend */
static void attention_task(const step_args* a, const step_layer* L, const attn_args* at, const float* qkv,
                           int64_t b, int64_t h, float* q_rope, float* out) {
    const int64_t D = a->D, G = a->hq / a->hkv, n_qkv = (a->hq + 2 * a->hkv) * D;
    const float* row = qkv + b * n_qkv;
    const float* c = a->rope + a->pos[b] * D;
    float k[256], kr[256], vr[256];
    rope_head(row + (a->hq + h) * D, c, c + D / 2, D, k);
    const float* v = row + (a->hq + a->hkv + h) * D;
    if (a->H) { rotate(k, a->H, D, kr); rotate(v, a->H, D, vr); }
    else { memcpy(kr, k, 4 * D); memcpy(vr, v, 4 * D); }
    const int64_t slot = a->slots[b];
    if (slot >= 0) {
        write_kv_head(kr, L->k_scale, a, L->kd, L->ks, slot, h);
        write_kv_head(vr, L->v_scale, a, L->vd, L->vs, slot, h);
    }
    if (L->tail_k && a->tail_slot[b] >= 0) {
        const int64_t flat = (a->tail_slot[b] * a->span + (a->ctx[b] - 1) % a->span) * a->hkv + h;
        memcpy(L->tail_k + flat * D, kr, 4 * D);
        memcpy(L->tail_v + flat * D, vr, 4 * D);
    }
    float* qb = q_rope + b * a->hq * D;
    for (int64_t g = 0; g < G; g++) rope_head(row + (h * G + g) * D, c, c + D / 2, D, qb + (h * G + g) * D);
    attend_group(at, b, h, qb, out + b * a->hq * D);
}

static void linear_phase(const nvfp4_weight* w, int64_t K, const float* x, int64_t M, float* out) {
    int64_t N;
    const int64_t tiles = weight_tiles(w, &N);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) linear_tile(w, K, N, t, x, NULL, M, out);
}

/* h [B, hidden]: the embeddings in, the final-normed hidden states out. residual [B, hidden]. */
void decode_step(const step_args* a, const step_layer* layers, int64_t nlayers, float* h, float* residual, int nt) {
    const int64_t B = a->B, E = a->hidden, D = a->D, I = a->inter;
    float* buf = (float*)malloc(sizeof(float) * B * (E + (a->hq + 2 * a->hkv) * D + 2 * a->hq * D + 3 * I));
    float *xn = buf, *qkv = xn + B * E, *q_rope = qkv + B * (a->hq + 2 * a->hkv) * D, *att = q_rope + B * a->hq * D;
    float *gu = att + B * a->hq * D, *act = gu + B * 2 * I;
    #pragma omp parallel num_threads(nt)
    for (int64_t l = 0; l < nlayers; l++) {
        const step_layer* L = layers + l;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            if (l == 0) memcpy(residual + b * E, h + b * E, 4 * E);
            rmsnorm_row(l == 0 ? residual + b * E : h + b * E, l == 0 ? NULL : residual + b * E, L->in_norm,
                        xn + b * E, E, a->eps);
        }
        linear_phase(&L->qkv, E, xn, B, qkv);
        const attn_args at = {0, a->hq, a->hkv, D, a->bs, a->max_blocks, a->span, L->kd, L->ks, L->vd, L->vs,
                              L->k_scale, L->v_scale, a->tables, a->ctx, L->tail_k ? a->tail_slot : a->no_tail,
                              a->tail_own, L->tail_k, L->tail_v, a->H, a->attn_scale};
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * a->hkv; task++)
            attention_task(a, L, &at, qkv, task / a->hkv, task % a->hkv, q_rope, att);
        linear_phase(&L->o, a->hq * D, att, B, h);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) rmsnorm_row(h + b * E, residual + b * E, L->post_norm, xn + b * E, E, a->eps);
        linear_phase(&L->gate_up, E, xn, B, gu);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) silu_mul_row(gu + b * 2 * I, I, act + b * I);
        linear_phase(&L->down, I, act, B, h);
    }
    for (int64_t b = 0; b < B; b++) {
        rmsnorm_row(h + b * E, residual + b * E, a->final_norm, xn + b * E, E, a->eps);
        memcpy(h + b * E, xn + b * E, 4 * E);
    }
    free(buf);
}
