/* A step graph's host work, served by the library's own thread (run/host_nodes.py): a mixed step captured
 * as one graph hands each host segment (an op list, ks_program_node) and each host-made norm input
 * (ks_norm_node) over by two pinned words instead of a host sync.  The graph writes item i's number
 * (1-based) into `arrived` once what the item reads is on the host (cuStreamWriteValue32, after its
 * copies), and waits until `done` holds it (cuStreamWaitValue32) before the copies that take the results
 * back; this thread spins on `arrived`, runs the item, and writes `done`.  Both sides poll pinned memory,
 * a few microseconds a hand-off, where a host function node costs tens.  No CUDA call here.
 *
 * One list at a time: ks_serve_begin hands it over (the thread sleeps between steps), ks_serve_end waits
 * for it and returns 0, or -(the item waited on) when `arrived` never came (ks_serve_abort: the graph
 * failed; or a minute passed). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "host_kernels.h"
#include "host_simd.h"

typedef struct {
    int kind;                       /* KS_ITEM_PROGRAM: ks_program_node(arg); KS_ITEM_NORM: ks_norm_node(arg) */
    void *arg;
} ks_host_item_t;

enum { KS_ITEM_PROGRAM = 0, KS_ITEM_NORM = 1 };

typedef struct {
    _Atomic uint32_t *arrived, *done;   /* pinned words: the device writes `arrived`, the host `done` */
    const ks_host_item_t *items;
    int n;
    _Atomic uint32_t *link_ready;       /* a link share's word (host_moe.c), raised to each item's number after
                                           it: a share its item failed to hand over does not hold the graph */
} ks_host_list_t;

#define SERVE_GIVE_UP_NS 60000000000LL  /* a minute without the device's word: it is not coming */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    const ks_host_list_t *list;     /* the list being served, NULL: idle */
    int status, started;
    _Atomic int abort;
} server = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};

static int64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Process-wide, for benches (ks_serve_times): lists served, items run, the ns items took, the ns this thread
   waited for the device's word (its segments between items, and each hand-off's latency both ways). */
static _Atomic long long served[4];

void ks_serve_times(long long out[4], int reset) {
    for (int i = 0; i < 4; i++) out[i] = reset ? atomic_exchange(&served[i], 0) : atomic_load(&served[i]);
}

static int serve(const ks_host_list_t *l) {
    int64_t t = clock_ns();
    atomic_fetch_add(&served[0], 1);
    for (int i = 0; i < l->n; i++) {
        const uint32_t want = (uint32_t)i + 1;
        int64_t give_up = 0;
        for (long spins = 1; atomic_load_explicit(l->arrived, memory_order_acquire) < want; spins++) {
            cpu_relax();
            if (spins % 4096 == 0) {
                if (atomic_load(&server.abort)) return -(i + 1);
                const int64_t now = clock_ns();
                if (give_up == 0) give_up = now + SERVE_GIVE_UP_NS;
                else if (now > give_up) return -(i + 1);
            }
        }
        const ks_host_item_t *item = l->items + i;
        const int64_t arrived = clock_ns();
        if (item->kind == KS_ITEM_PROGRAM) ks_program_node(item->arg);
        else ks_norm_node(item->arg);
        const int64_t ran = clock_ns();
        atomic_fetch_add(&served[1], 1), atomic_fetch_add(&served[2], ran - arrived);
        atomic_fetch_add(&served[3], arrived - t);
        t = ran;
        if (l->link_ready && atomic_load_explicit(l->link_ready, memory_order_acquire) < want)
            atomic_store_explicit(l->link_ready, want, memory_order_release);
        atomic_store_explicit(l->done, want, memory_order_release);
    }
    return 0;
}

static void *server_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&server.lock);
    for (;;) {
        while (server.list == NULL || server.status != 1) pthread_cond_wait(&server.wake, &server.lock);
        const ks_host_list_t *l = server.list;
        pthread_mutex_unlock(&server.lock);
        const int status = serve(l);
        pthread_mutex_lock(&server.lock);
        server.status = status;
        server.list = NULL;
        pthread_cond_broadcast(&server.idle);
    }
    return NULL;
}

static void server_after_fork(void) {      /* the child has no server thread */
    pthread_mutex_init(&server.lock, NULL);
    pthread_cond_init(&server.wake, NULL);
    pthread_cond_init(&server.idle, NULL);
    server.list = NULL;
    server.started = 0;
}

int ks_serve_begin(const ks_host_list_t *l) {
    pthread_mutex_lock(&server.lock);
    if (!server.started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, server_main, NULL) != 0) {
            pthread_mutex_unlock(&server.lock);
            return -1;
        }
        pthread_detach(thread);
        pthread_atfork(NULL, NULL, server_after_fork);
        server.started = 1;
    }
    while (server.list != NULL) pthread_cond_wait(&server.idle, &server.lock);
    atomic_store(&server.abort, 0);
    server.list = l;
    server.status = 1;                  /* 1: handed over, not finished */
    pthread_cond_signal(&server.wake);
    pthread_mutex_unlock(&server.lock);
    return 0;
}

int ks_serve_end(void) {
    pthread_mutex_lock(&server.lock);
    while (server.list != NULL) pthread_cond_wait(&server.idle, &server.lock);
    const int status = server.status;
    pthread_mutex_unlock(&server.lock);
    return status;
}

void ks_serve_abort(void) { atomic_store(&server.abort, 1); }
