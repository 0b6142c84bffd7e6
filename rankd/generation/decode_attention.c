/* Decode attention on a CPU: one query token per row over each row's own key positions, every row and head in
 * one call (rankd/generation/decode_attention.py builds this file with the system's C compiler and calls it
 * through ctypes).
 *
 * Row b's query heads h = g * G .. g * G + G - 1 share key/value head g (grouped-query attention). Its keys are
 * either the positions starts[b] .. columns - 1 of a strided tensor (position t of head g of row b at
 * k + b * k_row + g * k_head + t * k_pos, its `dim` values contiguous), or its own positions in blocks of a pool
 * (the paged cache: position t in block table[b][t / block], at t % block within it). Values alike, with `value_dim` values
 * (MLA's differ from its keys'). The output is (rows, heads, value_dim), contiguous. Scores are float32 whatever the input's type; the softmax subtracts each head's
 * largest score, as any attention does.
 *
 * Why not scaled_dot_product_attention: for one query token per row, torch's CPU kernel goes through its general
 * flash-attention loop, and transformers repeats the key heads for every query head when a mask is given; here
 * the key of a position is read once for all the query heads that share it, four keys at a time, and a row reads
 * only its own positions (no padding, no mask). bench/bench_ragged_attention.py measures both.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));

#define MAX_GROUP 16

static inline v8 load_f32(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 load_bf16(const uint16_t *p) {
    h8 half;
    memcpy(&half, p, sizeof half);
    u8 wide = __builtin_convertvector(half, u8) << 16;
    v8 v;
    memcpy(&v, &wide, sizeof v);
    return v;
}

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* a where mask, else b (C has no ?: on vectors) */
static inline v8 select8(i8 mask, v8 a, v8 b) {
    i8 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    i8 chosen = (mask & ia) | (~mask & ib);
    v8 out;
    memcpy(&out, &chosen, sizeof out);
    return out;
}

/* e^x for x <= 0 (scores minus their largest), within 2 ulp: x = n ln 2 + r, e^r by a degree-6 polynomial, 2^n
 * through the exponent bits. Below -87 the result is 0; a NaN stays NaN. */
static inline v8 exp_nonpositive(v8 x) {
    const v8 zero = {0};
    const i8 tiny = x < -87.f;
    x = select8(tiny, zero - 87.f, x);
    v8 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, i8), v8);
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * (1.f / 720) + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
    v8 two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return select8(tiny, zero, p * two_to_n);
}

/* softmax of n scores in place (any n); returns 1 / their sum */
static float softmax_in_place(float *s, int64_t n) {
    float top = s[0];
    for (int64_t t = 1; t < n; t++) top = s[t] > top ? s[t] : top;
    v8 total = {0};
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        v8 e = exp_nonpositive(load_f32(s + t) - top);
        memcpy(s + t, &e, sizeof e);
        total += e;
    }
    float sum = sum8(total);
    for (; t < n; t++) {
        v8 e = exp_nonpositive((v8){0} + (s[t] - top));
        s[t] = e[0];
        sum += e[0];
    }
    return 1.f / sum;
}

/* A row's positions for one key/value head: `n` of them, in segments of `block` positions. Strided (blocks is
 * NULL): one segment from k (v). Paged: segment s from k + blocks[s] * k_block (v alike), in elements of `size`
 * bytes. */
struct row_span {
    const void *k, *v;
    const int64_t *blocks;
    int64_t n, block, k_block, v_block, size;
};

static inline int64_t segment(const struct row_span *span, int64_t first) {
    return span->n - first < span->block ? span->n - first : span->block;
}

static inline const void *span_keys(const struct row_span *span, int64_t first) {
    if (span->blocks == NULL) return span->k;
    return (const char *)span->k + span->blocks[first / span->block] * span->k_block * span->size;
}

static inline const void *span_values(const struct row_span *span, int64_t first) {
    if (span->blocks == NULL) return span->v;
    return (const char *)span->v + span->blocks[first / span->block] * span->v_block * span->size;
}

#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD)                                                                     \
    /* scores of query head q against `n` keys `pos` apart, four keys at a time */                                \
    static void NAME##_scores(const float *q, const T *k, int64_t pos, int64_t n, int64_t dim, float scale,         \
                              float *out) {                                                                         \
        int64_t j = 0;                                                                                              \
        for (; j + 4 <= n; j += 4) {                                                                                \
            const T *k0 = k + j * pos;                                                                              \
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                              \
            for (int64_t i = 0; i < dim; i += 8) {                                                                  \
                v8 qv = load_f32(q + i);                                                                            \
                a0 += qv * LOAD(k0 + i);                                                                            \
                a1 += qv * LOAD(k0 + pos + i);                                                                      \
                a2 += qv * LOAD(k0 + 2 * pos + i);                                                                  \
                a3 += qv * LOAD(k0 + 3 * pos + i);                                                                  \
            }                                                                                                       \
            out[j] = sum8(a0) * scale;                                                                              \
            out[j + 1] = sum8(a1) * scale;                                                                          \
            out[j + 2] = sum8(a2) * scale;                                                                          \
            out[j + 3] = sum8(a3) * scale;                                                                          \
        }                                                                                                           \
        for (; j < n; j++) {                                                                                        \
            v8 a = {0};                                                                                             \
            for (int64_t i = 0; i < dim; i += 8) a += load_f32(q + i) * LOAD(k + j * pos + i);                     \
            out[j] = sum8(a) * scale;                                                                               \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    /* one row's key/value head over its positions: its `group` query heads (float32, group x dim) into out          \
       (float32, group x value_dim). The positions are `span.n` in all, in segments of `span.block` (the last     \
       may be shorter), segment s's keys from k_of(span, s) `k_pos` apart; values alike. */                         \
    static int NAME##_group(const float *q, const struct row_span *span, const int64_t *shape, float scale,         \
                            float *out) {                                                                           \
        const int64_t group = shape[0], dim = shape[1], value_dim = shape[2], k_pos = shape[3], v_pos = shape[4];  \
        const int64_t n = span->n, block = span->block;                                                             \
        float *scores = malloc(sizeof(float) * (size_t)(group * (n > 0 ? n : 1)));                                  \
        if (scores == NULL) return 1;                                                                               \
        float inverse[MAX_GROUP];                                                                                   \
        for (int64_t h = 0; h < group; h++) {                                                                       \
            for (int64_t first = 0; first < n; first += block)                                                      \
                NAME##_scores(q + h * dim, (const T *)span_keys(span, first), k_pos, segment(span, first), dim,     \
                              scale, scores + h * n + first);                                                       \
            inverse[h] = softmax_in_place(scores + h * n, n);                                                       \
        }                                                                                                           \
        memset(out, 0, sizeof(float) * (size_t)(group * value_dim));                                               \
        for (int64_t first = 0; first < n; first += block) {                                                        \
            const T *values = (const T *)span_values(span, first);                                                  \
            for (int64_t t = 0; t < segment(span, first); t++) {                                                    \
                const T *vt = values + t * v_pos;                                                                   \
                for (int64_t h = 0; h < group; h++) {                                                               \
                    float p = scores[h * n + first + t], *o = out + h * value_dim;                                  \
                    for (int64_t i = 0; i < value_dim; i += 8) {                                                    \
                        v8 x = load_f32(o + i) + p * LOAD(vt + i);                                                  \
                        memcpy(o + i, &x, sizeof x);                                                                \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t h = 0; h < group; h++)                                                                         \
            for (int64_t i = 0; i < value_dim; i++) out[h * value_dim + i] *= inverse[h];                          \
        free(scores);                                                                                               \
        return 0;                                                                                                   \
    }                                                                                                               \
                                                                                                                    \
    /* shape: rows, heads, kv_heads, dim, value_dim, columns, block, table_width; strides: of keys then values, by   \
       row (by block when paged), head, position. Without a table, row b's positions are its columns extent[b] ..    \
       columns - 1; with one, they are extent[b] positions in the blocks table[b * table_width ...], `block` each. */ \
    int NAME(const float *q, const T *k, const T *v, const int64_t *extent, const int64_t *table,                  \
             const int64_t *shape, const int64_t *strides, float scale, int threads, float *out) {                 \
        const int64_t rows = shape[0], heads = shape[1], kv_heads = shape[2], dim = shape[3], value_dim = shape[4]; \
        const int64_t columns = shape[5], group = heads / kv_heads;                                                 \
        if (group > MAX_GROUP || group * kv_heads != heads || dim % 8 || value_dim % 8) return 2;                  \
        if (table != NULL && (shape[6] < 1 || shape[6] % 4)) return 2;                                              \
        const int64_t per_group[5] = {group, dim, value_dim, strides[2], strides[5]};                               \
        int failed = 0;                                                                                             \
        _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(threads) if(threads > 1) reduction(|:failed)") \
        for (int64_t b = 0; b < rows; b++)                                                                          \
            for (int64_t g = 0; g < kv_heads; g++) {                                                                \
                const int64_t head = b * heads + g * group;                                                         \
                struct row_span span;                                                                               \
                if (table == NULL) {                                                                                \
                    const int64_t first = extent[b];                                                                \
                    span = (struct row_span){k + b * strides[0] + g * strides[1] + first * strides[2],              \
                                             v + b * strides[3] + g * strides[4] + first * strides[5],              \
                                             NULL, columns - first, columns > first ? columns - first : 1, 0, 0,     \
                                             sizeof(T)};                                                            \
                } else {                                                                                            \
                    span = (struct row_span){k + g * strides[1], v + g * strides[4], table + b * shape[7],          \
                                             extent[b], shape[6], strides[0], strides[3], sizeof(T)};               \
                }                                                                                                   \
                failed |= NAME##_group(q + head * dim, &span, per_group, scale, out + head * value_dim);            \
            }                                                                                                       \
        return failed;                                                                                              \
    }

DEFINE_DECODE_ATTENTION(decode_attention_f32, float, load_f32)
DEFINE_DECODE_ATTENTION(decode_attention_bf16, uint16_t, load_bf16)
