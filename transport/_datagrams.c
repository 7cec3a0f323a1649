/* halo.transport._datagrams: the per-datagram work of the UDP transport in C (optional; transport/wire.py, udp/ and
 * erasure.py do the same in Python where this is not built).
 *
 * Why: a round of the fast reliable path moves ~6 datagrams per peer each way, and in Python each one cost ~7 us of
 * packing, tagging, checking and a system call apiece: on a 2-core box with 4 processes that was a third of a
 * token. Here a vector's datagrams are packed and tagged in one call and sent to every recipient with one
 * sendmmsg(); received ones are read up to RECV_BATCH at a time with recvmmsg() and checked exactly as
 * wire.Codec.unpack checks them, in its order, with its reason names (tests compare the two on forged input).
 *
 * The tag is keyed BLAKE2b-128 (RFC 7693) over header and payload, the same bytes hashlib.blake2b(key=...,
 * digest_size=16) gives; the key block is compressed once, when the key is set (`keyed`). The one state kept between
 * calls is whether the kernel refused segmentation offload (sendmany); the counters, replay windows and statistics
 * stay in Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define MAX_DATAGRAM 1472
#define HEADER_BYTES 32
#define TAG_BYTES 16
#define MAX_PAYLOAD (MAX_DATAGRAM - HEADER_BYTES - TAG_BYTES)
#define WIRE_VERSION 5 /* wire.VERSION */
#define MAX_KIND 4  /* PARITY_Q */
#define MAX_DTYPE 2 /* INT8 */
#define RECV_BATCH 64 /* also the module constant RECV_BATCH */
#define SEND_BATCH 64
#define KEY_BYTES 32

/* ---- BLAKE2b ---------------------------------------------------------------------------------------------- */
static const uint64_t IV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                               0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                               0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t load64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}
static inline void store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)                                                                                        \
    do {                                                                                                           \
        a = a + b + (x); d = ROTR(d ^ a, 32); c = c + d; b = ROTR(b ^ c, 24);                                     \
        a = a + b + (y); d = ROTR(d ^ a, 16); c = c + d; b = ROTR(b ^ c, 63);                                     \
    } while (0)

static void compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) v[i] = h[i], v[i + 8] = IV[i];
    v[12] ^= t; /* message lengths here are far below 2^64 bytes: the counter's high word stays 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The state after the key block: what every tag starts from (a Python bytes object of 64 bytes). */
typedef struct {
    uint64_t h[8];
} Keyed;

/* tag = BLAKE2b-128(key, data[0:n]) for n >= 1, from the keyed state. */
static void tag(const Keyed *keyed, const uint8_t *data, size_t n, uint8_t out[TAG_BYTES]) {
    uint64_t h[8];
    uint64_t t = 128; /* the key block */
    uint8_t last[128];
    memcpy(h, keyed->h, sizeof h);
    while (n > 128) {
        t += 128;
        compress(h, data, t, 0);
        data += 128, n -= 128;
    }
    memset(last, 0, sizeof last);
    memcpy(last, data, n);
    t += n;
    compress(h, last, t, 1);
    store64(out, h[0]);
    store64(out + 8, h[1]);
}

static int get_keyed(PyObject *state, const Keyed **out) {
    if (!PyBytes_Check(state) || PyBytes_GET_SIZE(state) != (Py_ssize_t)sizeof(Keyed)) {
        PyErr_SetString(PyExc_TypeError, "state must be the bytes keyed() returned");
        return -1;
    }
    *out = (const Keyed *)PyBytes_AS_STRING(state);
    return 0;
}

static PyObject *py_keyed(PyObject *self, PyObject *args) {
    Py_buffer key;
    if (!PyArg_ParseTuple(args, "y*", &key)) return NULL;
    if (key.len != KEY_BYTES) {
        PyBuffer_Release(&key);
        return PyErr_Format(PyExc_ValueError, "the cluster key must be %d bytes", KEY_BYTES);
    }
    Keyed keyed;
    uint8_t block[128] = {0};
    memcpy(block, key.buf, KEY_BYTES);
    PyBuffer_Release(&key);
    for (int i = 0; i < 8; i++) keyed.h[i] = IV[i];
    keyed.h[0] ^= 0x01010000ULL ^ ((uint64_t)KEY_BYTES << 8) ^ TAG_BYTES;
    compress(keyed.h, block, 128, 0);
    return PyBytes_FromStringAndSize((const char *)&keyed, sizeof keyed);
}

static PyObject *py_tag(PyObject *self, PyObject *args) {
    PyObject *state;
    Py_buffer data;
    const Keyed *keyed;
    if (!PyArg_ParseTuple(args, "Oy*", &state, &data)) return NULL;
    if (get_keyed(state, &keyed) < 0 || data.len < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "nothing to tag");
        PyBuffer_Release(&data);
        return NULL;
    }
    uint8_t out[TAG_BYTES];
    tag(keyed, data.buf, (size_t)data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, TAG_BYTES);
}

/* ---- packing ---------------------------------------------------------------------------------------------- */
typedef struct {
    unsigned kind, dtype, sender;
    uint32_t session;
    uint64_t epoch;
} Fields;

static int get_uint(PyObject *obj, uint64_t max, const char *name, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an integer in 0..%llu", name, (unsigned long long)max);
        return -1;
    }
    if (v > max) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in 0..%llu", name, (unsigned long long)max);
        return -1;
    }
    *out = v;
    return 0;
}

static int get_fields(PyObject *kind, PyObject *dtype, PyObject *sender, PyObject *session, PyObject *epoch,
                      Fields *f) {
    uint64_t k, d, s, sess, e;
    if (get_uint(kind, 255, "kind", &k) < 0 || get_uint(dtype, 255, "dtype", &d) < 0 ||
        get_uint(sender, 255, "sender", &s) < 0 || get_uint(session, UINT32_MAX, "session", &sess) < 0 ||
        get_uint(epoch, UINT64_MAX, "epoch", &e) < 0)
        return -1;
    f->kind = (unsigned)k, f->dtype = (unsigned)d, f->sender = (unsigned)s, f->session = (uint32_t)sess,
    f->epoch = e;
    return 0;
}

/* One datagram: header (wire.py's layout, little-endian), payload, tag. */
static PyObject *pack_one(const Keyed *keyed, const Fields *f, uint64_t counter, unsigned index, unsigned count,
                          const uint8_t *payload, Py_ssize_t length) {
    if (length > MAX_PAYLOAD)
        return PyErr_Format(PyExc_ValueError, "payload of %zd bytes exceeds %d", length, MAX_PAYLOAD);
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEADER_BYTES + length + TAG_BYTES);
    if (out == NULL) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    p[0] = 'H', p[1] = 'L', p[2] = WIRE_VERSION, p[3] = (uint8_t)f->kind, p[4] = (uint8_t)f->dtype,
    p[5] = (uint8_t)f->sender;
    for (int i = 0; i < 4; i++) p[6 + i] = (uint8_t)(f->session >> (8 * i));
    store64(p + 10, f->epoch);
    store64(p + 18, counter);
    p[26] = (uint8_t)index, p[27] = (uint8_t)(index >> 8);
    p[28] = (uint8_t)count, p[29] = (uint8_t)(count >> 8);
    p[30] = (uint8_t)length, p[31] = (uint8_t)(length >> 8);
    memcpy(p + HEADER_BYTES, payload, (size_t)length);
    tag(keyed, p, HEADER_BYTES + (size_t)length, p + HEADER_BYTES + length);
    return out;
}

static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *state, *kind, *dtype, *sender, *session, *epoch, *counter, *index, *count;
    Py_buffer payload;
    const Keyed *keyed;
    Fields f;
    uint64_t c, i, n;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOy*", &state, &kind, &dtype, &sender, &session, &epoch, &counter, &index,
                          &count, &payload))
        return NULL;
    PyObject *out = NULL;
    if (get_keyed(state, &keyed) == 0 && get_fields(kind, dtype, sender, session, epoch, &f) == 0 &&
        get_uint(counter, UINT64_MAX, "counter", &c) == 0 && get_uint(index, 65535, "index", &i) == 0 &&
        get_uint(count, 65535, "count", &n) == 0)
        out = pack_one(keyed, &f, c, (unsigned)i, (unsigned)n, payload.buf, payload.len);
    PyBuffer_Release(&payload);
    return out;
}

/* pack_many(state, kind, dtype, sender, session, epoch, first_counter, count, payloads): a vector's data chunks,
 * chunk i with index i and counter first_counter + i. */
static PyObject *py_pack_many(PyObject *self, PyObject *args) {
    PyObject *state, *kind, *dtype, *sender, *session, *epoch, *counter, *count, *payloads;
    const Keyed *keyed;
    Fields f;
    uint64_t c, n;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &state, &kind, &dtype, &sender, &session, &epoch, &counter, &count,
                          &payloads))
        return NULL;
    if (get_keyed(state, &keyed) < 0 || get_fields(kind, dtype, sender, session, epoch, &f) < 0 ||
        get_uint(counter, UINT64_MAX, "counter", &c) < 0 || get_uint(count, 65535, "count", &n) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(payloads, "payloads must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m > (Py_ssize_t)n || (m > 0 && c > UINT64_MAX - (uint64_t)m)) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "%zd payloads for a vector of %llu chunks", m, (unsigned long long)n);
    }
    PyObject *out = PyList_New(m);
    for (Py_ssize_t k = 0; out != NULL && k < m; k++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &b, PyBUF_SIMPLE) < 0) {
            Py_CLEAR(out);
            break;
        }
        PyObject *d = pack_one(keyed, &f, c + (uint64_t)k, (unsigned)k, (unsigned)n, b.buf, b.len);
        PyBuffer_Release(&b);
        if (d == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, d);
    }
    Py_DECREF(seq);
    return out;
}

/* ---- parity (erasure.py's P and Q) ---------------------------------------------------------------------------- */
/* Every byte of a word times g = 2 in GF(2^8) with x^8 + x^4 + x^3 + x^2 + 1 (0x11d): shift, and fold the carries. */
static inline uint64_t times2(uint64_t v) {
    const uint64_t high = v & 0x8080808080808080ULL;
    return ((v & 0x7f7f7f7f7f7f7f7fULL) << 1) ^ ((high >> 7) * 0x1d);
}

/* parities(chunks, count) -> (P,) or (P, Q): P = XOR of the chunks, Q = sum of g^i chunk_i (Horner's rule from the
 * last chunk), each as long as the longest chunk, shorter ones zero-padded: erasure.parities' bytes. */
static PyObject *py_parities(PyObject *self, PyObject *args) {
    PyObject *chunks;
    int count;
    if (!PyArg_ParseTuple(args, "Oi", &chunks, &count)) return NULL;
    if (count != 1 && count != 2) return PyErr_Format(PyExc_ValueError, "1 or 2 parity chunks, not %d", count);
    PyObject *seq = PySequence_Fast(chunks, "chunks must be a sequence of bytes");
    if (seq == NULL) return NULL;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > 255) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "a parity group holds 1 to 255 chunks, not %zd", k);
    }
    Py_ssize_t width = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *c = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(c)) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_TypeError, "chunk %zd is not bytes", i);
        }
        if (PyBytes_GET_SIZE(c) > width) width = PyBytes_GET_SIZE(c);
    }
    const Py_ssize_t words = (width + 7) / 8;
    uint64_t *acc = PyMem_Calloc((size_t)(2 * words + 1), sizeof(uint64_t)), *word = acc + 2 * words;
    PyObject *out = NULL;
    if (acc == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    uint64_t *p = acc, *q = acc + words;
    for (Py_ssize_t i = k - 1; i >= 0; i--) { /* Horner: q = q g ^ chunk_i, from the last chunk to the first */
        PyObject *c = PySequence_Fast_GET_ITEM(seq, i);
        const uint8_t *bytes = (const uint8_t *)PyBytes_AS_STRING(c);
        const Py_ssize_t n = PyBytes_GET_SIZE(c);
        for (Py_ssize_t w = 0; w < words; w++) {
            const Py_ssize_t at = 8 * w, left = n - at;
            if (left >= 8) {
                memcpy(word, bytes + at, 8);
            } else {
                *word = 0;
                if (left > 0) memcpy(word, bytes + at, (size_t)left);
            }
            p[w] ^= *word;
            if (count == 2) q[w] = times2(q[w]) ^ *word;
        }
    }
    PyObject *pb = PyBytes_FromStringAndSize((const char *)p, width);
    PyObject *qb = pb != NULL && count == 2 ? PyBytes_FromStringAndSize((const char *)q, width) : NULL;
    if (pb != NULL && (count == 1 || qb != NULL)) out = count == 1 ? PyTuple_Pack(1, pb) : PyTuple_Pack(2, pb, qb);
    Py_XDECREF(pb);
    Py_XDECREF(qb);
    PyMem_Free(acc);
    Py_DECREF(seq);
    return out;
}

/* ---- sending ---------------------------------------------------------------------------------------------- */
static int parse_address(PyObject *address, struct sockaddr_in *out) {
    if (!PyTuple_Check(address) || PyTuple_GET_SIZE(address) != 2) return 0;
    const char *host = PyUnicode_Check(PyTuple_GET_ITEM(address, 0)) ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(address, 0))
                                                                     : NULL;
    long port = PyLong_Check(PyTuple_GET_ITEM(address, 1)) ? PyLong_AsLong(PyTuple_GET_ITEM(address, 1)) : -1;
    if (host == NULL || port < 0 || port > 65535) {
        PyErr_Clear();
        return 0;
    }
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, host, &out->sin_addr) == 1;
}

/* UDP segmentation offload (UDP_SEGMENT, Linux 4.18+): a run of equal-sized datagrams to one address goes to the
 * kernel as one message and is cut into those datagrams below the socket, so the socket, UDP and IP work is paid
 * once a run instead of once a datagram. Each datagram still leaves as its own packet (the last of a run may be
 * shorter), so a receiver sees exactly what it saw before. On the namespace bed a sender's system time fell from
 * ~7 to ~4.5 us a datagram (eval/results/datagram_cost.md). A kernel or device that refuses it is asked once. */
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define MAX_SEGMENTS 64       /* the kernel's UDP_MAX_SEGMENTS (raised to 128 in 6.x) */
#define MAX_SEGMENTED 60000   /* bytes in one segmented message: under the 64 KB an IP packet's length field allows */
static int segmentation_refused = 0; /* UDP_SEGMENT failed once in this process: one datagram a message from then on */

typedef struct {
    Py_ssize_t address, first, count; /* datagrams first .. first + count - 1 to addresses[address] */
    size_t size;                      /* each one's bytes (the last may be shorter): the segment size */
} Run;

/* The messages sendmany sends: per address, runs of datagrams of one size (a shorter one ends a run), or one datagram
 * a message where segment is 0. Returns the number of runs written to runs (room for nd * na). */
static Py_ssize_t plan_runs(PyObject *ds, Py_ssize_t nd, Py_ssize_t na, int segment, Run *runs) {
    Py_ssize_t n = 0;
    for (Py_ssize_t a = 0; a < na; a++)
        for (Py_ssize_t k = 0; k < nd;) {
            size_t size = (size_t)PyBytes_GET_SIZE(PySequence_Fast_GET_ITEM(ds, k));
            Py_ssize_t count = 1;
            while (segment && k + count < nd && count < MAX_SEGMENTS && (size_t)(count + 1) * size <= MAX_SEGMENTED &&
                   (size_t)PyBytes_GET_SIZE(PySequence_Fast_GET_ITEM(ds, k + count - 1)) == size &&
                   (size_t)PyBytes_GET_SIZE(PySequence_Fast_GET_ITEM(ds, k + count)) <= size)
                count++;
            runs[n++] = (Run){a, k, count, size};
            k += count;
        }
    return n;
}

/* Why a segmented message can fail where its datagrams one by one would not: no UDP GSO in this kernel, no checksum
 * offload on the device (EIO), or a path MTU below the segment size (EMSGSIZE: one by one, they are fragmented). */
static int refused_segmentation(int error) {
    return error == EIO || error == EINVAL || error == ENOPROTOOPT || error == EOPNOTSUPP || error == EMSGSIZE;
}

/* sendmany(fd, datagrams, addresses, segment=True) -> bool: every datagram to every (numeric IPv4 host, port)
 * address, by sendmmsg, a run of equal-sized ones to an address as one segmented message where segment is true and
 * the kernel takes it. A datagram the kernel refuses (a full buffer, a local drop) is a lost packet, as in the Python path's
 * _sendto. False, with nothing sent, where an address is not a numeric IPv4 one: the caller sends those itself. */
static PyObject *py_sendmany(PyObject *self, PyObject *args) {
    int fd, segment = 1;
    PyObject *datagrams, *addresses;
    if (!PyArg_ParseTuple(args, "iOO|p", &fd, &datagrams, &addresses, &segment)) return NULL;
    PyObject *ds = PySequence_Fast(datagrams, "datagrams must be a sequence of bytes");
    if (ds == NULL) return NULL;
    PyObject *as = PySequence_Fast(addresses, "addresses must be a sequence of (host, port)");
    if (as == NULL) {
        Py_DECREF(ds);
        return NULL;
    }
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(ds), na = PySequence_Fast_GET_SIZE(as), total = nd * na;
    PyObject *result = NULL;
    struct sockaddr_in *to = PyMem_Calloc((size_t)(na ? na : 1), sizeof *to);
    Run *runs = PyMem_Calloc((size_t)(total ? total : 1), sizeof *runs);
    struct iovec *iov = PyMem_Calloc((size_t)(total ? total : 1), sizeof *iov);
    struct mmsghdr msgs[SEND_BATCH];
    union {
        char bytes[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } control[SEND_BATCH];
    if (to == NULL || runs == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t a = 0; a < na; a++)
        if (!parse_address(PySequence_Fast_GET_ITEM(as, a), &to[a])) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    for (Py_ssize_t k = 0; k < nd; k++)
        if (!PyBytes_Check(PySequence_Fast_GET_ITEM(ds, k))) {
            PyErr_SetString(PyExc_TypeError, "datagrams must be bytes");
            goto done;
        }
    for (Py_ssize_t j = 0; j < total; j++) {
        PyObject *d = PySequence_Fast_GET_ITEM(ds, j % nd);
        iov[j].iov_base = PyBytes_AS_STRING(d);
        iov[j].iov_len = (size_t)PyBytes_GET_SIZE(d);
    }
    Py_ssize_t n_runs = plan_runs(ds, nd, na, segment && !segmentation_refused, runs), next = 0;
    while (next < n_runs) {
        int batch = 0;
        for (Py_ssize_t r = next; r < n_runs && batch < SEND_BATCH; r++, batch++) {
            const Run *run = &runs[r];
            struct msghdr *h = &msgs[batch].msg_hdr;
            memset(&msgs[batch], 0, sizeof msgs[batch]);
            h->msg_iov = &iov[run->address * nd + run->first];
            h->msg_iovlen = (size_t)run->count;
            h->msg_name = &to[run->address];
            h->msg_namelen = sizeof to[0];
            if (run->count > 1) {
                h->msg_control = control[batch].bytes;
                h->msg_controllen = sizeof control[batch].bytes;
                struct cmsghdr *c = CMSG_FIRSTHDR(h);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t size = (uint16_t)run->size;
                memcpy(CMSG_DATA(c), &size, sizeof size);
            }
        }
        int sent = sendmmsg(fd, msgs, (unsigned)batch, MSG_DONTWAIT);
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0 && runs[next].count > 1 && refused_segmentation(errno)) {
            /* this kernel or device does not segment: the rest one datagram a message, now and from now on */
            segmentation_refused = 1;
            Py_ssize_t address = runs[next].address, first = runs[next].first;
            n_runs = plan_runs(ds, nd, na, 0, runs);
            next = address * nd + first; /* unsegmented, run i is datagram i % nd to address i / nd */
            continue;
        }
        next += sent > 0 ? sent : 1; /* the one refused is lost; go on with the next */
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(to);
    PyMem_Free(runs);
    PyMem_Free(iov);
    Py_DECREF(ds);
    Py_DECREF(as);
    return result;
}

/* segmenting() -> bool: whether sendmany still segments (False once the kernel refused UDP_SEGMENT) */
static PyObject *py_segmenting(PyObject *self, PyObject *args) {
    return PyBool_FromLong(!segmentation_refused);
}

/* ---- receiving -------------------------------------------------------------------------------------------- */
/* Codec.unpack's checks, in its order: NULL when valid, else the reason the endpoint counts. */
static const char *check(const Keyed *keyed, const uint8_t *p, size_t size, long long session) {
    if (size > MAX_DATAGRAM) return "oversized";
    if (size < HEADER_BYTES + TAG_BYTES) return "truncated";
    if (p[0] != 'H' || p[1] != 'L') return "bad_magic";
    if (p[2] != WIRE_VERSION) return "bad_version";
    size_t end = HEADER_BYTES + ((size_t)p[30] | (size_t)p[31] << 8);
    if (end + TAG_BYTES != size) return "bad_length";
    uint8_t expected[TAG_BYTES], diff = 0;
    tag(keyed, p, end, expected);
    for (int i = 0; i < TAG_BYTES; i++) diff |= (uint8_t)(expected[i] ^ p[end + i]);
    if (diff) return "bad_tag";
    uint32_t sess = (uint32_t)p[6] | (uint32_t)p[7] << 8 | (uint32_t)p[8] << 16 | (uint32_t)p[9] << 24;
    if (session >= 0 && sess != (uint32_t)session) return "other_session";
    unsigned index = (unsigned)p[26] | (unsigned)p[27] << 8, count = (unsigned)p[28] | (unsigned)p[29] << 8;
    if (p[3] > MAX_KIND || p[4] > MAX_DTYPE || count == 0 || index >= count) return "malformed";
    return NULL;
}

/* The header as a wire.Header (a tuple subclass of 9 fields: built as tuple.__new__ builds one). */
static PyObject *header_of(PyTypeObject *type, const uint8_t *p) {
    PyObject *h = type->tp_alloc(type, 9);
    if (h == NULL) return NULL;
    uint32_t sess = (uint32_t)p[6] | (uint32_t)p[7] << 8 | (uint32_t)p[8] << 16 | (uint32_t)p[9] << 24;
    PyObject *items[9] = {PyLong_FromLong(p[3]),
                          PyLong_FromLong(p[4]),
                          PyLong_FromLong(p[5]),
                          PyLong_FromUnsignedLong(sess),
                          PyLong_FromUnsignedLongLong(load64(p + 10)),
                          PyLong_FromUnsignedLongLong(load64(p + 18)),
                          PyLong_FromLong(p[26] | p[27] << 8),
                          PyLong_FromLong(p[28] | p[29] << 8),
                          PyLong_FromLong(p[30] | p[31] << 8)};
    for (int i = 0; i < 9; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 9; j++) Py_XDECREF(items[j]);
            Py_DECREF(h);
            return NULL;
        }
    }
    for (int i = 0; i < 9; i++) PyTuple_SET_ITEM(h, i, items[i]);
    return h;
}

/* unpack(state, datagram, session, header_type) -> reason | (header, payload): one datagram through the checks
 * receive() applies (for differential tests and fuzzing against wire.Codec.unpack without a socket). */
static PyObject *py_unpack(PyObject *self, PyObject *args) {
    PyObject *state;
    Py_buffer data;
    long long session;
    PyTypeObject *header_type;
    const Keyed *keyed;
    if (!PyArg_ParseTuple(args, "Oy*LO!", &state, &data, &session, &PyType_Type, &header_type)) return NULL;
    PyObject *out = NULL;
    if (get_keyed(state, &keyed) == 0 && PyType_IsSubtype(header_type, &PyTuple_Type)) {
        const uint8_t *p = data.buf;
        const char *reason = check(keyed, p, (size_t)data.len, session);
        if (reason != NULL) {
            out = PyUnicode_InternFromString(reason);
        } else {
            PyObject *header = header_of(header_type, p);
            PyObject *payload = header ? PyBytes_FromStringAndSize((const char *)p + HEADER_BYTES,
                                                                   (Py_ssize_t)(p[30] | p[31] << 8))
                                       : NULL;
            out = payload ? PyTuple_Pack(2, header, payload) : NULL;
            Py_XDECREF(header);
            Py_XDECREF(payload);
        }
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "header_type must be a tuple subclass (wire.Header)");
    }
    PyBuffer_Release(&data);
    return out;
}

static PyObject *address_of(const struct sockaddr_in *a) {
    char host[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof host) == NULL) host[0] = '\0';
    return Py_BuildValue("(si)", host, (int)ntohs(a->sin_port));
}

/* How long a wait for a datagram spins (polls without sleeping) before it sleeps, in seconds (0: never spins).
 * Waking a sleeping core costs tens of microseconds a hop on a VM (an idle vCPU halts: measured 41-52 us a loopback
 * round trip blocking, 5 us spinning); a node with a core of its own loses nothing by spinning, but nodes that share
 * cores would take them from each other, so it is off unless the process asks (udp.set_busy_poll). */
static double busy_poll_s = 0.0;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Waits up to timeout_s for fd to be readable, spinning the first spin_s of it: 1 readable, 0 not (timeout), -1 a
 * signal or error. Called without the GIL. */
static int wait_readable(int fd, double timeout_s, double spin_s) {
    if (timeout_s != timeout_s || timeout_s < 0) timeout_s = 0; /* NaN: no wait */
    if (timeout_s > 3600) timeout_s = 3600;                       /* (an infinite wait would not fit a timespec) */
    struct pollfd pfd = {fd, POLLIN, 0};
    if (spin_s > 0) {
        const double start = seconds_now(), spin_until = start + (spin_s < timeout_s ? spin_s : timeout_s);
        for (;;) {
            const int ready = poll(&pfd, 1, 0);
            if (ready != 0) return ready < 0 ? -1 : 1;
            const double now = seconds_now();
            if (now >= spin_until) break;
        }
        timeout_s -= seconds_now() - start;
        if (timeout_s <= 0) return 0;
    }
    struct timespec ts = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e9)};
    const int ready = ppoll(&pfd, 1, &ts, NULL);
    return ready < 0 ? -1 : ready;
}

/* set_busy_poll(seconds): how long every later wait for a datagram spins before it sleeps (0: never). */
static PyObject *py_set_busy_poll(PyObject *self, PyObject *args) {
    double seconds;
    if (!PyArg_ParseTuple(args, "d", &seconds)) return NULL;
    if (!(seconds >= 0 && seconds <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "busy poll: 0 to 1 second");
        return NULL;
    }
    busy_poll_s = seconds;
    Py_RETURN_NONE;
}

/* readable(fd, timeout_s) -> bool: whether fd became readable within timeout_s (GIL released; spins as set). */
static PyObject *py_readable(PyObject *self, PyObject *args) {
    int fd;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "id", &fd, &timeout_s)) return NULL;
    int ready;
    Py_BEGIN_ALLOW_THREADS
    ready = wait_readable(fd, timeout_s, busy_poll_s);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready > 0);
}

/* receive(fd, state, session, timeout_s, header_type) -> list: waits up to timeout_s (GIL released) for the
 * socket to be readable, then reads what is queued, RECV_BATCH datagrams at most (fewer: the queue is empty). Each item is a reason (str: the
 * datagram failed Codec.unpack's checks) or (header, payload bytes, (host, port), its size in bytes). [] when nothing
 * came. session < 0: any session. */
static PyObject *py_receive(PyObject *self, PyObject *args) {
    int fd;
    PyObject *state;
    long long session;
    double timeout_s;
    PyTypeObject *header_type;
    const Keyed *keyed;
    if (!PyArg_ParseTuple(args, "iOLdO!", &fd, &state, &session, &timeout_s, &PyType_Type, &header_type))
        return NULL;
    if (get_keyed(state, &keyed) < 0) return NULL;
    if (!PyType_IsSubtype(header_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "header_type must be a tuple subclass (wire.Header)");
        return NULL;
    }
    if (timeout_s > 0) {
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = wait_readable(fd, timeout_s, busy_poll_s);
        Py_END_ALLOW_THREADS
        if (ready <= 0) return PyList_New(0); /* timeout, or a signal: nothing yet */
    }
    /* One buffer for every call: the GIL is held from recvmmsg() until the results are built, so no other thread
     * of the interpreter is in here meanwhile (ppoll, above, touches no buffer). */
    static uint8_t buffers[RECV_BATCH * (MAX_DATAGRAM + 1)];
    struct mmsghdr msgs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    struct sockaddr_in from[RECV_BATCH];
    for (int i = 0; i < RECV_BATCH; i++) {
        iov[i].iov_base = buffers + (size_t)i * (MAX_DATAGRAM + 1);
        iov[i].iov_len = MAX_DATAGRAM + 1; /* one byte more than allowed: a longer datagram shows as oversized */
        memset(&msgs[i], 0, sizeof msgs[i]);
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &from[i];
        msgs[i].msg_hdr.msg_namelen = sizeof from[i];
    }
    int n;
    do n = recvmmsg(fd, msgs, RECV_BATCH, MSG_DONTWAIT, NULL);
    while (n < 0 && errno == EINTR);
    PyObject *out = PyList_New(0), *address = NULL;
    struct sockaddr_in last;
    for (int i = 0; out != NULL && i < n; i++) {
        const uint8_t *p = iov[i].iov_base;
        size_t size = msgs[i].msg_len;
        const char *reason = check(keyed, p, size, session);
        PyObject *item;
        if (reason != NULL) {
            item = PyUnicode_InternFromString(reason);
        } else {
            if (address == NULL || memcmp(&last, &from[i], sizeof last) != 0) { /* one tuple per sender */
                Py_XDECREF(address);
                address = address_of(&from[i]);
                memcpy(&last, &from[i], sizeof last);
            }
            size_t length = (size_t)p[30] | (size_t)p[31] << 8;
            PyObject *header = address ? header_of(header_type, p) : NULL;
            PyObject *payload = header ? PyBytes_FromStringAndSize((const char *)p + HEADER_BYTES, (Py_ssize_t)length)
                                       : NULL;
            PyObject *bytes = payload ? PyLong_FromSize_t(size) : NULL;
            item = bytes ? PyTuple_New(4) : NULL;
            if (item == NULL) {
                Py_XDECREF(header);
                Py_XDECREF(payload);
                Py_XDECREF(bytes);
            } else {
                PyTuple_SET_ITEM(item, 0, header);
                PyTuple_SET_ITEM(item, 1, payload);
                PyTuple_SET_ITEM(item, 2, Py_NewRef(address));
                PyTuple_SET_ITEM(item, 3, bytes);
            }
        }
        if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    Py_XDECREF(address);
    return out;
}

static PyMethodDef methods[] = {
    {"keyed", py_keyed, METH_VARARGS, "keyed(key) -> state: BLAKE2b's state after the 32-byte cluster key's block"},
    {"tag", py_tag, METH_VARARGS, "tag(state, data) -> the 16-byte keyed BLAKE2b tag of data"},
    {"pack", py_pack, METH_VARARGS,
     "pack(state, kind, dtype, sender, session, epoch, counter, index, count, payload) -> one datagram"},
    {"pack_many", py_pack_many, METH_VARARGS,
     "pack_many(state, kind, dtype, sender, session, epoch, first_counter, count, payloads) -> datagrams (chunk i: "
     "index i, counter first_counter + i)"},
    {"parities", py_parities, METH_VARARGS,
     "parities(chunks, count) -> (P,) or (P, Q): erasure.parities' bytes (shorter chunks zero-padded)"},
    {"sendmany", py_sendmany, METH_VARARGS,
     "sendmany(fd, datagrams, addresses, segment=True) -> bool: every datagram to every address (sendmmsg; runs of "
     "equal-sized ones to an address as one UDP_SEGMENT message where segment is true); False: an address is not "
     "numeric IPv4, nothing sent"},
    {"segmenting", py_segmenting, METH_NOARGS, "segmenting() -> bool: False once the kernel refused UDP_SEGMENT"},
    {"unpack", py_unpack, METH_VARARGS,
     "unpack(state, datagram, session, header_type) -> reason | (header, payload): receive()'s checks on one datagram"},
    {"receive", py_receive, METH_VARARGS,
     "receive(fd, state, session, timeout_s, header_type) -> [reason | (header, payload, address, size)]"},
    {"set_busy_poll", py_set_busy_poll, METH_VARARGS,
     "set_busy_poll(seconds): how long every later wait for a datagram spins before it sleeps (0: never)"},
    {"readable", py_readable, METH_VARARGS,
     "readable(fd, timeout_s) -> bool: whether fd became readable within timeout_s (spinning as set_busy_poll says)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_datagrams", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__datagrams(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) < 0) Py_CLEAR(m);
    return m;
}
