/*
 * tools/conn_guard.c - see conn_guard.h. libmicrohttpd's own timeout measures inactivity
 * only, so a client sending a header byte every few seconds keeps its connection forever.
 * Each connection is listed here (its socket context) with the phase it is in and when that
 * began; a watchdog thread closes those past their deadline by shutting their socket down,
 * which the connection's thread then sees as the client going away. The list's lock is held
 * for that shutdown, and a connection leaves the list (under the lock) before libmicrohttpd
 * closes its socket, so a descriptor is never shut down after it was reused.
 */
#define _GNU_SOURCE
#include "conn_guard.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

/* IDLE: a kept-alive connection between requests */
typedef enum { WAITING_HEADERS, READING_BODY, ANSWERING, IDLE } phase;

typedef struct tracked {
    struct tracked *prev, *next;
    conn_guard *guard;
    int fd;
    phase at;
    double since; /* when this phase began */
    int closing;  /* shut down already */
} tracked;

struct conn_guard {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t thread;
    int stop;
    tracked *head; /* oldest first */
    tracked *tail;
    long count, max_conn;
    double header_s, body_s, idle_s;
    uint64_t timed_out, evicted;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void close_tracked(tracked *t)
{
    if (!t->closing)
        shutdown(t->fd, SHUT_RDWR);
    t->closing = 1;
}

static void *watch(void *arg)
{
    conn_guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        double now = now_s();
        for (tracked *t = g->head; t; t = t->next) {
            double limit = t->at == WAITING_HEADERS ? g->header_s
                : t->at == READING_BODY             ? g->body_s
                : t->at == IDLE                     ? g->idle_s
                                                    : 0;
            if (limit > 0 && !t->closing && now - t->since > limit) {
                close_tracked(t);
                g->timed_out++;
            }
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 250 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000L)
            until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&g->wake, &g->mu, &until);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

conn_guard *conn_guard_start(long max_conn, long header_s, long body_s, long idle_s)
{
    conn_guard *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->wake, NULL);
    g->max_conn = max_conn, g->header_s = (double)header_s, g->body_s = (double)body_s;
    g->idle_s = (double)idle_s;
    if (pthread_create(&g->thread, NULL, watch, g) != 0) {
        free(g);
        return NULL;
    }
    return g;
}

void conn_guard_stop(conn_guard *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_signal(&g->wake);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->thread, NULL);
    for (tracked *t = g->head, *next; t; t = next) {
        next = t->next;
        free(t);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->wake);
    free(g);
}

void conn_guard_notify(void *guard, struct MHD_Connection *con, void **socket_context,
                       enum MHD_ConnectionNotificationCode what)
{
    conn_guard *g = guard;
    if (what == MHD_CONNECTION_NOTIFY_CLOSED) {
        tracked *t = *socket_context;
        if (!t)
            return;
        pthread_mutex_lock(&g->mu);
        *(t->prev ? &t->prev->next : &g->head) = t->next;
        *(t->next ? &t->next->prev : &g->tail) = t->prev;
        g->count--;
        pthread_mutex_unlock(&g->mu);
        free(t);
        *socket_context = NULL;
        return;
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(con,
                                                                 MHD_CONNECTION_INFO_CONNECTION_FD);
    tracked *t = calloc(1, sizeof *t);
    if (!t || !ci) {
        free(t);
        return; /* untracked: only the daemon's own limits apply to it */
    }
    *t = (tracked){.guard = g, .fd = ci->connect_fd, .at = WAITING_HEADERS, .since = now_s()};
    pthread_mutex_lock(&g->mu);
    t->prev = g->tail;
    *(g->tail ? &g->tail->next : &g->head) = t;
    g->tail = t;
    if (++g->count > g->max_conn) {
        /* full: the oldest connection still waiting for its headers makes room, else the
         * oldest idle one; failing both (every slot is busy with a request), this one goes */
        tracked *victim = NULL;
        for (int pass = 0; pass < 2 && !victim; pass++)
            for (tracked *o = g->head; o != t && !victim; o = o->next)
                if (o->at == (pass ? IDLE : WAITING_HEADERS) && !o->closing)
                    victim = o;
        victim = victim ? victim : t;
        close_tracked(victim);
        g->evicted++;
    }
    pthread_mutex_unlock(&g->mu);
    *socket_context = t;
}

static void set_phase(struct MHD_Connection *con, phase at)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(
        con, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    tracked *t = ci ? ci->socket_context : NULL;
    if (!t)
        return;
    pthread_mutex_lock(&t->guard->mu);
    t->at = at;
    t->since = now_s();
    pthread_mutex_unlock(&t->guard->mu);
}

void conn_guard_headers_done(struct MHD_Connection *con)
{
    set_phase(con, READING_BODY);
}

void conn_guard_body_done(struct MHD_Connection *con)
{
    set_phase(con, ANSWERING);
}

void conn_guard_request_done(struct MHD_Connection *con)
{
    set_phase(con, IDLE);
}

uint64_t conn_guard_timed_out(conn_guard *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t n = g->timed_out;
    pthread_mutex_unlock(&g->mu);
    return n;
}

uint64_t conn_guard_evicted(conn_guard *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t n = g->evicted;
    pthread_mutex_unlock(&g->mu);
    return n;
}
