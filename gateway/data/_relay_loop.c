/* The relay's per-event loop in native code: streams whose head has passed, relayed off the event loop.
 *
 * One thread per Engine waits on the engines' sockets (epoll). For each read it parses the HTTP chunked framing,
 * cuts the body at the last event boundary, looks for what the Python relay must see (a usage object, an error, a
 * new Responses id: the needles it was given), and writes the events to the client's socket, chunk-framed, in
 * one system call. Everything else goes back to the event loop as a report (an eventfd it watches):
 *
 *   INSPECT   events holding a needle: the stream is parked until Python has relayed them and calls resume();
 *   BLOCKED   the client's socket took only part of a write: the rest goes back, parked until resume();
 *   GONE      the client's socket failed (reset, closed): parked;
 *   END       the engine's body ended (its last chunk): the stream is finished here;
 *   LOST      the engine's socket closed or failed before the end: finished here;
 *   MALFORMED the chunk framing was broken: finished here.
 *
 * The thread never touches a Python object (it runs without the GIL); the event loop's calls and the thread
 * share the stream table and the reports under one mutex, which the thread holds for one stream's read at a time. File descriptors handed in are duplicates the engine
 * owns and closes: the event loop's transports keep their own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "llhttp/llhttp.h"

#define READ_SIZE (256 * 1024)
#define MAX_PENDING (4 * 1024 * 1024) /* a partial event larger than this goes out unsplit, unscanned */
#define MAX_KINDS 4
#define MAX_NEEDLES 12
#define STOP_ID UINT64_MAX

enum { R_INSPECT = 1, R_BLOCKED, R_GONE, R_END, R_LOST, R_MALFORMED };
enum { ST_FREE, ST_ACTIVE, ST_PARKED };

typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

static int buf_reserve(buf_t *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 512;
    while (cap < b->len + extra) cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_append(buf_t *b, const char *s, size_t n) {
    if (n == 0) return 0;
    if (buf_reserve(b, n)) return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

static void buf_free(buf_t *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* ------------------------------------------------------------------ HTTP/1.1 chunked framing
 *
 * Parsed by llhttp (vendored in llhttp/, the version httptools 0.9.0 ships): the parser the Python relay reads the
 * same bytes with (gateway.data.stream_pool), so that both relays take and refuse exactly the same framing. A
 * stream's parser starts after a fixed chunked response head; only the body's bytes are fed to it. */

typedef struct {
    llhttp_t parser; /* first: the callbacks get the parser and cast it back */
    buf_t *out;      /* where the data goes during a feed (NULL: dropped) */
    int ended;       /* the body's last chunk and trailers were read */
    int broken;      /* llhttp refused the framing (or out could not grow) */
} chunks_t;

static llhttp_settings_t chunk_settings;
static const char CHUNKED_HEAD[] = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";

static int on_chunk_data(llhttp_t *p, const char *at, size_t len) {
    chunks_t *c = (chunks_t *)p;
    return c->out != NULL && buf_append(c->out, at, len) ? -1 : 0; /* (-1: HPE_USER, the feed fails) */
}

static int on_body_end(llhttp_t *p) {
    ((chunks_t *)p)->ended = 1;
    return HPE_PAUSED; /* stop here: what follows is not this body's (a response of its own, to llhttp) */
}

static void chunks_setup(void) {
    llhttp_settings_init(&chunk_settings);
    chunk_settings.on_body = on_chunk_data;
    chunk_settings.on_message_complete = on_body_end;
}

static void chunks_init(chunks_t *c) {
    memset(c, 0, sizeof(*c));
    llhttp_init(&c->parser, HTTP_RESPONSE, &chunk_settings);
    if (llhttp_execute(&c->parser, CHUNKED_HEAD, sizeof(CHUNKED_HEAD) - 1) != HPE_OK) c->broken = 1;
}

/* Feeds n bytes of a chunked body; the data goes to out (NULL: dropped). Returns the bytes consumed (fewer than n
 * only when the body ended: c->ended), or -1 when the framing is broken (or out cannot grow); the data before the
 * broken bytes is in out all the same (as llhttp hands it to the Python relay). */
static ssize_t chunks_feed(chunks_t *c, const char *in, size_t n, buf_t *out) {
    if (c->broken) return -1;
    if (c->ended) return 0;
    c->out = out;
    llhttp_errno_t err = llhttp_execute(&c->parser, in, n);
    c->out = NULL;
    if (err == HPE_OK) return (ssize_t)n;
    if (err == HPE_PAUSED && c->ended) return (ssize_t)(llhttp_get_error_pos(&c->parser) - in);
    c->broken = 1;
    return -1;
}

/* ------------------------------------------------------------------ streams and reports */

typedef struct {
    uint32_t gen;
    int state;
    int up, cl;
    int kind;
    int chunked_out;
    int ended;      /* the body's last chunk was read (reported once nothing is parked) */
    int extra;      /* bytes followed the body's end: the connection cannot be reused */
    int broken;     /* the chunk framing broke (MALFORMED reported once the events before it went out) */
    chunks_t chunks;
    buf_t pending;  /* body bytes after the last event boundary */
    buf_t last[2];  /* the last two blocks of events before [DONE] (where a stream's finish and ending are) */
    buf_t done;     /* the block that ended with [DONE] */
    uint64_t events;
    double last_read;
} stream_t;

typedef struct {
    uint64_t id;
    int kind;
    int err;
    int extra;
    uint64_t events;
    buf_t a, b;
} report_t;

typedef struct {
    PyObject_HEAD
    int ep;
    int notify;   /* eventfd the event loop watches: reports are waiting */
    int stop_fd;  /* eventfd that wakes the thread to stop */
    int stop;
    int running;
    int notified; /* the notify eventfd was written since the last take() */
    int waiting;  /* the event loop waits for the mutex: the thread steps aside (see lock()) */
    int nice;     /* how much lower than the process's the thread's scheduling priority is */
    pthread_t thread;
    pthread_mutex_t mu;
    stream_t **streams;
    uint32_t nstreams;
    uint32_t *free_slots;
    uint32_t nfree;
    report_t *reports;
    size_t nreports, rcap;
    buf_t needles[MAX_KINDS][MAX_NEEDLES];
    int nneedles[MAX_KINDS];
    char *rbuf;
    uint64_t relayed_events;
    uint64_t relayed_reads;
    uint64_t blocked_writes;
} Engine;

/* time.monotonic()'s clock, read at the kernel's tick (a few ms): a read's time only matters to the read timeout,
 * and the precise clock cost a measurable share of the thread's own time per read. */
static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t make_id(uint32_t slot, uint32_t gen) { return ((uint64_t)gen << 32) | slot; }

static stream_t *lookup(Engine *e, uint64_t id) {
    uint32_t slot = (uint32_t)(id & 0xffffffffu);
    if (slot >= e->nstreams) return NULL;
    stream_t *s = e->streams[slot];
    if (s == NULL || s->state == ST_FREE || s->gen != (uint32_t)(id >> 32)) return NULL;
    return s;
}

static report_t *new_report(Engine *e, uint64_t id, int kind) {
    if (e->nreports == e->rcap) {
        size_t cap = e->rcap ? e->rcap * 2 : 64;
        report_t *r = realloc(e->reports, cap * sizeof(report_t));
        if (r == NULL) return NULL;
        e->reports = r;
        e->rcap = cap;
    }
    report_t *r = &e->reports[e->nreports++];
    memset(r, 0, sizeof(*r));
    r->id = id;
    r->kind = kind;
    return r;
}

static void wake_loop(Engine *e) {
    if (e->notified) return;
    uint64_t one = 1;
    if (write(e->notify, &one, sizeof(one)) == sizeof(one)) e->notified = 1;
}

static void unwatch(Engine *e, stream_t *s) { epoll_ctl(e->ep, EPOLL_CTL_DEL, s->up, NULL); }

static int watch(Engine *e, stream_t *s, uint64_t id) {
    struct epoll_event ev = {.events = EPOLLIN, .data = {.u64 = id}};
    return epoll_ctl(e->ep, EPOLL_CTL_ADD, s->up, &ev);
}

static void free_stream(Engine *e, stream_t *s, uint64_t id) {
    unwatch(e, s);
    close(s->up);
    close(s->cl);
    buf_free(&s->pending);
    buf_free(&s->last[0]);
    buf_free(&s->last[1]);
    buf_free(&s->done);
    s->state = ST_FREE;
    s->gen++;
    e->free_slots[e->nfree++] = (uint32_t)(id & 0xffffffffu);
}

/* The stream's last events (its last two blocks, then the one that ended with [DONE]), in order, appended to out. */
static int append_last(buf_t *out, const stream_t *s) {
    return buf_append(out, s->last[0].p, s->last[0].len) || buf_append(out, s->last[1].p, s->last[1].len) ||
           buf_append(out, s->done.p, s->done.len);
}

/* The stream's last events and its partial event, joined into a report's a and b. */
static int fill_tail(report_t *r, stream_t *s) {
    if (append_last(&r->a, s) || buf_append(&r->b, s->pending.p, s->pending.len)) return -1;
    r->events = s->events;
    r->extra = s->extra;
    return 0;
}

/* The stream ends here (END, LOST, MALFORMED): reported with its tail, its sockets closed. */
static void finish(Engine *e, stream_t *s, uint64_t id, int kind, int err) {
    report_t *r = new_report(e, id, kind);
    if (r != NULL) {
        r->err = err;
        fill_tail(r, s);
    }
    free_stream(e, s, id);
    wake_loop(e);
}

static void park(Engine *e, stream_t *s) {
    s->state = ST_PARKED;
    unwatch(e, s);
}

static int ends_done(const char *block, size_t len) {
    static const char done[] = "data: [DONE]\n\n";
    size_t dl = sizeof(done) - 1;
    return len >= dl && memcmp(block + len - dl, done, dl) == 0;
}

static void keep_last(stream_t *s, const char *block, size_t len) {
    if (ends_done(block, len)) {
        s->done.len = 0;
        buf_append(&s->done, block, len);
        return;
    }
    buf_t old = s->last[0];
    s->last[0] = s->last[1];
    s->last[1] = old;
    s->last[1].len = 0;
    buf_append(&s->last[1], block, len);
}

/* keep_last() of a block that is the whole pending buffer (the usual read: whole events), without copying it: the
 * buffers trade places, and the pending one left is empty. */
static void keep_pending_as_last(stream_t *s) {
    buf_t spare;
    if (ends_done(s->pending.p, s->pending.len)) {
        spare = s->done;
        s->done = s->pending;
    } else {
        spare = s->last[0];
        s->last[0] = s->last[1];
        s->last[1] = s->pending;
    }
    s->pending = spare;
    s->pending.len = 0;
}

static int has_needle(Engine *e, int kind, const char *p, size_t len) {
    for (int i = 0; i < e->nneedles[kind]; i++) {
        buf_t *n = &e->needles[kind][i];
        if (memmem(p, len, n->p, n->len) != NULL) return 1;
    }
    return 0;
}

static uint64_t count_events(const char *p, size_t len) {
    uint64_t n = 0;
    const char *end = p + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL || nl + 1 >= end) break;
        if (nl[1] == '\n') {
            n++;
            p = nl + 2;
        } else {
            p = nl + 1;
        }
    }
    return n;
}

static void drop_front(buf_t *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

/* Writes a block of events to the client (chunk-framed when the response is). Returns 0 when all of it went; else
 * the stream is parked and BLOCKED (with the bytes that did not go) or GONE reported: 1. */
static int write_block(Engine *e, stream_t *s, uint64_t id, const char *block, size_t len) {
    char head[24];
    size_t hl = 0, tl = 0;
    if (s->chunked_out) { /* the chunk's size in hex, CRLF (by hand: snprintf showed in the thread's profile) */
        static const char digits[] = "0123456789abcdef";
        char hex[16];
        size_t n = 0, size = len;
        do {
            hex[n++] = digits[size & 15];
            size >>= 4;
        } while (size);
        while (n) head[hl++] = hex[--n];
        head[hl++] = '\r';
        head[hl++] = '\n';
        tl = 2;
    }
    struct iovec iov[3] = {{head, hl}, {(void *)block, len}, {(void *)"\r\n", tl}};
    struct msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = 3;
    size_t total = hl + len + tl;
    ssize_t sent = sendmsg(s->cl, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent == (ssize_t)total) return 0;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        report_t *r = new_report(e, id, R_GONE);
        if (r != NULL) r->err = errno;
        park(e, s);
        wake_loop(e);
        return 1;
    }
    size_t done = sent > 0 ? (size_t)sent : 0;
    e->blocked_writes++;
    report_t *r = new_report(e, id, R_BLOCKED);
    if (r != NULL) {
        for (int i = 0; i < 3; i++) {
            size_t n = iov[i].iov_len;
            if (done >= n) {
                done -= n;
                continue;
            }
            buf_append(&r->a, (char *)iov[i].iov_base + done, n - done);
            done = 0;
        }
    }
    park(e, s);
    wake_loop(e);
    return 1;
}

/* The complete events in the stream's pending bytes: relayed, or handed to Python (INSPECT). 1: parked. */
static int relay_events(Engine *e, stream_t *s, uint64_t id) {
    buf_t *p = &s->pending;
    size_t len = 0;
    for (size_t i = p->len; i >= 2; i--) {
        if (p->p[i - 1] == '\n' && p->p[i - 2] == '\n') {
            len = i;
            break;
        }
    }
    if (len == 0) {
        if (p->len <= MAX_PENDING) return 0;
        len = p->len;  /* one event past the limit: forwarded as it is */
    } else if (has_needle(e, s->kind, p->p, len)) {
        report_t *r = new_report(e, id, R_INSPECT);
        if (r != NULL) buf_append(&r->a, p->p, len);
        keep_last(s, p->p, len);
        drop_front(p, len);
        park(e, s);
        wake_loop(e);
        return 1;
    }
    uint64_t events = count_events(p->p, len);
    s->events += events;
    e->relayed_events += events;
    int parked = write_block(e, s, id, p->p, len);  /* (a part that did not go was copied into its report) */
    if (len == p->len) {
        keep_pending_as_last(s);
    } else {
        keep_last(s, p->p, len);
        drop_front(p, len);
    }
    return parked;
}

static void on_readable(Engine *e, stream_t *s, uint64_t id) {
    ssize_t n = read(s->up, e->rbuf, READ_SIZE);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        finish(e, s, id, R_LOST, errno);
        return;
    }
    if (n == 0) {
        finish(e, s, id, R_LOST, 0);
        return;
    }
    e->relayed_reads++;
    s->last_read = monotonic_s();
    size_t before = s->pending.len;
    ssize_t used = chunks_feed(&s->chunks, e->rbuf, (size_t)n, &s->pending);
    if (used < 0) {
        s->broken = 1; /* the complete events before the broken bytes go out first, as the Python relay's do */
    } else if (s->chunks.ended) {
        s->ended = 1;
        if (used < n) s->extra = 1;
    }
    if (s->pending.len > before && relay_events(e, s, id)) return;  /* parked: the end waits for resume() */
    if (s->broken) finish(e, s, id, R_MALFORMED, 0);
    else if (s->ended) finish(e, s, id, R_END, 0);
}

static void *run(void *arg) {
    Engine *e = arg;
    if (e->nice > 0) { /* this thread only (Linux: a thread's own nice value); lowering needs no privilege */
        id_t tid = (id_t)syscall(SYS_gettid);
        errno = 0;
        int current = getpriority(PRIO_PROCESS, tid);
        if (errno == 0) setpriority(PRIO_PROCESS, tid, current + e->nice);
    }
    struct epoll_event events[512];
    for (;;) {
        int n = epoll_wait(e->ep, events, 512, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int stop = 0;
        for (int i = 0; i < n && !stop; i++) {
            uint64_t id = events[i].data.u64;
            /* The lock is taken per stream, not per batch: the event loop's calls wait one stream's read and write
             * at most, never a whole batch of them. */
            pthread_mutex_lock(&e->mu);
            stop = e->stop;
            if (!stop && id != STOP_ID) {
                stream_t *s = lookup(e, id);
                if (s != NULL && s->state == ST_ACTIVE) on_readable(e, s, id);
            }
            pthread_mutex_unlock(&e->mu);
            /* The event loop waits for the mutex (attach, resume, detach, take): let it have it before the next
             * stream. A mutex is not fair: re-locked at once, it would keep the loop waiting for a whole batch. */
            while (__atomic_load_n(&e->waiting, __ATOMIC_ACQUIRE)) sched_yield();
        }
        if (stop) break;
    }
    return NULL;
}

/* ------------------------------------------------------------------ the Python type */

static void lock(Engine *e);

static void engine_shutdown(Engine *e) {
    if (e->running) {
        lock(e);
        e->stop = 1;
        pthread_mutex_unlock(&e->mu);
        uint64_t one = 1;
        if (write(e->stop_fd, &one, sizeof(one)) < 0) { /* the thread still sees stop at its next wake-up */
        }
        Py_BEGIN_ALLOW_THREADS
        pthread_join(e->thread, NULL);
        Py_END_ALLOW_THREADS
        e->running = 0;
    }
    for (uint32_t i = 0; i < e->nstreams; i++) {
        stream_t *s = e->streams[i];
        if (s != NULL && s->state != ST_FREE) free_stream(e, s, make_id(i, s->gen));
    }
    for (size_t i = 0; i < e->nreports; i++) {
        buf_free(&e->reports[i].a);
        buf_free(&e->reports[i].b);
    }
    e->nreports = 0;
    if (e->ep >= 0) close(e->ep);
    if (e->notify >= 0) close(e->notify);
    if (e->stop_fd >= 0) close(e->stop_fd);
    e->ep = e->notify = e->stop_fd = -1;
}

static void Engine_dealloc(Engine *e) {
    engine_shutdown(e);
    for (uint32_t i = 0; i < e->nstreams; i++) free(e->streams[i]);
    free(e->streams);
    free(e->free_slots);
    free(e->reports);
    for (int k = 0; k < MAX_KINDS; k++)
        for (int i = 0; i < e->nneedles[k]; i++) buf_free(&e->needles[k][i]);
    free(e->rbuf);
    pthread_mutex_destroy(&e->mu);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (e == NULL) return NULL;
    e->ep = e->notify = e->stop_fd = -1;
    pthread_mutex_init(&e->mu, NULL);
    return (PyObject *)e;
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"needles", "nice", NULL};
    PyObject *kinds;
    int nice = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|i", names, &kinds, &nice)) return -1;
    e->nice = nice;
    PyObject *seq = PySequence_Fast(kinds, "needles: a sequence (one per stream kind) of sequences of bytes");
    if (seq == NULL) return -1;
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(seq);
    if (nk > MAX_KINDS || e->running) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "needles: at most 4 stream kinds, set once");
        return -1;
    }
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *inner = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, k), "needles: sequences of bytes");
        if (inner == NULL) {
            Py_DECREF(seq);
            return -1;
        }
        Py_ssize_t nn = PySequence_Fast_GET_SIZE(inner);
        if (nn > MAX_NEEDLES) nn = -1;
        for (Py_ssize_t i = 0; i < nn; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(inner, i);
            if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) == 0) {
                nn = -1;
                break;
            }
            buf_append(&e->needles[k][i], PyBytes_AS_STRING(item), (size_t)PyBytes_GET_SIZE(item));
            e->nneedles[k] = (int)i + 1;
        }
        Py_DECREF(inner);
        if (nn < 0) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "needles: at most 12 non-empty bytes per stream kind");
            return -1;
        }
    }
    Py_DECREF(seq);
    e->rbuf = malloc(READ_SIZE);
    e->ep = epoll_create1(EPOLL_CLOEXEC);
    e->notify = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->rbuf == NULL || e->ep < 0 || e->notify < 0 || e->stop_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data = {.u64 = STOP_ID}};
    if (epoll_ctl(e->ep, EPOLL_CTL_ADD, e->stop_fd, &ev) < 0 || pthread_create(&e->thread, NULL, run, e) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    e->running = 1;
    return 0;
}

static int take_slot(Engine *e, uint32_t *slot) {
    if (e->nfree > 0) {
        *slot = e->free_slots[--e->nfree];
        return 0;
    }
    stream_t **streams = realloc(e->streams, (e->nstreams + 1) * sizeof(stream_t *));
    if (streams == NULL) return -1;
    e->streams = streams;
    uint32_t *free_slots = realloc(e->free_slots, (e->nstreams + 1) * sizeof(uint32_t));
    if (free_slots == NULL) return -1;
    e->free_slots = free_slots;
    stream_t *s = calloc(1, sizeof(stream_t));
    if (s == NULL) return -1;
    e->streams[e->nstreams] = s;
    *slot = e->nstreams++;
    return 0;
}

/* The event loop's side of the mutex: the thread holds it for one stream's read and write at a time and steps
 * aside while `waiting` is set, so this waits microseconds. The GIL is let go while it waits, and the mutex is
 * never held while waiting for the GIL (the thread would wait on Python). */
static void lock(Engine *e) {
    if (pthread_mutex_trylock(&e->mu) == 0) return;
    __atomic_add_fetch(&e->waiting, 1, __ATOMIC_ACQ_REL);
    while (pthread_mutex_trylock(&e->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
    }
    __atomic_sub_fetch(&e->waiting, 1, __ATOMIC_ACQ_REL);
}

static PyObject *Engine_attach(Engine *e, PyObject *args) {
    int up, cl, kind, chunked_out;
    Py_buffer body, pending;
    if (!PyArg_ParseTuple(args, "iiy*y*ip", &up, &cl, &body, &pending, &kind, &chunked_out)) return NULL;
    PyObject *result = NULL;
    chunks_t chunks;
    chunks_init(&chunks);
    ssize_t used = chunks_feed(&chunks, body.buf, (size_t)body.len, NULL);
    if (e->ep < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the native relay is closed");
    } else if (kind < 0 || kind >= MAX_KINDS) {
        PyErr_SetString(PyExc_ValueError, "unknown stream kind");
    } else if (used < 0 || chunks.ended) {
        PyErr_SetString(PyExc_ValueError, used < 0 ? "the body's chunk framing is broken" : "the body has ended");
    } else {
        lock(e);
        uint32_t slot;
        if (take_slot(e, &slot)) {
            PyErr_NoMemory();
        } else {
            stream_t *s = e->streams[slot];
            uint32_t gen = s->gen;
            memset(s, 0, sizeof(*s));
            s->gen = gen;
            s->state = ST_ACTIVE;
            s->up = up;
            s->cl = cl;
            s->kind = kind;
            s->chunked_out = chunked_out;
            s->chunks = chunks;
            s->last_read = monotonic_s();
            uint64_t id = make_id(slot, gen);
            if (buf_append(&s->pending, pending.buf, (size_t)pending.len) || watch(e, s, id) < 0) {
                PyErr_SetFromErrno(PyExc_OSError);
                buf_free(&s->pending);
                s->state = ST_FREE;
                s->gen++;
                e->free_slots[e->nfree++] = slot;
            } else {
                result = PyLong_FromUnsignedLongLong(id);
            }
        }
        pthread_mutex_unlock(&e->mu);
    }
    PyBuffer_Release(&body);
    PyBuffer_Release(&pending);
    return result;
}

static PyObject *Engine_resume(Engine *e, PyObject *arg) {
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    lock(e);
    stream_t *s = lookup(e, id);
    int resumed = 0;
    if (s != NULL && s->state == ST_PARKED) {
        resumed = 1;
        if (s->broken) {
            finish(e, s, id, R_MALFORMED, 0);
        } else if (s->ended) {
            finish(e, s, id, R_END, 0);
        } else {
            s->state = ST_ACTIVE;
            if (watch(e, s, id) < 0) finish(e, s, id, R_LOST, errno);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return PyBool_FromLong(resumed);
}

static PyObject *Engine_detach(Engine *e, PyObject *arg) {
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    lock(e);
    stream_t *s = lookup(e, id);
    PyObject *result;
    if (s == NULL) {
        result = Py_NewRef(Py_None);
    } else {
        buf_t last = {0};
        append_last(&last, s);
        result = Py_BuildValue("(Ky#y#)", (unsigned long long)s->events, last.p ? last.p : "", (Py_ssize_t)last.len,
                               s->pending.p ? s->pending.p : "", (Py_ssize_t)s->pending.len);
        buf_free(&last);
        free_stream(e, s, id);
    }
    pthread_mutex_unlock(&e->mu);
    return result;
}

static PyObject *Engine_last_read(Engine *e, PyObject *arg) {
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    lock(e);
    stream_t *s = lookup(e, id);
    double at = s != NULL ? s->last_read : -1.0;
    pthread_mutex_unlock(&e->mu);
    if (at < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(at);
}

static PyObject *Engine_take(Engine *e, PyObject *unused) {
    uint64_t count;
    if (e->notify >= 0 && read(e->notify, &count, sizeof(count)) < 0) { /* nothing written: fine */
    }
    lock(e);
    report_t *reports = e->reports;
    size_t n = e->nreports;
    e->reports = NULL;
    e->nreports = e->rcap = 0;
    e->notified = 0;
    pthread_mutex_unlock(&e->mu);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; i < n; i++) {
        report_t *r = &reports[i];
        if (list != NULL) {
            PyObject *item = Py_BuildValue("(Kiiiiy#y#)", (unsigned long long)r->id, r->kind, r->err, r->extra,
                                           (int)r->events, r->a.p ? r->a.p : "", (Py_ssize_t)r->a.len,
                                           r->b.p ? r->b.p : "", (Py_ssize_t)r->b.len);
            if (item == NULL) {
                Py_CLEAR(list);
            } else {
                PyList_SET_ITEM(list, (Py_ssize_t)i, item);
            }
        }
        buf_free(&r->a);
        buf_free(&r->b);
    }
    free(reports);
    return list;
}

static PyObject *Engine_fileno(Engine *e, PyObject *unused) { return PyLong_FromLong(e->notify); }

static PyObject *Engine_close(Engine *e, PyObject *unused) {
    engine_shutdown(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_stats(Engine *e, PyObject *unused) {
    lock(e);
    uint32_t live = 0;
    for (uint32_t i = 0; i < e->nstreams; i++)
        if (e->streams[i] != NULL && e->streams[i]->state != ST_FREE) live++;
    PyObject *result = Py_BuildValue("{sIsKsKsK}", "streams", live, "events", (unsigned long long)e->relayed_events,
                                     "reads", (unsigned long long)e->relayed_reads, "blocked",
                                     (unsigned long long)e->blocked_writes);
    pthread_mutex_unlock(&e->mu);
    return result;
}

static PyMethodDef Engine_methods[] = {
    {"attach", (PyCFunction)Engine_attach, METH_VARARGS,
     "attach(upstream_fd, client_fd, body_so_far, pending, kind, chunked_out) -> id: relay a stream from here on. "
     "The engine owns both descriptors (duplicates) from a successful return."},
    {"resume", (PyCFunction)Engine_resume, METH_O, "resume(id) -> bool: a parked stream reads on (or ends)."},
    {"detach", (PyCFunction)Engine_detach, METH_O,
     "detach(id) -> (events, last, pending) | None: stop relaying a live stream; its sockets' duplicates are closed."},
    {"last_read", (PyCFunction)Engine_last_read, METH_O, "last_read(id) -> float | None: time.monotonic() of its last read."},
    {"take", (PyCFunction)Engine_take, METH_NOARGS,
     "take() -> [(id, report, errno, extra, events, a, b)]: the reports since the last call."},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS, "The eventfd that is readable while reports wait."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Stop the thread and close every stream's descriptors."},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "Live streams, events and reads relayed, writes the client blocked."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.data._relay_loop.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A thread relaying attached SSE streams from engine sockets to client sockets.",
    .tp_new = Engine_new,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

static PyObject *feed_chunks(PyObject *self, PyObject *args) {
    /* For the tests: the data of a chunked body fed in pieces, and whether it ended (-1: broken framing). */
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "O", &pieces)) return NULL;
    PyObject *seq = PySequence_Fast(pieces, "a sequence of bytes");
    if (seq == NULL) return NULL;
    chunks_t c;
    chunks_init(&c);
    buf_t out = {0};
    int status = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && status == 0; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            Py_DECREF(seq);
            buf_free(&out);
            PyErr_SetString(PyExc_TypeError, "pieces must be bytes");
            return NULL;
        }
        ssize_t used = chunks_feed(&c, PyBytes_AS_STRING(item), (size_t)PyBytes_GET_SIZE(item), &out);
        if (used < 0) status = -1;
        else if (c.ended) status = 1;
    }
    Py_DECREF(seq);
    PyObject *result = Py_BuildValue("(y#i)", out.p ? out.p : "", (Py_ssize_t)out.len, status);
    buf_free(&out);
    return result;
}

static PyObject *count_events_py(PyObject *self, PyObject *arg) {
    /* The relay's count of a read's events (its blank lines), as bytes.count(b"\n\n") counts them. */
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "count_events takes bytes");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(count_events(PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg)));
}

static PyObject *find_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* The lowest index at or after start where one of needles (a tuple of bytes) begins in data; -1: none. One memmem
       per needle, each over what lies before the best match so far. */
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyTuple_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "find_any(data: bytes, needles: tuple[bytes, ...], start: int)");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (start < 0) start = 0;
    if (start > size) start = size; /* (as re clamps a search's start) */
    Py_ssize_t best = -1;
    Py_ssize_t count = PyTuple_GET_SIZE(args[1]);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *needle = PyTuple_GET_ITEM(args[1], i);
        if (!PyBytes_Check(needle)) {
            PyErr_SetString(PyExc_TypeError, "needles must be bytes");
            return NULL;
        }
        Py_ssize_t length = PyBytes_GET_SIZE(needle);
        Py_ssize_t limit = best < 0 ? size : best - 1 + length; /* a match must begin before the best one */
        if (limit > size) limit = size;
        if (limit < start || (limit == start && length > 0)) continue;
        const char *at = memmem(data + start, (size_t)(limit - start), PyBytes_AS_STRING(needle), (size_t)length);
        if (at != NULL) best = at - data;
    }
    return PyLong_FromSsize_t(best);
}

static PyMethodDef module_methods[] = {
    {"feed_chunks", feed_chunks, METH_VARARGS, "feed_chunks(pieces) -> (data, 1 ended | 0 not yet | -1 broken)"},
    {"count_events", count_events_py, METH_O, "count_events(data) -> int: its blank lines, as data.count(b'\\n\\n')."},
    {"find_any", (PyCFunction)(void (*)(void))find_any, METH_FASTCALL,
     "find_any(data, needles, start) -> int: where the first of needles begins at or after start; -1: none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_relay_loop", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__relay_loop(void) {
    chunks_setup();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "INSPECT", R_INSPECT);
    PyModule_AddIntConstant(m, "BLOCKED", R_BLOCKED);
    PyModule_AddIntConstant(m, "GONE", R_GONE);
    PyModule_AddIntConstant(m, "END", R_END);
    PyModule_AddIntConstant(m, "LOST", R_LOST);
    PyModule_AddIntConstant(m, "MALFORMED", R_MALFORMED);
    return m;
}
