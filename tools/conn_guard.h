/*
 * tools/conn_guard.h - keeping slow clients from holding `loom serve`'s connections: every
 * connection must send its first request's headers within a deadline from opening, each
 * body within another from its headers, and a kept-alive connection its next request within
 * the idle timeout; past them it is closed. When every slot is taken, a new connection
 * evicts the oldest one still waiting for its headers (not yet past the key check), else the
 * oldest idle one, so a slowloris from many addresses cannot lock everyone else out.
 */
#ifndef LOOM_TOOLS_CONN_GUARD_H
#define LOOM_TOOLS_CONN_GUARD_H

#include <microhttpd.h>
#include <stdint.h>

typedef struct conn_guard conn_guard;

/* max_conn: the slots (the daemon's own limit must be a little above, so that a new
 * connection is accepted and can evict); header_s, body_s, idle_s: the deadlines in seconds.
 * NULL when out of memory or the watchdog thread cannot start. */
conn_guard *conn_guard_start(long max_conn, long header_s, long body_s, long idle_s);
void conn_guard_stop(conn_guard *g);

/* For MHD_OPTION_NOTIFY_CONNECTION, with the guard as its argument. */
void conn_guard_notify(void *guard, struct MHD_Connection *con, void **socket_context,
                       enum MHD_ConnectionNotificationCode what);

/* A request's progress on con: its headers are in (and passed the key check when the route
 * has one); its body is in; its response is done (the connection is idle). */
void conn_guard_headers_done(struct MHD_Connection *con);
void conn_guard_body_done(struct MHD_Connection *con);
void conn_guard_request_done(struct MHD_Connection *con);

/* Connections closed for missing a deadline, and evicted to make room. */
uint64_t conn_guard_timed_out(conn_guard *g);
uint64_t conn_guard_evicted(conn_guard *g);

#endif
