/* halo.eval.bench_round_floor's compiled floor: the minimal TP decode's round loop in C (`_round_floor`).
 *
 * What a round costs when nothing of it is interpreted: the agent serves every round of a decode in one call
 * (receive the residual stream, its MLP share, send the partial back), the master runs a round in one call (send the
 * stream to every agent, its own share, add the agents' partials in order). Raw float32 datagrams on connected
 * loopback sockets, as the bench's Python minimal loop sends them: no authentication, framing, parity or recovery.
 * A measuring instrument, never a transport: it trusts whatever reaches the sockets it is handed.
 *
 * Built by the bench at run time (a C compiler and this file beside the kernel's source, halo/_nbits.c, which it
 * includes: the same kernels as halo's). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define methods nbits_methods /* the kernel's module table and definition, renamed: this module has its own */
#define module nbits_module
#include "_nbits.c"
#undef methods
#undef module

#include <errno.h>
#include <limits.h>
#include <sys/socket.h>

#define FLOATS_PER_DATAGRAM 350 /* bench_round_floor.FLOATS_PER_DATAGRAM */
#define HEADER 6                /* round number (4 bytes) and chunk index (2) */
#define STOP_ROUND 0xFFFFFFFFu

static int send_vector(int fd, uint32_t round, const float *v, Py_ssize_t d)
{
    char datagram[HEADER + 4 * FLOATS_PER_DATAGRAM];
    uint16_t index = 0;
    for (Py_ssize_t start = 0; start < d; start += FLOATS_PER_DATAGRAM, index++) {
        const Py_ssize_t n = d - start < FLOATS_PER_DATAGRAM ? d - start : FLOATS_PER_DATAGRAM;
        memcpy(datagram, &round, 4), memcpy(datagram + 4, &index, 2), memcpy(datagram + HEADER, v + start, 4 * n);
        if (send(fd, datagram, (size_t)(HEADER + 4 * n), 0) < 0)
            return -1;
    }
    return 0;
}

/* v [d] of round `round` from the connected peer (each chunk once): 0; 1: the peer said stop; -1: an error or the
 * socket's timeout. */
static int receive_vector(int fd, uint32_t round, float *v, Py_ssize_t d)
{
    const Py_ssize_t chunks = (d + FLOATS_PER_DATAGRAM - 1) / FLOATS_PER_DATAGRAM;
    Py_ssize_t waiting = chunks;
    char datagram[HEADER + 4 * FLOATS_PER_DATAGRAM];
    uint8_t got[(65536 + 7) / 8] = {0}; /* a chunk index is 16 bits */
    while (waiting) {
        const ssize_t size = recv(fd, datagram, sizeof datagram, 0);
        if (size < 0 && errno == EINTR)
            continue;
        if (size < 0)
            return -1;
        uint32_t got_round;
        uint16_t index;
        if (size < HEADER)
            continue;
        memcpy(&got_round, datagram, 4), memcpy(&index, datagram + 4, 2);
        if (got_round == STOP_ROUND)
            return 1;
        const Py_ssize_t start = (Py_ssize_t)index * FLOATS_PER_DATAGRAM, n = (size - HEADER) / 4;
        const Py_ssize_t whole = index < chunks - 1 ? FLOATS_PER_DATAGRAM : d - start;
        if (got_round != round || index >= chunks || n != whole || got[index / 8] & (1 << index % 8))
            continue;
        got[index / 8] |= (uint8_t)(1 << index % 8);
        memcpy(v + start, datagram + HEADER, (size_t)(4 * n));
        waiting--;
    }
    return 0;
}

/* y [d] = the share's MLP of x [d] (RMS-normed by norm), one thread: as the kernel's mlp_step. 0, or -1 (memory). */
static int mlp_share(Weight *w, Py_ssize_t groups, Py_ssize_t widest, const float *x, const float *norm, float eps,
                     Py_ssize_t d, float *y, float *scratch, int path)
{
    float *h = scratch, *gate_up = h + d, *act = gate_up + 2 * widest, *part = act + widest;
    Codes h_codes = {0};
    int failed = 0;
    rms_norm(x, norm, d, eps, h);
    for (Py_ssize_t i = 0; i < d; i++)
        y[i] = 0.f;
    for (Py_ssize_t g = 0; g < groups && !failed; g++) {
        failed = project(&w[2 * g], h, 1, gate_up, 1, path, &h_codes) < 0;
        swiglu(gate_up, w[2 * g].job.n / 2, act);
        failed = failed || project(&w[2 * g + 1], act, 1, part, 1, path, NULL) < 0;
        for (Py_ssize_t i = 0; i < d && !failed; i++)
            y[i] += part[i];
    }
    codes_free(&h_codes);
    return failed ? -1 : 0;
}

/* The weights of every layer's share: layers[l] a list of (gate_up, down) pairs. */
typedef struct {
    Py_ssize_t layers, widest;
    Weight **weights;
    Py_ssize_t *groups;
    Py_buffer *norms;
    int opened; /* layers opened (weights and norm) */
} Shares;

static void shares_close(Shares *s)
{
    for (int l = 0; l < s->opened; l++) {
        for (Py_ssize_t g = 0; g < 2 * s->groups[l]; g++)
            weight_close(&s->weights[l][g]);
        PyMem_Free(s->weights[l]);
        PyBuffer_Release(&s->norms[l]);
    }
    PyMem_Free(s->weights), PyMem_Free(s->groups), PyMem_Free(s->norms);
}

static int shares_open(Shares *s, PyObject *layers, PyObject *norms, Py_ssize_t d)
{
    memset(s, 0, sizeof *s);
    if (!PyList_Check(layers) || !PyList_Check(norms) || PyList_GET_SIZE(layers) != PyList_GET_SIZE(norms)
        || PyList_GET_SIZE(layers) < 1) {
        PyErr_SetString(PyExc_ValueError, "layers and norms: lists of one entry a layer");
        return -1;
    }
    s->layers = PyList_GET_SIZE(layers);
    s->weights = PyMem_Calloc((size_t)s->layers, sizeof *s->weights);
    s->groups = PyMem_Calloc((size_t)s->layers, sizeof *s->groups);
    s->norms = PyMem_Calloc((size_t)s->layers, sizeof *s->norms);
    if (!s->weights || !s->groups || !s->norms) {
        shares_close(s);
        PyErr_NoMemory();
        return -1;
    }
    for (; s->opened < s->layers; s->opened++) {
        const int l = s->opened;
        Py_ssize_t widest;
        if (mlp_groups_open(PyList_GET_ITEM(layers, l), d, d, &s->weights[l], &s->groups[l], &widest) < 0)
            break;
        if (floats(PyList_GET_ITEM(norms, l), &s->norms[l], "norm", d, 0) < 0) {
            for (Py_ssize_t g = 0; g < 2 * s->groups[l]; g++)
                weight_close(&s->weights[l][g]);
            PyMem_Free(s->weights[l]);
            break;
        }
        s->widest = widest > s->widest ? widest : s->widest;
    }
    if (s->opened < s->layers) {
        shares_close(s);
        return -1;
    }
    return 0;
}

/* serve(fd, layers, norms, eps, d) -> 0 (told to stop), -1 (a socket error or its timeout) or -2 (out of memory):
 * the agent's whole life: round r (from 1) is layer (r - 1) mod len(layers); without the GIL. */
static PyObject *py_serve(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *layers, *norms;
    float eps;
    Py_ssize_t d;
    if (!PyArg_ParseTuple(args, "iO!O!fn", &fd, &PyList_Type, &layers, &PyList_Type, &norms, &eps, &d))
        return NULL;
    Shares s;
    if (d < 1 || shares_open(&s, layers, norms, d) < 0)
        return d < 1 ? PyErr_Format(PyExc_ValueError, "d must be positive") : NULL;
    int result = 0;
    Py_BEGIN_ALLOW_THREADS
    const int path = best_path();
    float *scratch = malloc((size_t)(2 * d + 3 * s.widest) * sizeof(float));
    float *x = malloc((size_t)d * sizeof(float)), *y = malloc((size_t)d * sizeof(float));
    result = scratch && x && y ? 0 : -2;
    for (uint32_t round = 1; result == 0; round++) {
        const Py_ssize_t l = (Py_ssize_t)((round - 1) % (uint32_t)s.layers);
        const int got = receive_vector(fd, round, x, d);
        if (got)
            result = got == 1 ? 1 : -1;
        else if (mlp_share(s.weights[l], s.groups[l], s.widest, x, s.norms[l].buf, eps, d, y, scratch, path) < 0)
            result = -2;
        else if (send_vector(fd, round, y, d) < 0)
            result = -1;
    }
    free(scratch), free(x), free(y);
    Py_END_ALLOW_THREADS
    shares_close(&s);
    return PyLong_FromLong(result == 1 ? 0 : result);
}

/* round(fds, round, x, norm, eps, groups, y): one MLP round on the master: x [d] to every agent, its own share
 * (groups: (gate_up, down) pairs) into y [d], then each agent's partial added in the order of fds. */
static PyObject *py_round(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fds_obj, *x_obj, *norm_obj, *groups_obj, *y_obj;
    unsigned int round;
    float eps;
    if (!PyArg_ParseTuple(args, "O!IOOfOO", &PyTuple_Type, &fds_obj, &round, &x_obj, &norm_obj, &eps, &groups_obj,
                          &y_obj))
        return NULL;
    const Py_ssize_t agents = PyTuple_GET_SIZE(fds_obj);
    int fds[64];
    if (agents > 64)
        return PyErr_Format(PyExc_ValueError, "64 agents at most");
    for (Py_ssize_t i = 0; i < agents; i++) {
        const long fd = PyLong_AsLong(PyTuple_GET_ITEM(fds_obj, i));
        if (fd == -1 && PyErr_Occurred())
            return NULL;
        if (fd < 0 || fd > INT_MAX)
            return PyErr_Format(PyExc_ValueError, "fds: file descriptors (0 to %d), not %ld", INT_MAX, fd);
        fds[i] = (int)fd;
    }
    Py_buffer views[3];
    int held = 0;
    if (floats(x_obj, &views[held], "x", -1, 0) < 0 || (++held, floats(y_obj, &views[held], "y", views[0].len / 4, 1) < 0)
        || (++held, floats(norm_obj, &views[held], "norm", views[0].len / 4, 0) < 0)) {
        for (int i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
        return NULL;
    }
    const Py_ssize_t d = views[0].len / 4;
    Weight *w;
    Py_ssize_t groups, widest;
    int failed = mlp_groups_open(groups_obj, d, d, &w, &groups, &widest) < 0 ? -2 : 0;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        float *scratch = malloc((size_t)(2 * d + 3 * widest) * sizeof(float)), *part = malloc((size_t)d * sizeof(float));
        float *y = views[1].buf;
        failed = scratch && part ? 0 : -3;
        for (Py_ssize_t i = 0; i < agents && !failed; i++)
            failed = send_vector(fds[i], round, views[0].buf, d);
        if (!failed && mlp_share(w, groups, widest, views[0].buf, views[2].buf, eps, d, y, scratch, best_path()) < 0)
            failed = -3;
        for (Py_ssize_t i = 0; i < agents && !failed; i++) {
            failed = receive_vector(fds[i], round, part, d) ? -1 : 0;
            for (Py_ssize_t j = 0; j < d && !failed; j++)
                y[j] = y[j] + part[j];
        }
        free(scratch), free(part);
        Py_END_ALLOW_THREADS
        for (Py_ssize_t g = 0; g < 2 * groups; g++)
            weight_close(&w[g]);
        PyMem_Free(w);
    }
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&views[i]);
    if (failed == -1)
        PyErr_SetString(PyExc_OSError, "a round's datagrams did not go out or come back (an agent failed or timed out)");
    else if (failed == -3)
        PyErr_NoMemory();
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef floor_methods[] = {
    {"serve", py_serve, METH_VARARGS, "serve(fd, layers, norms, eps, d) -> 0 (stopped) or -1: an agent's rounds"},
    {"round", py_round, METH_VARARGS, "round(fds, round, x, norm, eps, groups, y): one MLP round on the master"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef floor_module = {PyModuleDef_HEAD_INIT, "_round_floor", NULL, -1, floor_methods,
                                          NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__round_floor(void) { return PyModule_Create(&floor_module); }
