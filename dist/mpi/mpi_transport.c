/*
 * dist/mpi/mpi_transport.c - dist/transport.h over MPI: the module (loom-mpi.so) that loom loads
 * inside an MPI job. Errors return to the caller (MPI_ERRORS_RETURN) so that a failed call
 * becomes a message naming the rank, not an abort inside the library.
 */
#define _GNU_SOURCE
#include "dist/transport.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <mpi.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* MPI counts are ints: larger buffers go in pieces of this many bytes */
#define PIECE (1 << 30)

static int mpi_fail(int rc, const char *what, char *err, size_t err_size)
{
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, text, &len);
    snprintf(err, err_size, "MPI %s failed: %s", what, text);
    return -1;
}

/* ---- Liveness: rank 0 learns at once that another rank's process has ended ----------------
 * Open MPI 4 does not fail a receive whose peer has died: rank 0 would wait in it until mpirun
 * ends the job (SIGTERM, then SIGKILL a second later), and the requests in flight would see
 * their connections close instead of an error. So every other rank holds a TCP connection to
 * rank 0 that it never writes to: the kernel closes it when the process ends, however it ends,
 * and rank 0's receives, which poll MPI, poll these sockets too. A rank that cannot connect (a
 * firewall between hosts) runs without one, and says so. */
#define LIVENESS_TIMEOUT_MS 3000

static int *live_fd;     /* rank 0: live_fd[r], the connection from rank r, or -1 */
static int my_link = -1; /* the other ranks: this rank's connection to rank 0 */
static int n_ranks;
static atomic_int dead_rank = -1;

typedef struct liveness_addr {
    char host[MPI_MAX_PROCESSOR_NAME];
    int port; /* 0: rank 0 has no listener */
} liveness_addr;

static int wait_fd(int fd, short events, int ms)
{
    struct pollfd p = {fd, events, 0};
    int rc;
    while ((rc = poll(&p, 1, ms)) < 0 && errno == EINTR)
        ;
    return rc == 1 && !(p.revents & (POLLERR | POLLNVAL));
}

/* A follower's connection to rank 0's listener, or -1: connected within the timeout, then this
 * rank's number sent, so that rank 0 knows whose socket it accepted. */
static int connect_to_root(const liveness_addr *a, int rank)
{
    char port[16];
    snprintf(port, sizeof port, "%d", a->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(a->host, port, &hints, &res) != 0)
        return -1;
    int fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            continue;
        int soerr = 0, rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        socklen_t len = sizeof soerr;
        if (rc != 0 && errno == EINPROGRESS && wait_fd(fd, POLLOUT, LIVENESS_TIMEOUT_MS) &&
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr == 0)
            rc = 0;
        if (rc != 0 || write(fd, &rank, sizeof rank) != (ssize_t)sizeof rank)
            close(fd), fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

/* Collective, right after MPI_Init. Never fails the job: without a link, a rank's death is
 * still noticed, by mpirun ending the job. */
static void liveness_setup(int rank, int size, const char *host)
{
    n_ranks = size;
    liveness_addr a = {"", 0};
    int listener = -1;
    if (rank == 0) {
        struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT};
        socklen_t len = sizeof sa;
        int v6only = 0; /* IPv4 peers too */
        listener = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (listener >= 0 &&
            (setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only) != 0 ||
             bind(listener, (struct sockaddr *)&sa, sizeof sa) != 0 ||
             listen(listener, size) != 0 ||
             getsockname(listener, (struct sockaddr *)&sa, &len) != 0))
            close(listener), listener = -1;
        snprintf(a.host, sizeof a.host, "%s", host);
        a.port = listener >= 0 ? ntohs(sa.sin6_port) : 0;
    }
    MPI_Bcast(&a, sizeof a, MPI_BYTE, 0, MPI_COMM_WORLD);
    a.host[sizeof a.host - 1] = 0;
    if (rank != 0) {
        my_link = a.port ? connect_to_root(&a, rank) : -1;
        if (a.port && my_link < 0)
            fprintf(stderr,
                    "loom: rank %d cannot connect to rank 0 (%s, port %d) for liveness: if this "
                    "rank dies, requests in flight see their connections close\n",
                    rank, a.host, a.port);
    }
    int linked = my_link >= 0, *all = rank == 0 ? calloc((size_t)size, sizeof *all) : NULL;
    MPI_Gather(&linked, 1, MPI_INT, all, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank == 0 && all && (live_fd = malloc((size_t)size * sizeof *live_fd))) {
        int expected = 0;
        for (int r = 0; r < size; r++) {
            live_fd[r] = -1;
            expected += r > 0 && all[r];
        }
        for (int i = 0; listener >= 0 && i < expected; i++) {
            int r = -1,
                fd = wait_fd(listener, POLLIN, LIVENESS_TIMEOUT_MS)
                ? accept4(listener, NULL, NULL, SOCK_CLOEXEC)
                : -1;
            if (fd >= 0 && wait_fd(fd, POLLIN, LIVENESS_TIMEOUT_MS) &&
                read(fd, &r, sizeof r) == (ssize_t)sizeof r && r > 0 && r < size && live_fd[r] < 0)
                live_fd[r] = fd;
            else if (fd >= 0)
                close(fd);
        }
    }
    if (listener >= 0)
        close(listener);
    free(all);
}

/* Records r as the dead rank unless one already is (the receive loop and the watcher may both
 * see it); returns the one recorded. */
static int mark_dead(int r)
{
    int none = -1;
    atomic_compare_exchange_strong(&dead_rank, &none, r);
    return atomic_load(&dead_rank);
}

/* rank 0: a rank whose connection has closed, or -1 */
static int find_dead_rank(void)
{
    int known = atomic_load(&dead_rank);
    if (known >= 0 || !live_fd)
        return known;
    struct pollfd p[64];
    for (int r0 = 1; r0 < n_ranks; r0 += 64) {
        int n = 0;
        for (int r = r0; r < n_ranks && n < 64; r++)
            p[n++] = (struct pollfd){live_fd[r], POLLIN, 0}; /* fd -1: ignored */
        if (poll(p, (nfds_t)n, 0) <= 0)
            continue;
        for (int i = 0; i < n; i++)
            if (p[i].revents) /* nothing is ever written to it: readable means closed */
                return mark_dead(r0 + i);
    }
    return -1;
}

static int dead_rank_error(char *err, size_t err_size)
{
    snprintf(err, err_size, "rank %d stopped: its process ended (its connection to rank 0 closed)",
             atomic_load(&dead_rank));
    return -1;
}

/* ---- Watching: the engine learns of a death even while its thread is inside MPI -----------
 * When Open MPI's TCP transport sees the dead peer's connection close before rank 0's own
 * receive loop has looked at the liveness links, the call never returns (it reports the peer
 * and aborts the process). A thread blocked on the liveness links alone notices in the same
 * instant, without MPI, and tells its watcher, which answers the requests in flight. */
static pthread_t watcher;
static int watching, wake_fd[2] = {-1, -1};
static void (*on_stop_fn)(void *ctx, const char *why);
static void *on_stop_ctx;

static void *watch_links(void *unused)
{
    (void)unused;
    struct pollfd *p = calloc((size_t)n_ranks, sizeof *p);
    if (!p)
        return NULL;
    p[0] = (struct pollfd){wake_fd[0], POLLIN, 0};
    for (int r = 1; r < n_ranks; r++)
        p[r] = (struct pollfd){live_fd[r], POLLIN, 0}; /* fd -1: ignored */
    for (;;) {
        if (poll(p, (nfds_t)n_ranks, -1) < 0 && errno != EINTR)
            break;
        if (p[0].revents)
            break;
        int r = 1;
        while (r < n_ranks && !p[r].revents)
            r++;
        if (r == n_ranks)
            continue;
        mark_dead(r);
        char why[160];
        dead_rank_error(why, sizeof why);
        on_stop_fn(on_stop_ctx, why);
        break;
    }
    free(p);
    return NULL;
}

static void mpi_watch(void (*on_stop)(void *ctx, const char *why), void *ctx)
{
    if (watching) {
        char wake = 1;
        if (write(wake_fd[1], &wake, 1) != 1)
            perror("loom: waking the liveness watcher");
        pthread_join(watcher, NULL);
        close(wake_fd[0]), close(wake_fd[1]);
        wake_fd[0] = wake_fd[1] = -1;
        watching = 0;
    }
    if (!on_stop || !live_fd)
        return;
    const char *lost = "loom: cannot start the liveness watcher (%s): requests in flight when "
                       "a rank dies may see their connections close\n";
    if (pipe2(wake_fd, O_CLOEXEC) != 0) {
        fprintf(stderr, lost, strerror(errno));
        return;
    }
    on_stop_fn = on_stop, on_stop_ctx = ctx;
    int rc = pthread_create(&watcher, NULL, watch_links, NULL);
    if (rc != 0) {
        fprintf(stderr, lost, strerror(rc));
        close(wake_fd[0]), close(wake_fd[1]);
        wake_fd[0] = wake_fd[1] = -1;
        return;
    }
    watching = 1;
}

static int mpi_join(int *rank, int *size, char *host, size_t host_size, char *err, size_t err_size)
{
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    /* one thread at a time calls MPI, but not always the same one (the server's engine) */
    if (!inited && MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        snprintf(err, err_size, "MPI_Init_thread failed (is this process started by mpirun?)");
        return -1;
    }
    if (!inited && provided < MPI_THREAD_SERIALIZED) {
        snprintf(err, err_size,
                 "this MPI library gives thread level %d; loom needs %d (serialized)", provided,
                 MPI_THREAD_SERIALIZED);
        return -1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    char name[MPI_MAX_PROCESSOR_NAME] = "";
    int len = 0;
    MPI_Get_processor_name(name, &len);
    snprintf(host, host_size, "%s", name);
    if (*size > 1)
        liveness_setup(*rank, *size, name);
    return 0;
}

static int mpi_bcast(void *buf, uint64_t bytes, char *err, size_t err_size)
{
    for (uint64_t off = 0; off < bytes; off += PIECE) {
        int n = bytes - off < PIECE ? (int)(bytes - off) : PIECE;
        int rc = MPI_Bcast((char *)buf + off, n, MPI_BYTE, 0, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS)
            return mpi_fail(rc, "broadcast", err, err_size);
    }
    return 0;
}

static int mpi_gather(const void *mine, uint64_t bytes, void *all, char *err, size_t err_size)
{
    if (bytes > INT_MAX) {
        snprintf(err, err_size, "gathering %llu bytes from each rank: too many",
                 (unsigned long long)bytes);
        return -1;
    }
    int rc = MPI_Gather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? 0 : mpi_fail(rc, "gather", err, err_size);
}

/* A send returns once its message is on its way, without waiting for the receiver: a copy goes
 * out with MPI_Isend. Otherwise two ranks that send each other large messages (rank 0 a
 * micro-batch's hidden states, the last rank the previous one's logits) would each wait for
 * the other to receive. Sends that completed are let go at each send; leave waits for all. */
typedef struct pending_send {
    MPI_Request req;
    void *copy;
} pending_send;
static pending_send *pending;
static int n_pending, pending_cap;

static void reap(int wait_all)
{
    int kept = 0;
    for (int i = 0; i < n_pending; i++) {
        int done = 0;
        if (wait_all)
            MPI_Wait(&pending[i].req, MPI_STATUS_IGNORE), done = 1;
        else
            MPI_Test(&pending[i].req, &done, MPI_STATUS_IGNORE);
        if (done)
            free(pending[i].copy);
        else
            pending[kept++] = pending[i];
    }
    n_pending = kept;
}

static int mpi_send(int to, const void *buf, uint64_t bytes, char *err, size_t err_size)
{
    reap(0);
    for (uint64_t off = 0; off < bytes || off == 0; off += PIECE) {
        int n = bytes - off < PIECE ? (int)(bytes - off) : PIECE;
        if (n_pending == pending_cap) {
            int cap = pending_cap ? 2 * pending_cap : 16;
            pending_send *p = realloc(pending, (size_t)cap * sizeof *p);
            if (!p) {
                snprintf(err, err_size, "out of memory");
                return -1;
            }
            pending = p, pending_cap = cap;
        }
        void *copy = malloc(n ? (size_t)n : 1);
        if (!copy) {
            snprintf(err, err_size, "out of memory for a message of %d bytes", n);
            return -1;
        }
        memcpy(copy, (const char *)buf + off, (size_t)n);
        int rc = MPI_Isend(copy, n, MPI_BYTE, to, 0, MPI_COMM_WORLD, &pending[n_pending].req);
        if (rc != MPI_SUCCESS) {
            free(copy);
            return mpi_fail(rc, "send", err, err_size);
        }
        pending[n_pending++].copy = copy;
        if (bytes == 0)
            break;
    }
    return 0;
}

/* MPI_Recv, but on rank 0 given up (returning -2) as soon as a rank's liveness link closes */
static int recv_piece(int from, void *buf, int n, MPI_Status *st)
{
    if (!live_fd)
        return MPI_Recv(buf, n, MPI_BYTE, from, 0, MPI_COMM_WORLD, st);
    MPI_Request req;
    int rc = MPI_Irecv(buf, n, MPI_BYTE, from, 0, MPI_COMM_WORLD, &req), done = 0;
    for (long spins = 0; rc == MPI_SUCCESS && !done; spins++) {
        rc = MPI_Test(&req, &done, st);
        if (!done && spins % 64 == 63 && find_dead_rank() >= 0) {
            MPI_Cancel(&req);
            MPI_Request_free(&req);
            return -2;
        }
    }
    return rc;
}

static int mpi_recv(int from, void *buf, uint64_t bytes, char *err, size_t err_size)
{
    if (find_dead_rank() >= 0)
        return dead_rank_error(err, err_size);
    for (uint64_t off = 0; off < bytes || off == 0; off += PIECE) {
        int n = bytes - off < PIECE ? (int)(bytes - off) : PIECE, got = 0;
        MPI_Status st;
        int rc = recv_piece(from, (char *)buf + off, n, &st);
        if (rc == -2)
            return dead_rank_error(err, err_size);
        if (rc != MPI_SUCCESS)
            return mpi_fail(rc, "receive", err, err_size);
        MPI_Get_count(&st, MPI_BYTE, &got);
        if (got != n) {
            snprintf(err, err_size, "rank %d sent %d bytes where %d were due", from, got, n);
            return -1;
        }
        if (bytes == 0)
            break;
    }
    return 0;
}

static void mpi_abort(int status)
{
    MPI_Abort(MPI_COMM_WORLD, status);
}

static void mpi_leave(void)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    /* with a rank dead, sends to it never complete and MPI_Finalize waits for it: mpirun is
     * ending the job anyway */
    mpi_watch(NULL, NULL);
    if (!finalized && atomic_load(&dead_rank) < 0) {
        reap(1);
        MPI_Finalize();
    }
    free(pending);
    pending = NULL, n_pending = pending_cap = 0;
    for (int r = 0; live_fd && r < n_ranks; r++)
        if (live_fd[r] >= 0)
            close(live_fd[r]);
    free(live_fd);
    live_fd = NULL;
    if (my_link >= 0)
        close(my_link), my_link = -1;
}

__attribute__((visibility("default"))) const loom_transport *loom_transport_entry(void)
{
    static const loom_transport t = {.abi = LOOM_TRANSPORT_ABI,
                                     .name = "mpi",
                                     .join = mpi_join,
                                     .bcast = mpi_bcast,
                                     .gather = mpi_gather,
                                     .send = mpi_send,
                                     .recv = mpi_recv,
                                     .watch = mpi_watch,
                                     .abort = mpi_abort,
                                     .leave = mpi_leave};
    return &t;
}
