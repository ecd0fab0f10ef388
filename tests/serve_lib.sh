# tests/serve_lib.sh - sourced by the `loom serve` tests (after lib.sh, with MODEL and KEY set):
# starting a server on a free loopback port and talking to it.

# a test that stops early (set -u, an unexpected exit) must not leave its server running
on_exit="[ -n \"\${PID:-}\" ] && kill -TERM \"\$PID\" 2>/dev/null; $on_exit"

# start_server LOG ARGS...: starts loom serve on a free port; sets PID, port and URL. With
# LOOM_SERVE_MPIRUN (a launcher: "mpirun -np 2 ..."), the server is a pipeline over the job's
# ranks (tests/distributed.sh): PID is then rank 0's process, LAUNCHER the launcher's.
start_server() {
    log=$1; shift
    # emptied here, not by the background job's redirection: that may run after the loop below
    # has read the last server's port from the old log
    rm -f "$log.0"; : >"$log"
    if [ -n "${LOOM_SERVE_MPIRUN:-}" ]; then
        $LOOM_SERVE_MPIRUN sh -c 'echo $$ >"$0.${OMPI_COMM_WORLD_RANK:-$PMI_RANK}"; exec "$@"' \
            "$log" "$LOOM" serve -m "$MODEL" --port 0 ${KEY:+--api-key "$KEY"} "$@" >"$log" 2>&1 &
        LAUNCHER=$!
    else
        "$LOOM" serve -m "$MODEL" --port 0 ${KEY:+--api-key "$KEY"} "$@" >"$log" 2>&1 &
        PID=$! LAUNCHER=$!
    fi
    port=
    for _ in $(seq 100); do
        port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9][0-9]*\).*/\1/p' "$log")
        [ -n "$port" ] && break
        sleep 0.1
    done
    [ -n "$port" ] || { fail "server did not start:"; cat "$log" >&2; finish; }
    [ -n "${LOOM_SERVE_MPIRUN:-}" ] && PID=$(cat "$log.0")
    URL=http://127.0.0.1:$port
}
post() { # PATH JSON [curl args]: prints the body, then the status on its own line
    p=$1 body=$2; shift 2
    curl -s -w '\n%{http_code}' -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
        "$@" --data-binary "$body" "$URL$p"
}
metric() { curl -s "$URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }
stop_server() { kill -TERM "$PID" 2>/dev/null; wait "$LAUNCHER" 2>/dev/null; }
