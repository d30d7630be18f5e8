/* One pass over a page's bytes that both copies them and computes their CRC-32C.

   A raw page arriving from below (a same-host store's arena, a disk file in cache) has to be
   copied into its pool page, which on a CPU pool is 64 strided blocks of the layer-first pool,
   and checksummed before it is used. Done as two passes (numpy's copy, then the crc32c
   package over the source), the copy's stores read every destination line first
   (read-for-ownership) and the checksum reads the source a second time; and glibc's
   `rep movsb` for 32 KiB blocks is slow on some x86 parts. Here each 8-byte word is loaded
   once, fed to the CPU's crc32 instruction and written with a non-temporal store (no
   read-for-ownership): the memory traffic of a memcpy, and three independent CRC streams per
   block keep the crc32 unit's latency hidden (combined with the GF(2) shift, as zlib's
   crc32_combine does for its polynomial).

   copy_crc(src, dest, crc) -> crc
     src:  a contiguous buffer (read-only is fine), the page's bytes in order;
     dest: a writable buffer of the same size, up to 3 dimensions, the last one contiguous (a
           pool page's (layers, 2, bytes) blocks, or a contiguous row);
     crc:  the CRC-32C of what came before (the blob's header), continued over src.
   The GIL is released while it runs. Built on x86-64 only (SSE4.2); `available()` says whether
   this CPU has the instruction (tiered_cache/wire/checked_copy.py falls back otherwise). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_CRC_INSN 1
#define HOT __attribute__((target("sse4.2")))
#else
#define HAVE_CRC_INSN 0
#endif

#define POLY 0x82f63b78u /* CRC-32C, reflected */

/* a * b modulo the polynomial (reflected bit order), as zlib's multmodp */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

static uint32_t x2n_table[32]; /* x^(2^n) modulo the polynomial */

static void init_x2n_table(void) {
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++)
        x2n_table[n] = p = multmodp(p, p);
}

/* x^(8 * nbytes): multiplying a CRC by it appends nbytes of zeros */
static uint32_t shift_for(size_t nbytes) {
    uint32_t p = 1u << 31; /* x^0 */
    unsigned k = 3;
    while (nbytes) {
        if (nbytes & 1)
            p = multmodp(x2n_table[k & 31], p);
        nbytes >>= 1;
        k++;
    }
    return p;
}

#if HAVE_CRC_INSN
/* The raw CRC register (no pre/post inversion) continued over n bytes, each copied to dst as it
   is read: every byte is read once, so what is stored is what is checksummed. */
HOT static uint32_t copy_crc_bytes(uint32_t state, const uint8_t *src, uint8_t *dst, size_t n) {
    uint64_t state64 = state;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, src, 8);
        state64 = _mm_crc32_u64(state64, v);
        memcpy(dst, &v, 8);
        src += 8;
        dst += 8;
        n -= 8;
    }
    state = (uint32_t)state64;
    while (n--) {
        uint8_t b = *src++;
        state = _mm_crc32_u8(state, b);
        *dst++ = b;
    }
    return state;
}

/* One contiguous run: copied src -> dst, the CRC continued from `crc` (a finished CRC-32C).
   With an 8-byte aligned dst, the run's first 3 * seg bytes go as three interleaved streams
   stored non-temporally; `shift` is shift_for(seg). */
HOT static uint32_t copy_run(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t n, size_t seg, uint32_t shift) {
    size_t done = 0;
    if (seg && ((uintptr_t)dst & 7) == 0) {
        const uint8_t *a = src, *b = src + seg, *c = src + 2 * seg;
        long long *da = (long long *)dst, *db = (long long *)(dst + seg), *dc = (long long *)(dst + 2 * seg);
        uint64_t sa = ~crc, sb = 0xffffffffu, sc = 0xffffffffu;
        size_t words = seg / 8;
        for (size_t i = 0; i < words; i++) {
            uint64_t va, vb, vc;
            memcpy(&va, a + 8 * i, 8);
            memcpy(&vb, b + 8 * i, 8);
            memcpy(&vc, c + 8 * i, 8);
            sa = _mm_crc32_u64(sa, va);
            sb = _mm_crc32_u64(sb, vb);
            sc = _mm_crc32_u64(sc, vc);
            _mm_stream_si64(da + i, (long long)va);
            _mm_stream_si64(db + i, (long long)vb);
            _mm_stream_si64(dc + i, (long long)vc);
        }
        /* crc(A B C) from the three: crc(A B) = crc(A) * x^(8|B|) + crc(B), and so on */
        uint32_t ab = multmodp(shift, ~(uint32_t)sa) ^ ~(uint32_t)sb;
        crc = multmodp(shift, ab) ^ ~(uint32_t)sc;
        done = 3 * seg;
    }
    if (done < n)
        crc = ~copy_crc_bytes(~crc, src + done, dst + done, n - done);
    return crc;
}

/* Runs of `inner` bytes at dst + i*s0 + j*s1 (i < n0, j < n1), filled from src in order. */
HOT static uint32_t copy_crc_strided(const uint8_t *src, uint8_t *dst, Py_ssize_t n0, Py_ssize_t n1,
                                     Py_ssize_t s0, Py_ssize_t s1, size_t inner, uint32_t crc) {
    size_t seg = (inner / 24) * 8; /* each of the three streams: a whole number of words */
    uint32_t shift = seg ? shift_for(seg) : 0;
    for (Py_ssize_t i = 0; i < n0; i++)
        for (Py_ssize_t j = 0; j < n1; j++) {
            crc = copy_run(crc, src, dst + i * s0 + j * s1, inner, seg, shift);
            src += inner;
        }
    _mm_sfence(); /* the non-temporal stores are visible before this returns */
    return crc;
}
#endif

static int has_crc_insn; /* this CPU has SSE4.2's crc32 (found once, at import) */

static int cpu_has_crc(void) {
#if HAVE_CRC_INSN
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
#else
    return 0;
#endif
}

static PyObject *available(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyBool_FromLong(has_crc_insn);
}

static PyObject *copy_crc(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *dst_obj;
    unsigned long crc_in;
    if (!PyArg_ParseTuple(args, "OOk", &src_obj, &dst_obj, &crc_in))
        return NULL;
    if (!has_crc_insn) {
        PyErr_SetString(PyExc_RuntimeError, "copy_crc: this CPU lacks the crc32 instruction (SSE4.2)");
        return NULL;
    }
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t shape[3] = {1, 1, 1}, strides[3] = {0, 0, 1};
    int ndim = dst.ndim;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_crc: destination holds %zd bytes, source %zd", dst.len, src.len);
        goto done;
    }
    if (ndim > 3 || dst.itemsize != 1 || (ndim && dst.strides[ndim - 1] != 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_crc: destination must be bytes of at most 3 dimensions, the last contiguous");
        goto done;
    }
    for (int d = 0; d < ndim; d++) {
        shape[3 - ndim + d] = dst.shape[d];
        strides[3 - ndim + d] = dst.strides[d];
    }
#if HAVE_CRC_INSN
    {
        uint32_t crc = (uint32_t)crc_in;
        if (src.len) {
            Py_BEGIN_ALLOW_THREADS
            crc = copy_crc_strided((const uint8_t *)src.buf, (uint8_t *)dst.buf, shape[0], shape[1], strides[0],
                                   strides[1], (size_t)shape[2], crc);
            Py_END_ALLOW_THREADS
        }
        result = PyLong_FromUnsignedLong(crc);
    }
#endif
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_crc", copy_crc, METH_VARARGS, "copy_crc(src, dest, crc) -> crc: copy src into dest, CRC-32C continued."},
    {"available", available, METH_NOARGS, "Whether this CPU has the crc32 instruction copy_crc needs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_checked_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__checked_copy(void) {
    init_x2n_table();
    has_crc_insn = cpu_has_crc();
    return PyModule_Create(&module);
}
