/* gdskv._crc32c: CRC32C (Castagnoli) by carry-less multiplication, 1.5-4x google-crc32c (the
 * crc32 instruction, one 8-byte step a cycle at best). Built by `pip install` as an optional
 * extension. gdskv.format checksums pages with it (saves seal with it, gdskv verify checks with
 * it) and hands its address to gdskv.io._batchio, which checksums every chunk it reads with it;
 * where it did not build, or this CPU has no PCLMULQDQ, both keep google-crc32c.
 *
 * The message is folded 16 bytes at a time: with A the 128-bit block at some offset, read as a
 * polynomial whose first bit is its highest coefficient (CRC32C is bit-reflected), A x^(8D) + B
 * has the same remainder mod P as A followed by D - 16 bytes and then B, so A can be added into
 * the block D bytes on. Split A = L x^64 + H: L x^(8D+64) + H x^(8D) reduced mod P is two
 * carry-less 64x32-bit products. Once the blocks are folded into one, the crc32 instruction
 * finishes its 16 bytes and the tail. The fold constants are computed at import from P rather
 * than written out; tests/test_crc32c_kernels.py compares every kernel with google-crc32c over
 * many lengths and alignments.
 *
 * Kernels: "vpclmul" (AVX-512 VPCLMULQDQ, 256 bytes a step in four 512-bit accumulators),
 * "hybrid" (vpclmul's folds and three chains of the crc32 instruction at once, on different
 * execution units), "pclmul" (SSE PCLMULQDQ, 128 bytes a step in eight 128-bit ones) and
 * "chains" (three chains of the crc32 instruction); kernel(NULL) is the fastest one the CPU and
 * OS allow, timed at import (hybrid or vpclmul with AVX-512, chains or pclmul without).
 * Measured, 256 KiB in cache: on a 2-vCPU Xeon VM vpclmul 59 GB/s, pclmul 22, google-crc32c 14;
 * on a 2-vCPU AMD EPYC (Zen 4) VM vpclmul 67, hybrid 91, pclmul 17, google-crc32c 33.
 *
 * crc32c(data, value=0, kernel=None) -> int | None: CRC32C of a buffer continuing from value
 *   (google-crc32c's extend semantics), by the named kernel (None: the chosen one); None where
 *   that kernel cannot run here.
 * crc32c_at(address, nbytes, value=0) -> int: the same over host memory, the GIL released.
 * address() -> int: the chosen kernel as a C function pointer
 *   (uint32_t (*)(uint32_t value, const void *, size_t)), 0 where there is none.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef uint32_t (*crc32c_fn)(uint32_t, const void *, size_t);

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define CRC32C_POLY 0x1EDC6F41u /* P without its x^32 term, highest coefficient in the top bit */

/* x^n mod P, highest coefficient in the top bit. */
static uint32_t xpow_mod(unsigned n) {
    uint32_t r = 1;
    while (n--) r = (r & 0x80000000u) ? (r << 1) ^ CRC32C_POLY : r << 1;
    return r;
}

/* x^n mod P as the 64-bit operand of a reflected carry-less product: coefficient c at bit 63 - c.
 * A product of a reflected 64-bit half with it carries one extra factor x, hence n - 1 below. */
static uint64_t fold_operand(unsigned n) {
    uint32_t v = xpow_mod(n), r = 0;
    for (int i = 0; i < 32; i++) r |= ((v >> i) & 1u) << (31 - i);
    return (uint64_t)r << 32;
}

/* The pair that folds a 16-byte block forward by `d` bytes: low half (L) times x^(8d+64), high
 * half (H) times x^(8d). */
static void fold_pair(unsigned d, uint64_t k[2]) {
    k[0] = fold_operand(8 * d + 63);
    k[1] = fold_operand(8 * d - 1);
}

__attribute__((target("sse4.2")))
static uint32_t crc_bytes(uint32_t c, const unsigned char *p, size_t len) {
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = (uint32_t)_mm_crc32_u64(c, v);
    }
    while (len--) c = _mm_crc32_u8(c, *p++);
    return c;
}

/* The raw state after the folded 16 bytes in `acc`, from a zero state. */
__attribute__((target("sse4.2")))
static uint32_t finish_block(__m128i acc) {
    unsigned char b[16];
    _mm_storeu_si128((__m128i *)b, acc);
    return crc_bytes(0, b, 16);
}

__attribute__((target("sse4.2,pclmul")))
static __m128i fold16(__m128i a, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11));
}

static __m128i pair128(unsigned d) {
    uint64_t k[2];
    fold_pair(d, k);
    return _mm_set_epi64x((long long)k[1], (long long)k[0]);
}

#define HY_TURNS 128
#define HY_V (256 * HY_TURNS)
#define HY_SC 40 /* bytes of each crc32 chain per turn: 5 steps, measured best of 32-64 */
#define HY_S (HY_SC * HY_TURNS)
#define HY_BLOCK (HY_V + 3 * HY_S)

static uint64_t hy_past[3]; /* reflected x^(8 * HY_S * k - 33) mod P, k = 1, 2, 3 */
#define CH_S 8192           /* bytes of each of the "chains" kernel's three crc32 chains a block */
static uint64_t ch_past[2]; /* reflected x^(8 * CH_S * k - 33) mod P, k = 1, 2 */

static uint32_t reflect32(uint32_t v) {
    uint32_t r = 0;
    for (int i = 0; i < 32; i++) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

static struct {
    int ready;
    __m128i by16, by32, by48, by64, by128, by256;
} K;

/* Called by kernel(), which the module's init calls before any kernel runs. */
static void fold_constants(void) {
    if (K.ready) return;
    K.by16 = pair128(16);
    K.by32 = pair128(32);
    K.by48 = pair128(48);
    K.by64 = pair128(64);
    K.by128 = pair128(128);
    K.by256 = pair128(256);
    for (int k = 0; k < 3; k++) hy_past[k] = reflect32(xpow_mod(8u * HY_S * (unsigned)(k + 1) - 33));
    for (int k = 0; k < 2; k++) ch_past[k] = reflect32(xpow_mod(8u * CH_S * (unsigned)(k + 1) - 33));
    K.ready = 1;
}

/* Eight 16-byte accumulators folded by 128 bytes a step, then into one. Both kernels have
 * google-crc32c's crc32c_extend semantics: the inverted state in and out. */
__attribute__((target("sse4.2,pclmul")))
static uint32_t crc32c_pclmul(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    uint32_t c = ~crc;
    if (len >= 256) {
        __m128i x[8];
        for (int i = 0; i < 8; i++) x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
        x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c));
        p += 128;
        len -= 128;
        for (; len >= 128; p += 128, len -= 128)
            for (int i = 0; i < 8; i++)
                x[i] = _mm_xor_si128(fold16(x[i], K.by128), _mm_loadu_si128((const __m128i *)(p + 16 * i)));
        for (int i = 1; i < 8; i++) x[i] = _mm_xor_si128(x[i], fold16(x[i - 1], K.by16));
        c = finish_block(x[7]);
    }
    return ~crc_bytes(c, p, len);
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static __m512i fold64(__m512i a, __m512i k) {
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11));
}

/* The four 64-byte accumulators of a vector run: its first 256 bytes, raw state `c` added in. */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static inline void vec_start(__m512i x[4], const unsigned char *p, uint32_t c) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) x[i] = _mm512_loadu_si512(p + 64 * i);
    x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
}

/* One step: each accumulator folded 256 bytes on and the next 256 bytes at `p` added in. */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static inline void vec_step(__m512i x[4], const unsigned char *p, __m512i by256) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x[i], by256, 0x00),
                                         _mm512_clmulepi64_epi128(x[i], by256, 0x11), _mm512_loadu_si512(p + 64 * i), 0x96);
}

/* The raw state after the run: the accumulators folded into one, its four lanes into 16 bytes. */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static inline uint32_t vec_finish(__m512i x[4]) {
    const __m512i by64 = _mm512_broadcast_i32x4(K.by64);
#pragma GCC unroll 3
    for (int i = 1; i < 4; i++) x[i] = _mm512_xor_si512(x[i], fold64(x[i - 1], by64));
    __m128i r = _mm_xor_si128(fold16(_mm512_extracti32x4_epi32(x[3], 0), K.by48),
                              fold16(_mm512_extracti32x4_epi32(x[3], 1), K.by32));
    r = _mm_xor_si128(r, fold16(_mm512_extracti32x4_epi32(x[3], 2), K.by16));
    return finish_block(_mm_xor_si128(r, _mm512_extracti32x4_epi32(x[3], 3)));
}

/* Four 64-byte accumulators folded by 256 bytes a step, then into one, then its four lanes. */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static uint32_t crc32c_vpclmul(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    uint32_t c = ~crc;
    if (len >= 512) {
        const __m512i by256 = _mm512_broadcast_i32x4(K.by256);
        __m512i x[4];
        vec_start(x, p, c);
        for (p += 256, len -= 256; len >= 256; p += 256, len -= 256) vec_step(x, p, by256);
        c = vec_finish(x);
    }
    return ~crc_bytes(c, p, len);
}

/* The raw state `r` moved past m bytes, r * x^(8m) mod P, with `k` the reflected x^(8m - 33) mod
 * P: the 63-bit product read as the crc32 instruction's 64-bit operand carries x^33 more. */
__attribute__((target("sse4.2,pclmul")))
static uint32_t moved_past(uint32_t r, uint64_t k) {
    __m128i p = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)r), _mm_cvtsi64_si128((long long)k), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(p));
}

#define CRC_STEP(s, q) do { uint64_t v_; memcpy(&v_, (q), 8); (s) = _mm_crc32_u64((s), v_); } while (0)

/* "hybrid": the vector folds and the crc32 instruction at once, on different execution units.
 * A block of HY_BLOCK bytes is cut in four: the first HY_V bytes go through vpclmul's folds, the
 * other three HY_S each through a chain of crc32 instructions (three chains hide its latency),
 * one 256-byte fold step and five 8-byte steps of each chain per loop turn; the four raw states
 * are then joined, each moved past the bytes after it by a multiplication by x^(8m) mod P. On
 * cores that run 512-bit carry-less products at half rate (AMD Zen 4) the folds alone leave the
 * crc32 unit idle. */
__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static uint32_t hybrid_block(uint32_t c, const unsigned char *p) {
    const __m512i by256 = _mm512_broadcast_i32x4(K.by256);
    const unsigned char *q1 = p + HY_V, *q2 = q1 + HY_S, *q3 = q2 + HY_S;
    uint64_t s1 = 0, s2 = 0, s3 = 0;
    __m512i x[4];
    vec_start(x, p, c);
    for (int t = 0; t < HY_TURNS; t++, q1 += HY_SC, q2 += HY_SC, q3 += HY_SC) {
#pragma GCC unroll 5
        for (int i = 0; i < HY_SC; i += 8) {
            CRC_STEP(s1, q1 + i);
            CRC_STEP(s2, q2 + i);
            CRC_STEP(s3, q3 + i);
        }
        if (t + 1 < HY_TURNS) vec_step(x, p += 256, by256);
    }
    uint32_t a = vec_finish(x);
    return moved_past(a, hy_past[2]) ^ moved_past((uint32_t)s1, hy_past[1]) ^ moved_past((uint32_t)s2, hy_past[0]) ^
           (uint32_t)s3;
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
static uint32_t crc32c_hybrid(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    uint32_t c = ~crc;
    for (; len >= HY_BLOCK; p += HY_BLOCK, len -= HY_BLOCK) c = hybrid_block(c, p);
    return crc32c_vpclmul(~c, p, len);
}

/* "chains": three chains of the crc32 instruction over the thirds of each 24 KiB block, joined as
 * the hybrid kernel joins its states: its one-step-a-cycle pace where the 128-bit folds are
 * slower (a Zen 4 core runs them at half rate: 17 GB/s against 33). */
__attribute__((target("sse4.2,pclmul")))
static uint32_t crc32c_chains(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    uint64_t c = ~crc;
    for (; len >= 3 * CH_S; p += 3 * CH_S, len -= 3 * CH_S) {
        const unsigned char *q2 = p + CH_S, *q3 = q2 + CH_S;
        uint64_t s2 = 0, s3 = 0;
        for (size_t i = 0; i < CH_S; i += 8) {
            CRC_STEP(c, p + i);
            CRC_STEP(s2, q2 + i);
            CRC_STEP(s3, q3 + i);
        }
        c = moved_past((uint32_t)c, ch_past[1]) ^ moved_past((uint32_t)s2, ch_past[0]) ^ (uint32_t)s3;
    }
    return ~crc_bytes((uint32_t)c, p, len);
}

/* Whichever of two kernels checksums 94 KiB faster here (best of five each, about 20-50
 * microseconds in all): which is faster depends on the core's carry-less multiplier. */
static crc32c_fn faster(crc32c_fn a, crc32c_fn b) {
    static unsigned char probe[2 * HY_BLOCK];
    double best[2] = {1e9, 1e9};
    crc32c_fn fn[2] = {a, b};
    volatile uint32_t sink = 0;
    for (int round = 0; round < 5; round++)
        for (int k = 0; k < 2; k++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            sink ^= fn[k](sink, probe, sizeof probe);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            if (s < best[k]) best[k] = s;
        }
    return best[0] <= best[1] ? a : b;
}

/* A kernel by name ("vpclmul", "hybrid", "pclmul", "chains"; NULL for the fastest one here), or
 * NULL where this CPU or OS lacks what it needs. */
static crc32c_fn kernel(const char *name) {
    __builtin_cpu_init();
    fold_constants();
    int sse42 = __builtin_cpu_supports("sse4.2");
    int pclmul = sse42 && __builtin_cpu_supports("pclmul");
    int vpclmul = pclmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("vpclmulqdq");
    if (!name) return vpclmul ? faster(crc32c_hybrid, crc32c_vpclmul) : pclmul ? faster(crc32c_chains, crc32c_pclmul) : NULL;
    if (!strcmp(name, "vpclmul")) return vpclmul ? crc32c_vpclmul : NULL;
    if (!strcmp(name, "pclmul")) return pclmul ? crc32c_pclmul : NULL;
    if (!strcmp(name, "hybrid")) return vpclmul ? crc32c_hybrid : NULL;
    if (!strcmp(name, "chains")) return pclmul ? crc32c_chains : NULL;
    return NULL;
}

#else

static crc32c_fn kernel(const char *name) {
    (void)name;
    return NULL;
}

#endif

static crc32c_fn chosen;

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned int value = 0;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "y*|Iz", &buf, &value, &name)) return NULL;
    crc32c_fn fn = name ? kernel(name) : chosen;
    if (!fn) {
        PyBuffer_Release(&buf);
        Py_RETURN_NONE;
    }
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = fn(value, buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *crc32c_at(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t nbytes;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "Kn|I", &address, &nbytes, &value)) return NULL;
    if (!chosen || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, chosen ? "crc32c_at: negative length" : "crc32c_at: no kernel on this CPU");
        return NULL;
    }
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = chosen(value, (const void *)(uintptr_t)address, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(c);
}

static PyObject *address(PyObject *self, PyObject *noargs) {
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)chosen);
}

static PyMethodDef methods[] = {
    {"crc32c", crc32c, METH_VARARGS, "CRC32C of a buffer by a named kernel (see the module source)."},
    {"crc32c_at", crc32c_at, METH_VARARGS, "CRC32C of host memory at an address, by the chosen kernel."},
    {"address", address, METH_NOARGS, "The chosen kernel as a C function pointer, 0 where there is none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crc32c(void) {
    chosen = kernel(NULL);
    return PyModule_Create(&module);
}
