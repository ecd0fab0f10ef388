/*
 * api/mpi/mpi_transport.c - api/transport.h over MPI: the module (loom-mpi.so) that loom loads
 * inside an MPI job. Errors return to the caller (MPI_ERRORS_RETURN) so that a failed call
 * becomes a message naming the rank, not an abort inside the library.
 */
#include "api/transport.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static int mpi_recv(int from, void *buf, uint64_t bytes, char *err, size_t err_size)
{
    for (uint64_t off = 0; off < bytes || off == 0; off += PIECE) {
        int n = bytes - off < PIECE ? (int)(bytes - off) : PIECE, got = 0;
        MPI_Status st;
        int rc = MPI_Recv((char *)buf + off, n, MPI_BYTE, from, 0, MPI_COMM_WORLD, &st);
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
    if (!finalized) {
        reap(1);
        MPI_Finalize();
    }
    free(pending);
    pending = NULL, n_pending = pending_cap = 0;
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
                                     .abort = mpi_abort,
                                     .leave = mpi_leave};
    return &t;
}
