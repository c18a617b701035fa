/* gdskv._keys: the native half of gdskv.keys. Token ids packed as the block-key formula wants
 * them and SHA-256 (FIPS 180-4) of many short messages in one call. Built by `pip install` as an
 * optional extension; where it did not build, gdskv.keys packs with struct and hashes with
 * hashlib, one block at a time.
 *
 * A lookup of a 32k-token prompt packs 32k token ids, hashes 512 chained block keys (about 580
 * bytes each) and 512 store keys, on the serving thread. Through struct and hashlib that is
 * 2-3 ms of interpreter work (a hash object, four updates and a digest per key, about 2.5 us,
 * against 0.3 us of hashing); here the messages are laid out in one buffer and compressed back
 * to back, the GIL released for long runs.
 *
 * Kernels: "shani" (the SHA extensions' sha256rnds2/msg1/msg2, where the CPU has them) and
 * "portable" (plain C). The round constants and initial state are computed at import from
 * their definitions (the fractional parts of the cube and square roots of the first primes)
 * rather than written out; tests/test_keys.py checks every kernel against hashlib over
 * message lengths around the 64-byte block and padding boundaries.
 *
 * chain(head, parent, mid, data, step, tail, kernel=None) -> bytes | None
 *   len(data) // step digests, 32 bytes each, end to end: digest i is SHA-256 of
 *   head || d(i-1) || mid || data[i*step:(i+1)*step] || tail, where d(-1) is `parent` (32 bytes).
 *   The block-key chain of gdskv.keys.chain_keys. None where the named kernel cannot run here.
 * each(head, data, step, kernel=None) -> bytes | None
 *   len(data) // step digests end to end: digest i is SHA-256 of head || data[i*step:(i+1)*step].
 *   The store keys of gdskv.keys.store_key_run.
 * kernel() -> str: the kernel chosen for this CPU.
 * pack_tokens(tokens: list) -> bytes | None: each id as 8 little-endian bytes (struct's "<q"),
 *   None unless every item is a plain int (not a bool or another int subclass) that fits.
 * plain_ints(tokens: list) -> bool: whether every item is a plain int.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*compress_fn)(uint32_t state[8], const unsigned char *blocks, size_t n);

static uint32_t K[64];
static uint32_t H0[8];

/* The first 32 bits of the fractional part of root(p) for the first primes. */
static void constants(void) {
    int found = 0;
    for (int p = 2; found < 64; p++) {
        int prime = 1;
        for (int d = 2; d * d <= p; d++)
            if (p % d == 0) prime = 0;
        if (!prime) continue;
        double c = cbrt((double)p);
        K[found] = (uint32_t)((c - floor(c)) * 4294967296.0);
        if (found < 8) {
            double s = sqrt((double)p);
            H0[found] = (uint32_t)((s - floor(s)) * 4294967296.0);
        }
        found++;
    }
}

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress_portable(uint32_t s[8], const unsigned char *p, size_t n) {
    for (; n--; p += 64) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        s[0] += a, s[1] += b, s[2] += c, s[3] += d, s[4] += e, s[5] += f, s[6] += g, s[7] += h;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>

/* The state lives in two registers as the instructions want it: ABEF and CDGH. Four rounds a
 * step: sha256rnds2 does two with the low half of message-plus-constant, then two with the high
 * half; the schedule's next four words come from the last sixteen by msg1, one alignr and msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_shani(uint32_t s[8], const unsigned char *p, size_t n) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&s[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&s[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; n--; p += 64) {
        __m128i abef0 = abef, cdgh0 = cdgh, w[4];
        for (int q = 0; q < 16; q++) {
            if (q < 4) {
                w[q] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * q)), swap);
            } else {
                __m128i t = _mm_sha256msg1_epu32(w[q & 3], w[(q + 1) & 3]);
                t = _mm_add_epi32(t, _mm_alignr_epi8(w[(q + 3) & 3], w[(q + 2) & 3], 4));
                w[q & 3] = _mm_sha256msg2_epu32(t, w[(q + 3) & 3]);
            }
            __m128i m = _mm_add_epi32(w[q & 3], _mm_loadu_si128((const __m128i *)&K[4 * q]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, m);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(m, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&s[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&s[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int has_shani(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
}
#else
static int has_shani(void) { return 0; }
#define compress_shani compress_portable
#endif

static compress_fn chosen;
static const char *chosen_name;

/* The named kernel, or the chosen one for NULL; NULL where it cannot run here. */
static compress_fn kernel_named(const char *name) {
    if (!name) return chosen;
    if (!strcmp(name, "portable")) return compress_portable;
    if (!strcmp(name, "shani")) return has_shani() ? compress_shani : NULL;
    return NULL;
}

/* SHA-256 of msg[0:len] into out; `msg` has room for the padding (len + 72 bytes). */
static void digest(compress_fn compress, unsigned char *msg, size_t len, unsigned char out[32]) {
    size_t padded = (len + 8) / 64 * 64 + 64;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, padded - len - 1);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) msg[padded - 1 - i] = (unsigned char)(bits >> (8 * i));
    uint32_t s[8];
    memcpy(s, H0, sizeof s);
    compress(s, msg, padded / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s[i] >> 8);
        out[4 * i + 3] = (unsigned char)s[i];
    }
}

/* Runs long enough to be worth letting other threads run meanwhile. */
#define RELEASE_BYTES (64 * 1024)

/* The digests of `n` messages head || [prev] || mid || data[i] || tail, each written at
 * out + 32 i; `chained`: prev is the previous digest (the first one's is `parent`). */
static int digests(compress_fn compress, Py_buffer *head, const unsigned char *parent, Py_buffer *mid,
                   Py_buffer *data, Py_ssize_t step, Py_buffer *tail, int chained, unsigned char *out, Py_ssize_t n) {
    size_t len = (size_t)head->len + (chained ? 32 : 0) + (size_t)mid->len + (size_t)step + (size_t)tail->len;
    unsigned char *msg = malloc(len + 72);
    if (!msg) return -1;
    memcpy(msg, head->buf, head->len);
    unsigned char *at = msg + head->len;
    unsigned char *body = at + (chained ? 32 : 0);
    memcpy(body, mid->buf, mid->len);
    body += mid->len;
    memcpy(body + step, tail->buf, tail->len);
    int release = (size_t)n * len >= RELEASE_BYTES;
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (chained) memcpy(at, i ? out + 32 * (i - 1) : parent, 32);
        memcpy(body, (const unsigned char *)data->buf + i * step, step);
        digest(compress, msg, len, out + 32 * i);
    }
    if (release) PyEval_RestoreThread(saved);
    free(msg);
    return 0;
}

static PyObject *run(Py_buffer *head, const unsigned char *parent, Py_buffer *mid, Py_buffer *data, Py_ssize_t step,
                     Py_buffer *tail, int chained, const char *name) {
    compress_fn compress = kernel_named(name);
    if (!compress) Py_RETURN_NONE;
    if (step < 1) {
        PyErr_SetString(PyExc_ValueError, "step must be at least 1");
        return NULL;
    }
    Py_ssize_t n = data->len / step;
    PyObject *out = PyBytes_FromStringAndSize(NULL, 32 * n);
    if (out && digests(compress, head, parent, mid, data, step, tail, chained, (unsigned char *)PyBytes_AS_STRING(out), n) < 0) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    return out;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer head, parent, mid, data, tail;
    Py_ssize_t step;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*ny*|z", &head, &parent, &mid, &data, &step, &tail, &name)) return NULL;
    PyObject *out = NULL;
    if (parent.len != 32)
        PyErr_SetString(PyExc_ValueError, "the parent digest must be 32 bytes");
    else
        out = run(&head, parent.buf, &mid, &data, step, &tail, 1, name);
    PyBuffer_Release(&head);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&mid);
    PyBuffer_Release(&data);
    PyBuffer_Release(&tail);
    return out;
}

static PyObject *each(PyObject *self, PyObject *args) {
    Py_buffer head, data;
    Py_ssize_t step;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "y*y*n|z", &head, &data, &step, &name)) return NULL;
    Py_buffer none = {0};
    none.buf = "";
    PyObject *out = run(&head, NULL, &none, &data, step, &none, 0, name);
    PyBuffer_Release(&head);
    PyBuffer_Release(&data);
    return out;
}

static PyObject *pack_tokens(PyObject *self, PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (!out) return NULL;
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, at += 8) {
        PyObject *item = PyList_GET_ITEM(list, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (!PyLong_CheckExact(item) || overflow) {  /* exact ints never fail otherwise */
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        uint64_t u = (uint64_t)v;
        for (int b = 0; b < 8; b++) at[b] = (unsigned char)(u >> (8 * b));
    }
    return out;
}

static PyObject *plain_ints(PyObject *self, PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(list, i))) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(chosen_name);
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Chained SHA-256 digests of fixed-size records (see the module source)."},
    {"each", each, METH_VARARGS, "SHA-256 of a fixed prefix and each fixed-size record (see the module source)."},
    {"kernel", kernel, METH_NOARGS, "The kernel chosen for this CPU."},
    {"pack_tokens", pack_tokens, METH_O, "Token ids as little-endian int64 bytes; None unless all are plain ints that fit."},
    {"plain_ints", plain_ints, METH_O, "Whether every item of a list is a plain int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keys(void) {
    constants();
    int shani = has_shani();
    chosen = shani ? compress_shani : compress_portable;
    chosen_name = shani ? "shani" : "portable";
    return PyModule_Create(&module);
}
