/* The CNNs' BatchNorm + ReLU + 2x2 max pooling (stride 2) on a CPU, forward and backward, for contiguous
 * (N, C, H, W) float32/float64 tensors with H and W even. The package's build (setup.py) compiles this file once per
 * CPU capability; pfedkit/runtime/native.py loads the build PyTorch's capability check picks and calls it through
 * ctypes (which releases the GIL, so clients side by side use their cores), registered as torch.library ops.
 *
 * relu_pool: F.max_pool2d(torch.relu(z), 2) and its gradient, bit for bit. bn_relu_pool: the same after a
 * training-mode BatchNorm2d (batch statistics, running statistics updated in place), its gradient with respect to
 * the input, weight and bias; statistics and per-channel sums in double.
 *
 * Why: on a CPU, PyTorch's max_pool2d kernel in the standard layout is scalar and took a large share of a small CNN's
 * training step, BatchNorm forward and backward another, each a separate pass over the activations; here the whole block is three passes forward and two backward.
 *
 * Semantics kept from PyTorch: relu keeps NaN; max_pool2d scans a window row by row and moves to a later element
 * when it is greater or NaN (ties keep the first, the last NaN wins); relu's gradient passes where its input is
 * > 0 or NaN. Comparing each row's pair first and then the two pair winners the same way gives the same element.
 * `code` records it per output: 0..3 (row-major in the window), 4 when no gradient flows.
 *
 * Written with GCC/Clang vector extensions (8 float or 4 double lanes, 32 bytes): the AVX2 and AVX512 builds make
 * them AVX/AVX-512 instructions, the portable DEFAULT build splits them into SSE2 pairs. No branch depends on the data: the window
 * winners are random, and mispredicted branches made a scalar version many times slower. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NO_GRAD 4

typedef double acc_t __attribute__((vector_size(64)));  /* 8 double accumulators */

/* The window rule, for vectors of LANES elements of T (32 bytes for the pooling kernels, 64 for the first
 * block's wide variant): ReLU, the window winner and its code, the gradient spread over a window */
#define WINDOWS(T, I, SUF, LANES)                                                                           \
typedef T vec_##SUF __attribute__((vector_size(LANES * sizeof(T))));                                        \
typedef I mask_##SUF __attribute__((vector_size(LANES * sizeof(I))));                                       \
typedef uint8_t code_##SUF __attribute__((vector_size(LANES)));                                             \
typedef double wide_##SUF __attribute__((vector_size(8 * LANES)));                                          \
                                                                                                            \
static inline vec_##SUF relu_##SUF(vec_##SUF v) { return (vec_##SUF)((mask_##SUF)v & ~(v <= 0)); }          \
static inline mask_##SUF later_##SUF(vec_##SUF later, vec_##SUF first) {                                    \
    return (later > first) | (later != later);                                                              \
}                                                                                                           \
static inline vec_##SUF pick_##SUF(mask_##SUF m, vec_##SUF yes, vec_##SUF no) {                             \
    return (vec_##SUF)((m & (mask_##SUF)yes) | (~m & (mask_##SUF)no));                                      \
}                                                                                                           \
static inline vec_##SUF load_##SUF(const T *p) { vec_##SUF v; memcpy(&v, p, sizeof v); return v; }          \
static inline void store_##SUF(T *p, vec_##SUF v) { memcpy(p, &v, sizeof v); }                              \
                                                                                                            \
typedef struct { vec_##SUF q[4]; } quarters_##SUF;                                                          \
/* relu(x * scale + shift) pooled over LANES windows given by their quarters: the outputs, their codes and   \
 * (taken != 0) the input x each output was taken from (BatchNorm's backward sums need it) */               \
static inline void pool_windows_##SUF(quarters_##SUF v, vec_##SUF scale, vec_##SUF shift, T *out,           \
                                      uint8_t *code, T *taken) {                                            \
    vec_##SUF a = relu_##SUF(v.q[0] * scale + shift), b = relu_##SUF(v.q[1] * scale + shift);               \
    vec_##SUF c = relu_##SUF(v.q[2] * scale + shift), d = relu_##SUF(v.q[3] * scale + shift);               \
    mask_##SUF top_right = later_##SUF(b, a), bottom_right = later_##SUF(d, c);                             \
    vec_##SUF top = pick_##SUF(top_right, b, a), bottom = pick_##SUF(bottom_right, d, c);                   \
    mask_##SUF lower = later_##SUF(bottom, top);                                                            \
    vec_##SUF best = pick_##SUF(lower, bottom, top);                                                        \
    /* masks are 0 or -1: the top row gives 0 or 1, the bottom 2 or 3 */                                    \
    mask_##SUF at = (lower & (2 - bottom_right)) | (~lower & -top_right);                                   \
    mask_##SUF dead = best <= 0;                                                                            \
    at = (at & ~dead) | (dead & NO_GRAD);                                                                   \
    code_##SUF c8 = __builtin_convertvector(at, code_##SUF);                                                \
    store_##SUF(out, best); memcpy(code, &c8, LANES);                                                       \
    if (taken) {                                                                                            \
        vec_##SUF x_top = pick_##SUF(top_right, v.q[1], v.q[0]), x_bottom = pick_##SUF(bottom_right, v.q[3], v.q[2]); \
        store_##SUF(taken, pick_##SUF(lower, x_bottom, x_top));                                             \
    }                                                                                                       \
}                                                                                                           \
/* the pooled gradient g of LANES windows as the gradient of their four quarters (zero where not taken) */   \
static inline quarters_##SUF spread_##SUF(const T *g, const uint8_t *code) {                                \
    code_##SUF c8; memcpy(&c8, code, LANES);                                                                \
    mask_##SUF at = __builtin_convertvector(c8, mask_##SUF), gi = (mask_##SUF)load_##SUF(g);                \
    quarters_##SUF out = {{(vec_##SUF)(gi & (at == 0)), (vec_##SUF)(gi & (at == 1)),                        \
                           (vec_##SUF)(gi & (at == 2)), (vec_##SUF)(gi & (at == 3))}};                      \
    return out;                                                                                             \
}

#define KERNELS(T, I, SUF, LANES, EVEN, ODD, LOW, HIGH)                                                     \
WINDOWS(T, I, SUF, LANES)                                                                                   \
/* A window block: LANES windows side by side, each quarter a vector (top left, top right, bottom left, bottom \
 * right), read from 2 * LANES elements of each of the two rows */                                          \
static inline quarters_##SUF quarters_##SUF##_of(const T *r0, const T *r1) {                                \
    const mask_##SUF even = EVEN, odd = ODD;                                                                \
    vec_##SUF x0 = load_##SUF(r0), x1 = load_##SUF(r0 + LANES), y0 = load_##SUF(r1), y1 = load_##SUF(r1 + LANES); \
    quarters_##SUF out = {{__builtin_shuffle(x0, x1, even), __builtin_shuffle(x0, x1, odd),                 \
                           __builtin_shuffle(y0, y1, even), __builtin_shuffle(y0, y1, odd)}};               \
    return out;                                                                                             \
}                                                                                                           \
/* the two rows of a window block from its quarters */                                                      \
static inline void store_quarters_##SUF(quarters_##SUF v, T *r0, T *r1) {                                   \
    const mask_##SUF low = LOW, high = HIGH;                                                                \
    store_##SUF(r0, __builtin_shuffle(v.q[0], v.q[1], low));                                                \
    store_##SUF(r0 + LANES, __builtin_shuffle(v.q[0], v.q[1], high));                                       \
    store_##SUF(r1, __builtin_shuffle(v.q[2], v.q[3], low));                                                \
    store_##SUF(r1 + LANES, __builtin_shuffle(v.q[2], v.q[3], high));                                       \
}                                                                                                           \
                                                                                                            \
static inline void forward_block_##SUF(const T *r0, const T *r1, vec_##SUF scale, vec_##SUF shift,          \
                                       T *out, uint8_t *code, T *taken) {                                   \
    pool_windows_##SUF(quarters_##SUF##_of(r0, r1), scale, shift, out, code, taken);                        \
}                                                                                                           \
                                                                                                            \
/* Every window row of a plane. A row's last, partial block reads and writes past the row's end: what it      \
 * reads there is discarded and what it writes is the next row's, written again when that row's turn comes  \
 * (rows and planes go in memory order). Where less than a block's spill-over is left in the tensors (`rest`: \
 * the planes after this one), it goes through zero-padded copies, so nothing outside them is touched. */   \
static void forward_plane_##SUF(const T *z, T *out, uint8_t *code, T *taken, int64_t h, int64_t w, T scale, \
                                T shift, int64_t rest) {                                                    \
    int64_t ow = w / 2;                                                                                     \
    vec_##SUF sc = scale - (vec_##SUF){0}, sh = shift - (vec_##SUF){0};                                     \
    for (int64_t r = 0; r < h / 2; r++) {                                                                   \
        const T *r0 = z + 2 * r * w, *r1 = r0 + w;                                                          \
        T *o = out + r * ow, *t = taken ? taken + r * ow : 0; uint8_t *c = code + r * ow;                   \
        int64_t j = 0, padded = LANES - ow % LANES > (h / 2 - 1 - r + rest * (h / 2)) * ow;                 \
        for (; j + LANES <= ow || (j < ow && !padded); j += LANES)                                          \
            forward_block_##SUF(r0 + 2 * j, r1 + 2 * j, sc, sh, o + j, c + j, t ? t + j : 0);               \
        if (j < ow) {                                                                                       \
            T t0[2 * LANES] = {0}, t1[2 * LANES] = {0}, to[LANES], tt[LANES]; uint8_t tc[LANES];            \
            int64_t n = ow - j;                                                                             \
            memcpy(t0, r0 + 2 * j, 2 * n * sizeof(T)); memcpy(t1, r1 + 2 * j, 2 * n * sizeof(T));           \
            forward_block_##SUF(t0, t1, sc, sh, to, tc, tt);                                                \
            memcpy(o + j, to, n * sizeof(T)); memcpy(c + j, tc, n);                                         \
            if (t) memcpy(t + j, tt, n * sizeof(T));                                                        \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
/* The input gradient of a plane: k_dy * (spread g) + k0 + k1 * z (relu_pool: 1, 0, 0 and no z). A row's   \
 * partial last block reads past the row's end (discarded; padded copies where the tensors end, as in       \
 * forward_plane) and writes back only its own elements. */                                                 \
static inline void backward_block_##SUF(const T *g, const uint8_t *code, const T *z0, const T *z1,          \
                                        vec_##SUF k_dy, vec_##SUF k0, vec_##SUF k1, T *r0, T *r1, int64_t n) { \
    quarters_##SUF dy = spread_##SUF(g, code);                                                              \
    if (z0) {                                                                                               \
        quarters_##SUF z = quarters_##SUF##_of(z0, z1);                                                     \
        for (int k = 0; k < 4; k++) dy.q[k] = k_dy * dy.q[k] + (k0 + k1 * z.q[k]);                          \
    }                                                                                                       \
    if (n >= LANES) { store_quarters_##SUF(dy, r0, r1); return; }                                           \
    T v0[2 * LANES], v1[2 * LANES];                                                                         \
    store_quarters_##SUF(dy, v0, v1);                                                                       \
    memcpy(r0, v0, 2 * n * sizeof(T)); memcpy(r1, v1, 2 * n * sizeof(T));                                   \
}                                                                                                           \
static void backward_plane_##SUF(const T *g, const uint8_t *code, const T *z, T *dz, int64_t h, int64_t w,  \
                                 T k_dy, T k0, T k1, int64_t rest) {                                        \
    int64_t ow = w / 2;                                                                                     \
    vec_##SUF a = k_dy - (vec_##SUF){0}, b = k0 - (vec_##SUF){0}, c1 = k1 - (vec_##SUF){0};                 \
    for (int64_t r = 0; r < h / 2; r++) {                                                                   \
        const T *gr = g + r * ow, *z0 = z ? z + 2 * r * w : 0, *z1 = z ? z0 + w : 0;                        \
        const uint8_t *c = code + r * ow;                                                                   \
        T *d0 = dz + 2 * r * w, *d1 = d0 + w;                                                               \
        int64_t j = 0, padded = LANES - ow % LANES > (h / 2 - 1 - r + rest * (h / 2)) * ow;                 \
        for (; j + LANES <= ow || (j < ow && !padded); j += LANES)                                          \
            backward_block_##SUF(gr + j, c + j, z ? z0 + 2 * j : 0, z ? z1 + 2 * j : 0, a, b, c1,           \
                                 d0 + 2 * j, d1 + 2 * j, ow - j);                                           \
        if (j < ow) {                                                                                       \
            T tg[LANES] = {0}, t0[2 * LANES] = {0}, t1[2 * LANES] = {0};                                    \
            uint8_t tc[LANES]; int64_t n = ow - j;                                                          \
            memset(tc, NO_GRAD, LANES); memcpy(tg, gr + j, n * sizeof(T)); memcpy(tc, c + j, n);            \
            if (z) { memcpy(t0, z0 + 2 * j, 2 * n * sizeof(T)); memcpy(t1, z1 + 2 * j, 2 * n * sizeof(T)); } \
            backward_block_##SUF(tg, tc, z ? t0 : 0, z ? t1 : 0, a, b, c1, d0 + 2 * j, d1 + 2 * j, n);      \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
void relu_pool_##SUF(const T *z, T *out, uint8_t *code, int64_t n, int64_t c, int64_t h, int64_t w) {       \
    int64_t o = (h / 2) * (w / 2);                                                                          \
    for (int64_t p = 0; p < n * c; p++)                                                                     \
        forward_plane_##SUF(z + p * h * w, out + p * o, code + p * o, 0, h, w, 1, 0, n * c - 1 - p);        \
}                                                                                                           \
void relu_pool_backward_##SUF(const T *g, const uint8_t *code, T *dz, int64_t n, int64_t c, int64_t h,      \
                              int64_t w) {                                                                  \
    int64_t o = (h / 2) * (w / 2);                                                                          \
    for (int64_t p = 0; p < n * c; p++)                                                                     \
        backward_plane_##SUF(g + p * o, code + p * o, 0, dz + p * h * w, h, w, 1, 0, 0, n * c - 1 - p);     \
}                                                                                                           \
                                                                                                            \
/* The same for channels_last tensors, (N, H, W, C) in memory with C a multiple of LANES: a window's four         \
 * positions are four contiguous channel vectors, so no shuffles; scanned in the same order, with the same rule */ \
void relu_pool_nhwc_##SUF(const T *z, T *out, uint8_t *code, int64_t n, int64_t c, int64_t h, int64_t w) {  \
    int64_t oh = h / 2, ow = w / 2;                                                                         \
    vec_##SUF one = 1 - (vec_##SUF){0}, zero = {0};                                                         \
    for (int64_t b = 0; b < n; b++)                                                                         \
        for (int64_t i = 0; i < oh; i++)                                                                    \
            for (int64_t j = 0; j < ow; j++) {                                                              \
                const T *p0 = z + ((b * h + 2 * i) * w + 2 * j) * c, *p1 = p0 + w * c;                      \
                T *o = out + ((b * oh + i) * ow + j) * c; uint8_t *cd = code + ((b * oh + i) * ow + j) * c; \
                for (int64_t k = 0; k < c; k += LANES) {                                                    \
                    quarters_##SUF v = {{load_##SUF(p0 + k), load_##SUF(p0 + c + k),                        \
                                         load_##SUF(p1 + k), load_##SUF(p1 + c + k)}};                      \
                    pool_windows_##SUF(v, one, zero, o + k, cd + k, 0);                                     \
                }                                                                                           \
            }                                                                                               \
}                                                                                                           \
void relu_pool_nhwc_backward_##SUF(const T *g, const uint8_t *code, T *dz, int64_t n, int64_t c, int64_t h, \
                                   int64_t w) {                                                             \
    int64_t oh = h / 2, ow = w / 2;                                                                         \
    for (int64_t b = 0; b < n; b++)                                                                         \
        for (int64_t i = 0; i < oh; i++)                                                                    \
            for (int64_t j = 0; j < ow; j++) {                                                              \
                T *p0 = dz + ((b * h + 2 * i) * w + 2 * j) * c, *p1 = p0 + w * c;                           \
                const T *gr = g + ((b * oh + i) * ow + j) * c;                                              \
                const uint8_t *cd = code + ((b * oh + i) * ow + j) * c;                                     \
                for (int64_t k = 0; k < c; k += LANES) {                                                    \
                    quarters_##SUF q = spread_##SUF(gr + k, cd + k);                                        \
                    store_##SUF(p0 + k, q.q[0]); store_##SUF(p0 + c + k, q.q[1]);                           \
                    store_##SUF(p1 + k, q.q[2]); store_##SUF(p1 + c + k, q.q[3]);                           \
                }                                                                                           \
            }                                                                                               \
}                                                                                                           \
                                                                                                            \
/* Sums of (v - shift) and (v - shift)^2 over len elements, in double */                                    \
static void sums_##SUF(const T *v, int64_t len, double shift, double *s1, double *s2) {                     \
    wide_##SUF a = {0}, b = {0}, sh = shift - (wide_##SUF){0};                                              \
    int64_t i = 0;                                                                                          \
    for (; i + LANES <= len; i += LANES) {                                                                  \
        wide_##SUF d = __builtin_convertvector(load_##SUF(v + i), wide_##SUF) - sh;                         \
        a += d; b += d * d;                                                                                 \
    }                                                                                                       \
    double x = 0, y = 0;                                                                                    \
    for (int k = 0; k < LANES; k++) { x += a[k]; y += b[k]; }                                               \
    for (; i < len; i++) { double d = v[i] - shift; x += d; y += d * d; }                                   \
    *s1 += x; *s2 += y;                                                                                     \
}                                                                                                           \
                                                                                                            \
/* Training-mode BatchNorm2d (biased variance to normalize, unbiased into the running variance, PyTorch's    \
 * momentum convention), then relu_pool. mean, invstd (C doubles) and the input each output was taken from  \
 * (`taken`, the output's shape) are kept for the backward pass. */                                         \
void bn_relu_pool_##SUF(const T *z, const T *weight, const T *bias, T *running_mean, T *running_var,        \
                        double momentum, double eps, T *out, uint8_t *code, T *taken, double *mean,         \
                        double *invstd, int64_t n, int64_t c, int64_t h, int64_t w) {                       \
    int64_t hw = h * w, o = (h / 2) * (w / 2);                                                              \
    double m = (double)n * hw;                                                                              \
    for (int64_t ch = 0; ch < c; ch++) {                                                                    \
        double shift = z[ch * hw], s1 = 0, s2 = 0;  /* shifted sums: no cancellation for a large mean */    \
        for (int64_t b = 0; b < n; b++) sums_##SUF(z + (b * c + ch) * hw, hw, shift, &s1, &s2);             \
        double dm = s1 / m, var = s2 / m - dm * dm;                                                         \
        var = var > 0 ? var : 0;                                                                            \
        mean[ch] = shift + dm;                                                                              \
        invstd[ch] = 1.0 / sqrt(var + eps);                                                                 \
        running_mean[ch] = (T)(momentum * mean[ch] + (1 - momentum) * running_mean[ch]);                    \
        running_var[ch] = (T)(momentum * var * m / (m - 1) + (1 - momentum) * running_var[ch]);             \
    }                                                                                                       \
    for (int64_t p = 0; p < n * c; p++) {  /* planes in memory order (forward_plane's spill-over) */        \
        int64_t ch = p % c;                                                                                 \
        double scale = weight[ch] * invstd[ch];                                                             \
        forward_plane_##SUF(z + p * hw, out + p * o, code + p * o, taken + p * o, h, w, (T)scale,           \
                            (T)(bias[ch] - mean[ch] * scale), n * c - 1 - p);                               \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
/* Its gradient: dbias = sum dy, dweight = sum dy * xhat, dz = weight * invstd * (dy - mean(dy)              \
 * - xhat * mean(dy * xhat)), dy being the pooled gradient g at the windows' taken positions, so that both  \
 * sums run over the pooled arrays (in double: exact products for float32) */                               \
void bn_relu_pool_backward_##SUF(const T *g, const uint8_t *code, const T *taken, const T *z, const T *weight, \
                                 const double *mean, const double *invstd, T *dz, T *dweight, T *dbias,     \
                                 int64_t n, int64_t c, int64_t h, int64_t w) {                              \
    int64_t hw = h * w, o = (h / 2) * (w / 2);                                                              \
    double m = (double)n * hw;                                                                              \
    for (int64_t ch = 0; ch < c; ch++) {                                                                    \
        wide_##SUF sum_dy = {0}, sum_dy_z = {0};                                                            \
        double sdy = 0, sdz = 0;                                                                            \
        for (int64_t b = 0; b < n; b++) {                                                                   \
            const T *gp = g + (b * c + ch) * o, *tp = taken + (b * c + ch) * o;                             \
            const uint8_t *cp = code + (b * c + ch) * o;                                                    \
            int64_t i = 0;                                                                                  \
            for (; i + LANES <= o; i += LANES) {                                                            \
                code_##SUF c8; memcpy(&c8, cp + i, LANES);                                                  \
                mask_##SUF live = __builtin_convertvector(c8, mask_##SUF) != NO_GRAD;                       \
                wide_##SUF d = __builtin_convertvector((vec_##SUF)((mask_##SUF)load_##SUF(gp + i) & live), wide_##SUF); \
                sum_dy += d;                                                                                \
                sum_dy_z += d * __builtin_convertvector(load_##SUF(tp + i), wide_##SUF);                    \
            }                                                                                               \
            for (; i < o; i++)                                                                              \
                if (cp[i] != NO_GRAD) { sdy += gp[i]; sdz += (double)gp[i] * tp[i]; }                       \
        }                                                                                                   \
        for (int k = 0; k < LANES; k++) { sdy += sum_dy[k]; sdz += sum_dy_z[k]; }                           \
        double sdx = invstd[ch] * (sdz - mean[ch] * sdy);  /* sum of dy * xhat */                           \
        double k_dy = weight[ch] * invstd[ch], k1 = -k_dy * invstd[ch] * sdx / m;                           \
        double k0 = -k_dy * sdy / m - k1 * mean[ch];                                                        \
        dbias[ch] = (T)sdy; dweight[ch] = (T)sdx;                                                           \
        for (int64_t b = 0; b < n; b++)                                                                     \
            backward_plane_##SUF(g + (b * c + ch) * o, code + (b * c + ch) * o, z + (b * c + ch) * hw,      \
                                 dz + (b * c + ch) * hw, h, w, (T)k_dy, (T)k0, (T)k1,                       \
                                 n * c - 1 - (b * c + ch));                                                 \
    }                                                                                                       \
}

#define F32_EVEN {0, 2, 4, 6, 8, 10, 12, 14}
#define F32_ODD {1, 3, 5, 7, 9, 11, 13, 15}
#define F32_LOW {0, 8, 1, 9, 2, 10, 3, 11}
#define F32_HIGH {4, 12, 5, 13, 6, 14, 7, 15}
#define F64_EVEN {0, 2, 4, 6}
#define F64_ODD {1, 3, 5, 7}
#define F64_LOW {0, 4, 1, 5}
#define F64_HIGH {2, 6, 3, 7}

KERNELS(float, int32_t, f32, 8, F32_EVEN, F32_ODD, F32_LOW, F32_HIGH)
KERNELS(double, int64_t, f64, 4, F64_EVEN, F64_ODD, F64_LOW, F64_HIGH)

/* The first convolution of a one-channel image model (MNIST's CNNs): (N, 1, H, W) images, (O, 1, 5, 5) weights,
 * stride 1, no padding; forward, and the weight and bias gradients (the images need none). oneDNN ran this layer
 * at ~10 GFLOP/s on one core (0.80 ms forward for 32 MNIST images, 16 channels), slower than the next layer with
 * 3.5x its work; here each output row is a few vectors and each tap one broadcast FMA per output channel, for
 * 8 output channels at a time kept in registers (the 5x5 size fixed, so that the taps unroll).
 *
 * A row of OW outputs is cut into blocks of LANES; when OW is not a multiple of LANES the last block starts at
 * OW - LANES, overlapping the one before: the forward pass writes the overlap twice with the same values, the
 * weight gradient masks the overlapping lanes out. Needs OW >= LANES (native.py checks). */
#define TAPS 5
#define GROUP 8
#define CONV1(T, I, SUF, LANES)                                                                             \
typedef T cvec_##SUF __attribute__((vector_size(32)));                                                      \
typedef I cmask_##SUF __attribute__((vector_size(32)));                                                     \
static inline cvec_##SUF cload_##SUF(const T *p) { cvec_##SUF v; memcpy(&v, p, 32); return v; }             \
static inline int64_t block_start_##SUF(int64_t blk, int64_t ow) {                                          \
    return blk * LANES < ow - LANES ? blk * LANES : ow - LANES;                                             \
}                                                                                                           \
                                                                                                            \
void conv1_##SUF(const T *x, const T *weight, const T *bias, T *y, int64_t n, int64_t h, int64_t w,         \
                 int64_t outs) {                                                                            \
    int64_t oh = h - TAPS + 1, ow = w - TAPS + 1, blocks = (ow + LANES - 1) / LANES;                        \
    for (int64_t o0 = 0; o0 < outs; o0 += GROUP) {                                                          \
        int64_t g = outs - o0 < GROUP ? outs - o0 : GROUP;                                                  \
        T wt[TAPS * TAPS][GROUP] = {{0}}, b0[GROUP] = {0};  /* this group's weights, tap-major, zero-padded */ \
        for (int64_t o = 0; o < g; o++) {                                                                   \
            b0[o] = bias[o0 + o];                                                                           \
            for (int t = 0; t < TAPS * TAPS; t++) wt[t][o] = weight[(o0 + o) * TAPS * TAPS + t];            \
        }                                                                                                   \
        for (int64_t b = 0; b < n; b++)                                                                     \
            for (int64_t i = 0; i < oh; i++)                                                                \
                for (int64_t blk = 0; blk < blocks; blk++) {                                                \
                    int64_t j = block_start_##SUF(blk, ow);                                                 \
                    cvec_##SUF acc[GROUP];                                                                  \
                    for (int o = 0; o < GROUP; o++) acc[o] = b0[o] - (cvec_##SUF){0};                       \
                    for (int p = 0; p < TAPS; p++) {                                                        \
                        const T *row = x + (b * h + i + p) * w + j;                                         \
                        for (int q = 0; q < TAPS; q++) {                                                    \
                            cvec_##SUF v = cload_##SUF(row + q);                                            \
                            for (int o = 0; o < GROUP; o++) acc[o] += wt[p * TAPS + q][o] * v;              \
                        }                                                                                   \
                    }                                                                                       \
                    for (int64_t o = 0; o < g; o++)                                                         \
                        memcpy(y + ((b * outs + o0 + o) * oh + i) * ow + j, &acc[o], 32);                   \
                }                                                                                           \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
void conv1_weight_grad_##SUF(const T *x, const T *dy, T *dweight, T *dbias, int64_t n, int64_t h, int64_t w, \
                             int64_t outs) {                                                                \
    int64_t oh = h - TAPS + 1, ow = w - TAPS + 1, blocks = (ow + LANES - 1) / LANES;                        \
    cvec_##SUF lane;                                                                                        \
    for (int l = 0; l < LANES; l++) lane[l] = (T)l;                                                         \
    for (int64_t o = 0; o < outs; o++) {  /* 25 independent accumulators: FMA throughput, not latency */    \
        cvec_##SUF acc[TAPS * TAPS] = {{0}}, acc_b = {0};                                                   \
        for (int64_t b = 0; b < n; b++)                                                                     \
            for (int64_t i = 0; i < oh; i++) {                                                              \
                const T *rows = x + (b * h + i) * w, *d_row = dy + ((b * outs + o) * oh + i) * ow;          \
                for (int64_t blk = 0; blk < blocks; blk++) {                                                \
                    int64_t j = block_start_##SUF(blk, ow);                                                 \
                    /* the shifted last block: lanes below blk * LANES - j were the block before's */       \
                    cvec_##SUF d = (cvec_##SUF)((cmask_##SUF)cload_##SUF(d_row + j) & (lane >= (T)(blk * LANES - j))); \
                    acc_b += d;                                                                             \
                    for (int p = 0; p < TAPS; p++)                                                          \
                        for (int q = 0; q < TAPS; q++) acc[p * TAPS + q] += d * cload_##SUF(rows + p * w + j + q); \
                }                                                                                           \
            }                                                                                               \
        for (int t = 0; t < TAPS * TAPS; t++) {                                                             \
            double s = 0;                                                                                   \
            for (int l = 0; l < LANES; l++) s += acc[t][l];                                                 \
            dweight[o * TAPS * TAPS + t] = (T)s;                                                            \
        }                                                                                                   \
        double s = 0;                                                                                       \
        for (int l = 0; l < LANES; l++) s += acc_b[l];                                                      \
        dbias[o] = (T)s;                                                                                    \
    }                                                                                                       \
}

CONV1(float, int32_t, f32, 8)
CONV1(double, int64_t, f64, 4)

/* The first convolution fused with ReLU + 2x2 max pooling, channels_last: (N, 1, H, W) images, (O, 1, 5, 5)
 * weights with O a multiple of LANES, (H - 4) and (W - 4) even; out and code (N, (H-4)/2, (W-4)/2, O) in memory,
 * as relu_pool_nhwc gives them. The BN-free CNN (its activations channels_last) spent 0.8 ms of a 2.9 ms step on
 * one core in oneDNN's convolution and the separate pooling, forward and backward; here the conv outputs of a
 * window never reach memory: each is a channel vector (one broadcast FMA per tap), pooled by pool_windows (the same
 * rule as relu_pool), and the backward pass spreads the pooled gradient over the window (spread) and sums the
 * weight and bias gradients from it, the conv outputs' gradient never stored either. Two windows side by side
 * make 8 independent accumulator chains; the gradient sums are per image in the input's type, over images in
 * double (PyTorch's own float32 gradient was 2x nearer float64 than one float sum over the batch). */
#define CONV1_POOL(T, SUF, LANES)                                                                           \
static inline void window_pair_##SUF(const T *x, int64_t w, const vec_##SUF *wt, vec_##SUF b0, int two,     \
                                     quarters_##SUF *q) {                                                   \
    quarters_##SUF a = {{b0, b0, b0, b0}}, c = {{b0, b0, b0, b0}};                                          \
    for (int p = 0; p < TAPS; p++)                                                                          \
        for (int s = 0; s < TAPS; s++) {                                                                    \
            const T *r0 = x + p * w + s, *r1 = r0 + w;                                                      \
            vec_##SUF k = wt[p * TAPS + s];                                                                 \
            a.q[0] += r0[0] * k; a.q[1] += r0[1] * k; a.q[2] += r1[0] * k; a.q[3] += r1[1] * k;             \
            if (two) { c.q[0] += r0[2] * k; c.q[1] += r0[3] * k; c.q[2] += r1[2] * k; c.q[3] += r1[3] * k; } \
        }                                                                                                   \
    q[0] = a; q[1] = c;                                                                                     \
}                                                                                                           \
void conv1_relu_pool_nhwc_##SUF(const T *x, const T *weight, const T *bias, T *out, uint8_t *code, int64_t n, \
                                int64_t h, int64_t w, int64_t outs) {                                       \
    int64_t ph = (h - TAPS + 1) / 2, pw = (w - TAPS + 1) / 2;                                               \
    vec_##SUF one = 1 - (vec_##SUF){0}, zero = {0};                                                         \
    for (int64_t g = 0; g < outs; g += LANES) {                                                             \
        vec_##SUF wt[TAPS * TAPS], b0;  /* this group's weights, tap-major */                               \
        for (int l = 0; l < LANES; l++) {                                                                   \
            b0[l] = bias[g + l];                                                                            \
            for (int t = 0; t < TAPS * TAPS; t++) wt[t][l] = weight[(g + l) * TAPS * TAPS + t];             \
        }                                                                                                   \
        for (int64_t b = 0; b < n; b++)                                                                     \
            for (int64_t i = 0; i < ph; i++)                                                                \
                for (int64_t j = 0; j < pw; j += 2) {                                                       \
                    int two = j + 1 < pw;                                                                   \
                    quarters_##SUF q[2];                                                                    \
                    window_pair_##SUF(x + (b * h + 2 * i) * w + 2 * j, w, wt, b0, two, q);                  \
                    int64_t at = ((b * ph + i) * pw + j) * outs + g;                                        \
                    pool_windows_##SUF(q[0], one, zero, out + at, code + at, 0);                            \
                    if (two) pool_windows_##SUF(q[1], one, zero, out + at + outs, code + at + outs, 0);     \
                }                                                                                           \
    }                                                                                                       \
}                                                                                                           \
void conv1_relu_pool_nhwc_backward_##SUF(const T *x, const T *grad, const uint8_t *code, T *dweight,        \
                                         T *dbias, int64_t n, int64_t h, int64_t w, int64_t outs) {         \
    int64_t ph = (h - TAPS + 1) / 2, pw = (w - TAPS + 1) / 2;                                               \
    for (int64_t g = 0; g < outs; g += LANES) {                                                             \
        wide_##SUF sum[TAPS * TAPS] = {{0}}, sum_b = {0};  /* in double over the images */                  \
        for (int64_t b = 0; b < n; b++) {                                                                   \
            vec_##SUF acc[TAPS * TAPS] = {{0}}, acc_b = {0};  /* one image's, 25 independent chains */      \
            for (int64_t i = 0; i < ph; i++)                                                                \
                for (int64_t j = 0; j < pw; j++) {                                                          \
                    int64_t at = ((b * ph + i) * pw + j) * outs + g;                                        \
                    quarters_##SUF d = spread_##SUF(grad + at, code + at);                                  \
                    acc_b += (d.q[0] + d.q[1]) + (d.q[2] + d.q[3]);                                         \
                    const T *x0 = x + (b * h + 2 * i) * w + 2 * j;                                          \
                    for (int p = 0; p < TAPS; p++)                                                          \
                        for (int s = 0; s < TAPS; s++) {                                                    \
                            const T *r0 = x0 + p * w + s, *r1 = r0 + w;                                     \
                            acc[p * TAPS + s] += d.q[0] * r0[0] + d.q[1] * r0[1] + d.q[2] * r1[0] + d.q[3] * r1[1]; \
                        }                                                                                   \
                }                                                                                           \
            for (int t = 0; t < TAPS * TAPS; t++) sum[t] += __builtin_convertvector(acc[t], wide_##SUF);    \
            sum_b += __builtin_convertvector(acc_b, wide_##SUF);                                            \
        }                                                                                                   \
        for (int l = 0; l < LANES; l++) {                                                                   \
            for (int t = 0; t < TAPS * TAPS; t++) dweight[(g + l) * TAPS * TAPS + t] = (T)sum[t][l];        \
            dbias[g + l] = (T)sum_b[l];                                                                     \
        }                                                                                                   \
    }                                                                                                       \
}

CONV1_POOL(float, f32, 8)
CONV1_POOL(double, f64, 4)

/* The first block's wide variant: 64-byte vectors (16 float or 8 double channels), for CPUs with 512-bit
 * registers, where it halves the block's instructions (forward 0.19 -> 0.10 ms, backward 0.21 -> 0.15 ms for 32
 * MNIST images and 16 channels on one core, the same results bit for bit). Elsewhere the compiler would split each
 * vector in two and spill the 25 gradient accumulators, so native.py takes it where wide_vectors_native() says. */
WINDOWS(float, int32_t, wide_f32, 16)
WINDOWS(double, int64_t, wide_f64, 8)
CONV1_POOL(float, wide_f32, 16)
CONV1_POOL(double, wide_f64, 8)

int wide_vectors_native(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* A whole training step of the BatchNorm CNNs on one-channel images (nets.CNN with batch_norm: FL-bench's LeNet-5,
 * the CNN + BN): conv1 -> BN -> ReLU -> pool -> conv2 -> BN -> ReLU -> pool -> fc1 -> ReLU -> fc2 -> ReLU -> fc3,
 * the mean cross-entropy and every parameter's gradient, in one call. A LeNet-5 step of 32 images is ~9 M
 * multiply-adds forward, about half a millisecond of one core's arithmetic for the whole step, while PyTorch's
 * autograd step took ~2 ms: dispatch, autograd's graph and oneDNN's fixed costs, not arithmetic. The first block
 * and both BatchNorms are the kernels above (so the same arithmetic as the autograd path); conv2 and the linear
 * layers are plain loops over an output row (the compiler vectorizes them), the dot products of the linear layers'
 * forward pass in vectors of LANES. Sums run in T, as PyTorch's float kernels do, except the cross-entropy, in
 * double. p: the parameters and running statistics, g: the parameters' gradients (overwritten), ws: workspace
 * (native.CNNStep: sizes there), hyper: BN1's momentum and eps, BN2's. */
/* Lanes picked from a vector into a narrower one: clang and GCC >= 12 have __builtin_shufflevector; older GCC
 * builds the narrower vector lane by lane (the same values) */
#if !defined(PFEDKIT_PORTABLE_SHUFFLE) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) ({ const int picks_[] = {__VA_ARGS__};                                           \
    enum { n_ = sizeof picks_ / sizeof picks_[0] };                                                         \
    typedef __typeof__((a)[0]) lane_t_;                                                                     \
    typedef lane_t_ out_t_ __attribute__((vector_size(n_ * sizeof(lane_t_))));                              \
    out_t_ out_;                                                                                            \
    for (int k_ = 0; k_ < n_; k_++) out_[k_] = (a)[picks_[k_]];                                             \
    out_; })
#endif

#define STEP(T, SUF, LANES)                                                                                 \
typedef T r4_##SUF __attribute__((vector_size(4 * sizeof(T))));                                            \
typedef T r8_##SUF __attribute__((vector_size(8 * sizeof(T))));   /* a conv2 output row (8 wide) */        \
typedef T r16_##SUF __attribute__((vector_size(16 * sizeof(T))));  /* two output rows; an input row (12) */ \
/* unaligned access through these types: no accumulator's address is taken, so they stay in registers */  \
typedef T r4u_##SUF __attribute__((vector_size(4 * sizeof(T)), aligned(sizeof(T))));                       \
typedef T r8u_##SUF __attribute__((vector_size(8 * sizeof(T)), aligned(sizeof(T))));                       \
typedef T r16u_##SUF __attribute__((vector_size(16 * sizeof(T)), aligned(sizeof(T))));                     \
static inline r16_##SUF ld16_##SUF(const T *p) { return *(const r16u_##SUF *)p; }                          \
static inline r8_##SUF low8_##SUF(r16_##SUF v) { return SHUFFLE(v, v, 0, 1, 2, 3, 4, 5, 6, 7); } \
static inline r8_##SUF high8_##SUF(r16_##SUF v) {                                                           \
    return SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15);                                     \
}                                                                                                           \
/* the sum of a 16-wide vector's lanes as a tree of vector halves */                                        \
static inline T hsum16_##SUF(r16_##SUF v) {                                                                 \
    r8_##SUF h = low8_##SUF(v) + high8_##SUF(v);                                                            \
    r4_##SUF q = SHUFFLE(h, h, 0, 1, 2, 3) + SHUFFLE(h, h, 4, 5, 6, 7);     \
    return (q[0] + q[2]) + (q[1] + q[3]);                                                                   \
}                                                                                                           \
/* conv2 reads its 12x12 input planes through `shifted` copies: for each column offset q (0..4) the plane's 12  \
 * rows cut to columns q..q+7, 8 wide, so that two consecutive rows are one 16-wide vector (two output rows) */ \
static void shift_rows_##SUF(const T *x, T *shifted, int64_t planes) {                                      \
    for (int64_t k = 0; k < planes; k++)                                                                    \
        for (int q = 0; q < 5; q++)                                                                         \
            for (int r = 0; r < 12; r++) memcpy(shifted + ((k * 5 + q) * 12 + r) * 8, x + k * 144 + r * 12 + q, 8 * sizeof(T)); \
}                                                                                                           \
/* conv2 of one image for one output channel: 8x8 outputs, two rows a vector; xs: the image's shifted planes */ \
static void conv2_image_##SUF(const T *xs, const T *wt, T bias, T *y, int64_t c1) {                         \
    r16_##SUF a0 = bias - (r16_##SUF){0}, a1 = a0, a2 = a0, a3 = a0;                                        \
    for (int64_t i = 0; i < c1; i++)                                                                        \
        _Pragma("GCC unroll 5") for (int p = 0; p < 5; p++)                                                 \
        _Pragma("GCC unroll 5") for (int q = 0; q < 5; q++) {                                               \
            T wv = wt[(i * 5 + p) * 5 + q];                                                                 \
            const T *xi = xs + ((i * 5 + q) * 12 + p) * 8;                                                  \
            a0 += wv * ld16_##SUF(xi); a1 += wv * ld16_##SUF(xi + 16);                                      \
            a2 += wv * ld16_##SUF(xi + 32); a3 += wv * ld16_##SUF(xi + 48);                                 \
        }                                                                                                   \
    *(r16u_##SUF *)y = a0; *(r16u_##SUF *)(y + 16) = a1; *(r16u_##SUF *)(y + 32) = a2; *(r16u_##SUF *)(y + 48) = a3; \
}                                                                                                           \
/* conv2's input gradient for one image and input channel: dx (12x12) rows in registers, 16 wide (12 kept);  \
 * dx[r + p][x] += w[p][q] dy[r][x - q], the dy rows read from 16-wide copies shifted right by q (zeros     \
 * around: dyq[q][o][r]), so that every load is aligned */                                                  \
static void conv2_input_grad_##SUF(const T *dyq, const T *wt, T *dx, int64_t c1, int64_t c2, int64_t i) {   \
    r16_##SUF acc[12];                                                                                      \
    _Pragma("GCC unroll 12") for (int y = 0; y < 12; y++) acc[y] = (r16_##SUF){0};                          \
    for (int64_t o = 0; o < c2; o++)                                                                        \
        _Pragma("GCC unroll 5") for (int p = 0; p < 5; p++)                                                 \
        for (int q = 0; q < 5; q++) {                                                                       \
            T wv = wt[((o * c1 + i) * 5 + p) * 5 + q];                                                      \
            const T *d = dyq + (q * c2 + o) * 128;                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) acc[r + p] += wv * ld16_##SUF(d + r * 16);  \
        }                                                                                                   \
    _Pragma("GCC unroll 12") for (int y = 0; y < 12; y++) {                                                 \
        *(r8u_##SUF *)(dx + y * 12) = low8_##SUF(acc[y]);                                                   \
        r8_##SUF h = high8_##SUF(acc[y]);                                                                   \
        *(r4u_##SUF *)(dx + y * 12 + 8) = SHUFFLE(h, h, 0, 1, 2, 3);                        \
    }                                                                                                       \
}                                                                                                           \
/* conv2's weight and bias gradients, summed over the batch: 25 tap accumulators per (o, i), two output rows \
 * a vector */                                                                                              \
static void conv2_weight_grad_##SUF(const T *xs, const T *dy, T *dw, T *db, int64_t n, int64_t c1, int64_t c2) { \
    for (int64_t o = 0; o < c2; o++) {                                                                      \
        r16_##SUF sb = {0};                                                                                 \
        for (int64_t b = 0; b < n; b++)                                                                     \
            for (int r = 0; r < 4; r++) sb += ld16_##SUF(dy + (b * c2 + o) * 64 + r * 16);                  \
        db[o] = hsum16_##SUF(sb);                                                                           \
        for (int64_t i = 0; i < c1; i++) {                                                                  \
            r16_##SUF acc[25];                                                                              \
            _Pragma("GCC unroll 25") for (int t = 0; t < 25; t++) acc[t] = (r16_##SUF){0};                  \
            for (int64_t b = 0; b < n; b++) {                                                               \
                const T *d = dy + (b * c2 + o) * 64, *xi = xs + (b * c1 + i) * 480;                         \
                for (int r = 0; r < 4; r++) {                                                               \
                    r16_##SUF dr = ld16_##SUF(d + r * 16);                                                  \
                    _Pragma("GCC unroll 5") for (int p = 0; p < 5; p++)                                     \
                    _Pragma("GCC unroll 5") for (int q = 0; q < 5; q++)                                     \
                        acc[p * 5 + q] += dr * ld16_##SUF(xi + (q * 12 + p) * 8 + r * 16);                  \
                }                                                                                           \
            }                                                                                               \
            _Pragma("GCC unroll 25") for (int t = 0; t < 25; t++)                                           \
                dw[(o * c1 + i) * 25 + t] = hsum16_##SUF(acc[t]);                                           \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
static inline T dot_##SUF(const T *a, const T *b, int64_t len) {                                            \
    vec_##SUF s0 = {0}, s1 = {0};                                                                           \
    int64_t k = 0;                                                                                          \
    for (; k + 2 * LANES <= len; k += 2 * LANES) {                                                          \
        s0 += load_##SUF(a + k) * load_##SUF(b + k);                                                        \
        s1 += load_##SUF(a + k + LANES) * load_##SUF(b + k + LANES);                                        \
    }                                                                                                       \
    for (; k + LANES <= len; k += LANES) s0 += load_##SUF(a + k) * load_##SUF(b + k);                       \
    s0 += s1;                                                                                               \
    T s = 0;                                                                                                \
    for (int l = 0; l < LANES; l++) s += s0[l];                                                             \
    for (; k < len; k++) s += a[k] * b[k];                                                                  \
    return s;                                                                                               \
}                                                                                                           \
/* y (n, out) = x (n, in) W^T + b, with ReLU where relu; four outputs at a time share the loads of x */     \
static void linear_##SUF(const T *x, const T *w, const T *bias, T *y, int64_t n, int64_t in, int64_t out, int relu) { \
    for (int64_t b = 0; b < n; b++) {                                                                       \
        const T *xb = x + b * in;                                                                           \
        int64_t j = 0;                                                                                      \
        for (; j + 4 <= out; j += 4) {                                                                      \
            const T *w0 = w + j * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;                          \
            r16_##SUF s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                               \
            int64_t k = 0;                                                                                  \
            for (; k + 16 <= in; k += 16) {                                                                 \
                r16_##SUF v = ld16_##SUF(xb + k);                                                           \
                s0 += v * ld16_##SUF(w0 + k); s1 += v * ld16_##SUF(w1 + k);                                 \
                s2 += v * ld16_##SUF(w2 + k); s3 += v * ld16_##SUF(w3 + k);                                 \
            }                                                                                               \
            T t[4] = {hsum16_##SUF(s0), hsum16_##SUF(s1), hsum16_##SUF(s2), hsum16_##SUF(s3)};                \
            for (; k < in; k++) { T v = xb[k]; t[0] += v * w0[k]; t[1] += v * w1[k]; t[2] += v * w2[k]; t[3] += v * w3[k]; } \
            for (int u = 0; u < 4; u++) {                                                                   \
                T v = bias[j + u] + t[u];                                                                   \
                y[b * out + j + u] = relu && !(v > 0) && v == v ? 0 : v;  /* torch.relu keeps NaN */        \
            }                                                                                               \
        }                                                                                                   \
        for (; j < out; j++) {                                                                              \
            T v = bias[j] + dot_##SUF(xb, w + j * in, in);                                                  \
            y[b * out + j] = relu && !(v > 0) && v == v ? 0 : v;                                            \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
/* row (len) = sum over m of a[m * a_step] * rows[m * row_step .. + len]: the row in registers, 4 vectors of \
 * 16 at a time, so that each product is one load and one FMA */                                           \
static void axpys_##SUF(const T *a, int64_t a_step, const T *rows, int64_t row_step, int64_t count, T *row,  \
                        int64_t len) {                                                                      \
    int64_t k = 0;                                                                                          \
    for (; k + 64 <= len; k += 64) {                                                                        \
        r16_##SUF s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                   \
        for (int64_t m = 0; m < count; m++) {                                                               \
            T c = a[m * a_step]; const T *r = rows + m * row_step + k;                                      \
            s0 += c * ld16_##SUF(r); s1 += c * ld16_##SUF(r + 16);                                          \
            s2 += c * ld16_##SUF(r + 32); s3 += c * ld16_##SUF(r + 48);                                     \
        }                                                                                                   \
        *(r16u_##SUF *)(row + k) = s0; *(r16u_##SUF *)(row + k + 16) = s1;                                  \
        *(r16u_##SUF *)(row + k + 32) = s2; *(r16u_##SUF *)(row + k + 48) = s3;                             \
    }                                                                                                       \
    for (; k + 16 <= len; k += 16) {                                                                        \
        r16_##SUF s0 = {0};                                                                                 \
        for (int64_t m = 0; m < count; m++) s0 += a[m * a_step] * ld16_##SUF(rows + m * row_step + k);      \
        *(r16u_##SUF *)(row + k) = s0;                                                                      \
    }                                                                                                       \
    for (; k + 8 <= len; k += 8) {                                                                          \
        r8_##SUF s0 = {0};                                                                                  \
        for (int64_t m = 0; m < count; m++) s0 += a[m * a_step] * *(const r8u_##SUF *)(rows + m * row_step + k); \
        *(r8u_##SUF *)(row + k) = s0;                                                                       \
    }                                                                                                       \
    for (; k < len; k++) {                                                                                  \
        T s = 0;                                                                                            \
        for (int64_t m = 0; m < count; m++) s += a[m * a_step] * rows[m * row_step + k];                    \
        row[k] = s;                                                                                         \
    }                                                                                                       \
}                                                                                                           \
/* dW = dy^T x, db = sum dy, and dx = dy W: each output row summed in registers, 4 vectors of it at a time */ \
static void linear_back_##SUF(const T *x, const T *w, const T *dy, T *dw, T *db, T *dx, int64_t n,          \
                              int64_t in, int64_t out) {                                                    \
    for (int64_t j = 0; j < out; j++) {                                                                     \
        T s = 0;                                                                                            \
        for (int64_t b = 0; b < n; b++) s += dy[b * out + j];                                               \
        db[j] = s;                                                                                          \
        axpys_##SUF(dy + j, out, x, in, n, dw + j * in, in);                                                \
    }                                                                                                       \
    for (int64_t b = 0; b < n; b++) axpys_##SUF(dy + b * out, 1, w, in, out, dx + b * in, in);              \
}                                                                                                           \
/* ReLU's gradient through its output h: dy where h > 0 or h is NaN */                                     \
static void relu_back_##SUF(const T *h, T *dy, int64_t len) {                                               \
    for (int64_t k = 0; k < len; k++) dy[k] = (h[k] > 0 || h[k] != h[k]) ? dy[k] : 0;                       \
}                                                                                                           \
void cnn_bn_step_##SUF(const T *x, const int64_t *labels, T **p, T **g, void **ws, const double *hyper,     \
                       int64_t n, int64_t side, int64_t c1, int64_t c2, int64_t f1, int64_t f2, int64_t k,  \
                       double *loss) {                                                                      \
    int64_t s1 = side - 4, q1 = s1 / 2, s2 = q1 - 4, q2 = s2 / 2, feat = c2 * q2 * q2;                     \
    T *y1 = ws[0], *p1 = ws[1], *taken1 = ws[3], *y2 = ws[6], *p2 = ws[7], *taken2 = ws[9];               \
    uint8_t *code1 = ws[2], *code2 = ws[8];                                                                 \
    double *mean1 = ws[4], *invstd1 = ws[5], *mean2 = ws[10], *invstd2 = ws[11];                          \
    T *h1 = ws[12], *h2 = ws[13], *logits = ws[14], *dl = ws[15], *dh2 = ws[16], *dh1 = ws[17];            \
    T *df = ws[18], *dy2 = ws[19], *dp1 = ws[20], *dy1 = ws[21], *dypad = ws[22];  /* dypad: zeroed */      \
    T *xs = ws[23];                                                                                         \
    /* forward */                                                                                           \
    conv1_##SUF(x, p[0], p[1], y1, n, side, side, c1);                                                      \
    bn_relu_pool_##SUF(y1, p[2], p[3], p[14], p[15], hyper[0], hyper[1], p1, code1, taken1, mean1, invstd1, \
                       n, c1, s1, s1);                                                                      \
    shift_rows_##SUF(p1, xs, n * c1);                                                                       \
    for (int64_t b = 0; b < n; b++)                                                                         \
        for (int64_t o = 0; o < c2; o++)                                                                    \
            conv2_image_##SUF(xs + b * c1 * 480, p[4] + o * c1 * 25, p[5][o], y2 + (b * c2 + o) * 64, c1);  \
    bn_relu_pool_##SUF(y2, p[6], p[7], p[16], p[17], hyper[2], hyper[3], p2, code2, taken2, mean2, invstd2, \
                       n, c2, s2, s2);                                                                      \
    linear_##SUF(p2, p[8], p[9], h1, n, feat, f1, 1);                                                       \
    linear_##SUF(h1, p[10], p[11], h2, n, f1, f2, 1);                                                       \
    linear_##SUF(h2, p[12], p[13], logits, n, f2, k, 0);                                                    \
    /* mean cross-entropy and its gradient (softmax - one-hot) / n */                                       \
    double total = 0;                                                                                       \
    for (int64_t b = 0; b < n; b++) {                                                                       \
        const T *l = logits + b * k;                                                                        \
        double m = l[0], s = 0;                                                                             \
        for (int64_t j = 1; j < k; j++) m = l[j] > m ? l[j] : m;                                            \
        for (int64_t j = 0; j < k; j++) s += exp((double)l[j] - m);                                         \
        total += m + log(s) - l[labels[b]];                                                                 \
        for (int64_t j = 0; j < k; j++)                                                                     \
            dl[b * k + j] = (T)((exp((double)l[j] - m) / s - (j == labels[b])) / n);                        \
    }                                                                                                       \
    *loss = total / n;                                                                                      \
    /* backward */                                                                                          \
    linear_back_##SUF(h2, p[12], dl, g[12], g[13], dh2, n, f2, k);                                          \
    relu_back_##SUF(h2, dh2, n * f2);                                                                       \
    linear_back_##SUF(h1, p[10], dh2, g[10], g[11], dh1, n, f1, f2);                                        \
    relu_back_##SUF(h1, dh1, n * f1);                                                                       \
    linear_back_##SUF(p2, p[8], dh1, g[8], g[9], df, n, feat, f1);                                          \
    bn_relu_pool_backward_##SUF(df, code2, taken2, y2, p[6], mean2, invstd2, dy2, g[6], g[7], n, c2, s2, s2); \
    conv2_weight_grad_##SUF(xs, dy2, g[4], g[5], n, c1, c2);                                                \
    for (int64_t b = 0; b < n; b++) {                                                                       \
        for (int q = 0; q < 5; q++)  /* this image's dy rows shifted right by q in zeroed 16-wide rows */    \
            for (int64_t o = 0; o < c2; o++)                                                                \
                for (int r = 0; r < 8; r++)                                                                 \
                    memcpy(dypad + ((q * c2 + o) * 8 + r) * 16 + q, dy2 + ((b * c2 + o) * 8 + r) * 8, 8 * sizeof(T)); \
        for (int64_t i = 0; i < c1; i++)                                                                    \
            conv2_input_grad_##SUF(dypad, p[4], dp1 + (b * c1 + i) * 144, c1, c2, i);                       \
    }                                                                                                       \
    bn_relu_pool_backward_##SUF(dp1, code1, taken1, y1, p[2], mean1, invstd1, dy1, g[2], g[3], n, c1, s1, s1); \
    conv1_weight_grad_##SUF(x, dy1, g[0], g[1], n, side, side, c1);                                         \
}

STEP(float, f32, 8)
STEP(double, f64, 4)

/* Local SGD through cnn_bn_step, all of a client's steps in one call: batch s is rows idx[starts[s]:starts[s+1]]
 * of x_all / y_all (gathered into xb, yb), then the update train.sgd makes for a plain objective: weight decay
 * added to the gradient, momentum (velocity may be 0 without it), params -= lr * step. losses[s]: batch s's mean
 * cross-entropy. No Python between the steps. */
#define SGD(T, SUF)                                                                                         \
void cnn_bn_sgd_##SUF(const T *x_all, const int64_t *y_all, const int64_t *idx, const int64_t *starts,      \
                      int64_t steps, T **p, T **g, void **ws, const double *hyper, int64_t side, int64_t c1, \
                      int64_t c2, int64_t f1, int64_t f2, int64_t k, T *xb, int64_t *yb, T *params, T *grad, \
                      T *velocity, int64_t count, const double *rates, double *losses) {                    \
    double lr = rates[0], momentum = rates[1], decay = rates[2];                                            \
    int64_t image = side * side;                                                                            \
    for (int64_t s = 0; s < steps; s++) {                                                                   \
        int64_t n = starts[s + 1] - starts[s];                                                              \
        for (int64_t j = 0; j < n; j++) {                                                                   \
            int64_t row = idx[starts[s] + j];                                                               \
            memcpy(xb + j * image, x_all + row * image, image * sizeof(T));                                 \
            yb[j] = y_all[row];                                                                             \
        }                                                                                                   \
        cnn_bn_step_##SUF(xb, yb, p, g, ws, hyper, n, side, c1, c2, f1, f2, k, losses + s);                 \
        if (decay > 0) for (int64_t i = 0; i < count; i++) grad[i] += (T)decay * params[i];                 \
        if (velocity) {                                                                                     \
            for (int64_t i = 0; i < count; i++) {                                                           \
                velocity[i] = (T)momentum * velocity[i] + grad[i];                                          \
                params[i] += (T)(-lr) * velocity[i];                                                        \
            }                                                                                               \
        } else {                                                                                            \
            for (int64_t i = 0; i < count; i++) params[i] += (T)(-lr) * grad[i];                            \
        }                                                                                                   \
    }                                                                                                       \
}

SGD(float, f32)
SGD(double, f64)
