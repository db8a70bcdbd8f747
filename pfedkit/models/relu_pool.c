/* ReLU then 2x2 max pooling with stride 2, forward and backward, equal to F.max_pool2d(torch.relu(z), 2) and its
 * gradient in PyTorch (values, the window position that takes the gradient, NaN handling), for contiguous
 * (planes, h, w) float32/float64 tensors with h and w even. pfedkit/models/native.py compiles it with the host's
 * C compiler and calls it through ctypes (which releases the GIL, so clients side by side run it on their cores).
 *
 * Why: on a CPU, PyTorch's max_pool2d kernel in the standard layout is scalar and took ~30 % of a small CNN's
 * training step (0.87 ms for a (32, 16, 24, 24) batch on one thread); this one is a few vector passes (~0.08 ms).
 *
 * Semantics kept from PyTorch: relu keeps NaN; max_pool2d scans a window row by row and moves to a later element
 * when it is greater or NaN (ties keep the first, the last NaN wins); relu's gradient passes where its input is
 * > 0 or NaN. Scanning the two rows' pairs first and then comparing the two pair winners the same way gives the
 * same element. `code` records it per output: 0..3 (row-major in the window), 4 when no gradient flows.
 *
 * Written with GCC/Clang vector extensions (8 float or 4 double lanes, 32 bytes): with -march=native they become
 * AVX/AVX-512 instructions, elsewhere the compiler splits them. No branch depends on the data, since the window
 * winners are random and mispredicted branches made a scalar version 15x slower. */
#include <stdint.h>
#include <string.h>

#define NO_GRAD 4

#define KERNELS(T, I, SUF, LANES, EVEN, ODD, LOW, HIGH)                                                       \
typedef T vec_##SUF __attribute__((vector_size(32)));                                                       \
typedef I mask_##SUF __attribute__((vector_size(32)));                                                      \
typedef uint8_t code_##SUF __attribute__((vector_size(LANES)));                                             \
                                                                                                            \
static inline vec_##SUF relu_##SUF(vec_##SUF v) { return (vec_##SUF)((mask_##SUF)v & ~(v <= 0)); }         \
static inline mask_##SUF later_##SUF(vec_##SUF later, vec_##SUF first) {                                   \
    return (later > first) | (later != later);                                                              \
}                                                                                                           \
static inline vec_##SUF pick_##SUF(mask_##SUF m, vec_##SUF yes, vec_##SUF no) {                             \
    return (vec_##SUF)((m & (mask_##SUF)yes) | (~m & (mask_##SUF)no));                                      \
}                                                                                                           \
                                                                                                            \
/* LANES outputs from 2 * LANES inputs of each of the window's two rows */                                  \
static inline void forward_block_##SUF(const T *r0, const T *r1, T *out, uint8_t *code) {                   \
    vec_##SUF x0, x1, y0, y1;                                                                               \
    memcpy(&x0, r0, 32); memcpy(&x1, r0 + LANES, 32); memcpy(&y0, r1, 32); memcpy(&y1, r1 + LANES, 32);    \
    const mask_##SUF even = EVEN, odd = ODD;                                                                \
    vec_##SUF a = relu_##SUF(__builtin_shuffle(x0, x1, even)), b = relu_##SUF(__builtin_shuffle(x0, x1, odd)); \
    vec_##SUF c = relu_##SUF(__builtin_shuffle(y0, y1, even)), d = relu_##SUF(__builtin_shuffle(y0, y1, odd)); \
    mask_##SUF top_right = later_##SUF(b, a), bottom_right = later_##SUF(d, c);                             \
    vec_##SUF top = pick_##SUF(top_right, b, a), bottom = pick_##SUF(bottom_right, d, c);                  \
    mask_##SUF lower = later_##SUF(bottom, top);                                                            \
    vec_##SUF best = pick_##SUF(lower, bottom, top);                                                        \
    /* masks are 0 or -1: the top row gives 0 or 1, the bottom 2 or 3 */                                    \
    mask_##SUF at = (lower & (2 - bottom_right)) | (~lower & -top_right);                                   \
    mask_##SUF dead = best <= 0;                                                                            \
    at = (at & ~dead) | (dead & NO_GRAD);                                                                   \
    code_##SUF c8 = __builtin_convertvector(at, code_##SUF);                                                \
    memcpy(out, &best, 32); memcpy(code, &c8, LANES);                                                       \
}                                                                                                           \
                                                                                                            \
/* the gradients of LANES outputs spread to their window positions in both rows */                          \
static inline void backward_block_##SUF(const T *g, const uint8_t *code, T *r0, T *r1) {                    \
    vec_##SUF gv; code_##SUF c8;                                                                            \
    memcpy(&gv, g, 32); memcpy(&c8, code, LANES);                                                           \
    mask_##SUF at = __builtin_convertvector(c8, mask_##SUF), gi = (mask_##SUF)gv;                           \
    vec_##SUF q0 = (vec_##SUF)(gi & (at == 0)), q1 = (vec_##SUF)(gi & (at == 1));                           \
    vec_##SUF q2 = (vec_##SUF)(gi & (at == 2)), q3 = (vec_##SUF)(gi & (at == 3));                           \
    const mask_##SUF low = LOW, high = HIGH;                                                                \
    vec_##SUF v;                                                                                            \
    v = __builtin_shuffle(q0, q1, low); memcpy(r0, &v, 32);                                                 \
    v = __builtin_shuffle(q0, q1, high); memcpy(r0 + LANES, &v, 32);                                        \
    v = __builtin_shuffle(q2, q3, low); memcpy(r1, &v, 32);                                                 \
    v = __builtin_shuffle(q2, q3, high); memcpy(r1 + LANES, &v, 32);                                        \
}                                                                                                           \
                                                                                                            \
void relu_pool_##SUF(const T *z, T *out, uint8_t *code, int64_t planes, int64_t h, int64_t w) {             \
    int64_t ow = w / 2, rows = planes * (h / 2);                                                            \
    for (int64_t r = 0; r < rows; r++) {                                                                    \
        const T *r0 = z + 2 * r * w, *r1 = r0 + w;                                                          \
        T *o = out + r * ow; uint8_t *c = code + r * ow;                                                    \
        int64_t j = 0;                                                                                      \
        for (; j + LANES <= ow; j += LANES) forward_block_##SUF(r0 + 2 * j, r1 + 2 * j, o + j, c + j);      \
        if (j < ow) { /* the row's last outputs, through a zero-padded copy */                              \
            T t0[2 * LANES] = {0}, t1[2 * LANES] = {0}, to[LANES]; uint8_t tc[LANES]; int64_t n = ow - j;   \
            memcpy(t0, r0 + 2 * j, 2 * n * sizeof(T)); memcpy(t1, r1 + 2 * j, 2 * n * sizeof(T));           \
            forward_block_##SUF(t0, t1, to, tc);                                                            \
            memcpy(o + j, to, n * sizeof(T)); memcpy(c + j, tc, n);                                         \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
void relu_pool_backward_##SUF(const T *g, const uint8_t *code, T *gz, int64_t planes, int64_t h, int64_t w) { \
    int64_t ow = w / 2, rows = planes * (h / 2);                                                            \
    for (int64_t r = 0; r < rows; r++) {                                                                    \
        T *r0 = gz + 2 * r * w, *r1 = r0 + w;                                                               \
        const T *gr = g + r * ow; const uint8_t *c = code + r * ow;                                         \
        int64_t j = 0;                                                                                      \
        for (; j + LANES <= ow; j += LANES) backward_block_##SUF(gr + j, c + j, r0 + 2 * j, r1 + 2 * j);    \
        if (j < ow) {                                                                                       \
            T tg[LANES] = {0}, t0[2 * LANES], t1[2 * LANES]; uint8_t tc[LANES] = {0}; int64_t n = ow - j;   \
            memcpy(tg, gr + j, n * sizeof(T)); memcpy(tc, c + j, n);                                        \
            backward_block_##SUF(tg, tc, t0, t1);                                                           \
            memcpy(r0 + 2 * j, t0, 2 * n * sizeof(T)); memcpy(r1 + 2 * j, t1, 2 * n * sizeof(T));           \
        }                                                                                                   \
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
