#!/bin/sh
# tests/distributed.sh - one model as a pipeline over the ranks of an MPI job (docs/DISTRIBUTED.md),
# Open MPI on loopback only:
#   - every fixture family (stories260K; tiny-llama, tiny-qwen2 and tiny-chatglm3 converted to
#     f32) over 2 and 3 ranks, neighbouring ranks on different backends (the best CPU variant
#     and ref), gives one process's 16 greedy tokens (the fixture's, up to a placeholder id)
#     and its logits within 1e-3 of their scale;
#   - each rank of a 2-rank run of a 160M model peaks at least a quarter of the file below what
#     one process holding every weight peaks at (it maps and touches only its own share);
#   - mistakes are named: a bad --layers, a rank that cannot open its file;
#   - a rank killed mid-generation ends the job within seconds, non-zero, naming the rank, and
#     a server's request in flight then gets an error response naming it;
#   - loom perplexity over 2 ranks gives one process's figure; loom bench measures the pipeline;
#   - tests/serve.sh passes with the server a pipeline over 2 ranks.
. "$top_srcdir/tests/lib.sh"
command -v jq >/dev/null || { echo "SKIP: jq not installed"; exit 77; }
if ! command -v mpirun >/dev/null || [ "${LOOM_BUILT_MPI:-no}" != yes ]; then
    if [ "${CI:-}" = true ]; then
        echo "FAIL: no MPI (mpirun: $(command -v mpirun || echo none), module built: ${LOOM_BUILT_MPI:-no}); CI installs Open MPI (scripts/install-deps)" >&2
        exit 1
    fi
    echo "SKIP: MPI not available (apt-get install libopenmpi-dev openmpi-bin, then configure)"
    exit 77
fi
root=; [ "$(id -u)" = 0 ] && root=--allow-run-as-root
# loopback only, and a bounded run: mpirun ends the job when a rank fails
MPIRUN_LOOPBACK="mpirun $root --oversubscribe --mca btl self,tcp --mca btl_tcp_if_include lo \
--mca oob_tcp_if_include lo"
MPIRUN="timeout 120 $MPIRUN_LOOPBACK"
# Under ASan (CI's last stage), no leak check in these processes: Open MPI frees little at exit,
# from components it has already unloaded, which no suppression can name. Leaks of the pipeline
# code itself are checked by tests/test_pipeline, which runs stages in one process.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
"$LOOM" backends --json >"$tmpdir/backends.json"
BEST=$(best_of "$tmpdir/backends.json")

# logits_close A B: the two float32 files agree within 1e-3 of the largest logit's size (ranks
# on different backends round differently; the greedy tokens are the exact check)
logits_close() {
    od -An -v -f "$1" | tr -s ' ' '\n' | sed '/^$/d' >"$tmpdir/a.txt"
    od -An -v -f "$2" | tr -s ' ' '\n' | sed '/^$/d' >"$tmpdir/b.txt"
    [ -s "$tmpdir/a.txt" ] && paste "$tmpdir/a.txt" "$tmpdir/b.txt" |
        awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d; if ($2 == "") bad = 1
               a = $1 < 0 ? -$1 : $1; if (a > big) big = a }
             END { printf "%g\n", m; exit (bad || m > 1e-3 * (1 + big)) }' >"$tmpdir/diff.txt"
}

check_family() { # LABEL MODEL FIXTURE_DIR
    label=$1 model=$2 fixture=$3
    ids=$(jq -r '.cases[0].prompt_ids | map(tostring) | join(",")' "$fixture/expected.json")
    n_layer=$(jq '.num_hidden_layers // .num_layers' "$fixture/config.json")
    args="run -m $model --prompt-ids $ids -n 16 --temp 0 --json"
    "$LOOM" $args --dump-logits "$tmpdir/one.f32" 2>/dev/null >"$tmpdir/one.json"
    # one process's greedy tokens: the fixture's (test_convert checks that) up to its first
    # placeholder id, which PyTorch may pick on a random model and loom never generates
    want=$(jq -c '.generated_ids' "$tmpdir/one.json")
    for np in 2 3; do
        # 2 ranks as planned by weight bytes; 3 as given: one layer, the rest, the head alone
        if [ $np = 2 ]; then
            $MPIRUN -np 1 -x LOOM_BACKEND="$BEST" "$LOOM" $args --dump-logits "$tmpdir/pp.f32" : \
                -np 1 -x LOOM_BACKEND=ref "$LOOM" $args >"$tmpdir/pp.json" 2>"$tmpdir/pp.err"
        else
            args="$args --layers 1,$((n_layer - 1)),0"
            $MPIRUN -np 1 -x LOOM_BACKEND="$BEST" "$LOOM" $args --dump-logits "$tmpdir/pp.f32" : \
                -np 1 -x LOOM_BACKEND=ref "$LOOM" $args : \
                -np 1 -x LOOM_BACKEND="$BEST" "$LOOM" $args >"$tmpdir/pp.json" 2>"$tmpdir/pp.err"
        fi
        rc=$?
        got=$(jq -c '.generated_ids' "$tmpdir/pp.json" 2>/dev/null)
        stages=$(jq -r '.backend' "$tmpdir/pp.json" 2>/dev/null | sed -E 's/ \(device [0-9]+: [^;]*\)//g')
        if [ $rc = 0 ] && [ "$got" = "$want" ] && [ "$(printf '%s' "$want" | jq length)" = 16 ] &&
            logits_close "$tmpdir/one.f32" "$tmpdir/pp.f32"; then
            pass "$label over $np ranks: one process's greedy tokens, logits within $(cat "$tmpdir/diff.txt") of one process ($stages)"
        else
            fail "$label over $np ranks: rc $rc, tokens $got (want $want), logits differ by $(cat "$tmpdir/diff.txt" 2>/dev/null)"
            sed 's/^/    /' "$tmpdir/pp.err" | tail -n 20 >&2
        fi
    done
}

STORIES=$FIXTURES/stories260K/original/stories260K.gguf
need_fixture "$STORIES"
check_family stories260K "$STORIES" "$FIXTURES/stories260K"
for f in tiny-llama tiny-qwen2 tiny-chatglm3; do
    need_fixture "$FIXTURES/$f/config.json"
    "$LOOM" convert "$FIXTURES/$f" -o "$tmpdir/$f.gguf" --type f32 --quiet ||
        { fail "converting $f"; continue; }
    check_family "$f" "$tmpdir/$f.gguf" "$FIXTURES/$f"
done

# ---- each rank holds its share: peak resident memory, one process against each of 2 ranks
"$LOOM" bench --synthetic 160m --type q8_0 --write "$tmpdir/160m.gguf" >/dev/null 2>&1 ||
    fail "writing the synthetic 160m model"
size_kb=$(($(wc -c <"$tmpdir/160m.gguf") / 1024))
/usr/bin/time -f 'peak %M' "$LOOM" run -m "$tmpdir/160m.gguf" --prompt-ids 1,2,3 -n 4 \
    >/dev/null 2>"$tmpdir/one.err"
one_kb=$(sed -n 's/^peak \([0-9]*\)$/\1/p' "$tmpdir/one.err")
# each rank's figure in its own file: mpirun may interleave pieces of the ranks' lines
$MPIRUN -np 2 sh -c 'exec /usr/bin/time -f "peak %M" -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' \
    "$tmpdir/peak" "$LOOM" run -m "$tmpdir/160m.gguf" --prompt-ids 1,2,3 -n 4 >/dev/null 2>&1
ranks_kb=$(cat "$tmpdir/peak.0" "$tmpdir/peak.1" 2>/dev/null | sed -n 's/^peak \([0-9]*\)$/\1/p' |
    tr '\n' ' ')
limit=$((one_kb - size_kb / 4))
ok=$([ -n "$one_kb" ] && [ "$(echo $ranks_kb | wc -w)" = 2 ] && echo yes)
for r in $ranks_kb; do [ "$r" -lt "$limit" ] || ok=; done
[ -n "$ok" ] && pass "peak resident KB: one process $one_kb, the 2 ranks $ranks_kb (file $size_kb KB)" ||
    fail "peak resident KB: one process ${one_kb:-?}, ranks ${ranks_kb:-?}; each rank should stay below $limit"

# ---- mistakes are named
$MPIRUN -np 2 "$LOOM" run -m "$STORIES" --prompt-ids 1 -n 1 --layers 5,1 >/dev/null 2>"$tmpdir/layers.err"
rc=$?
[ $rc != 0 ] && grep -q "layers '5,1' gives 6 layers; the model has 5" "$tmpdir/layers.err" &&
    pass "a wrong --layers is named (exit $rc)" || fail "--layers 5,1: rc $rc $(cat "$tmpdir/layers.err")"
$MPIRUN -np 1 "$LOOM" run -m "$STORIES" --prompt-ids 1 -n 1 : \
    -np 1 "$LOOM" run -m "$tmpdir/absent.gguf" --prompt-ids 1 -n 1 >/dev/null 2>"$tmpdir/absent.err"
rc=$?
[ $rc != 0 ] && grep -q "loom run: rank 1 on .*absent.gguf: No such file" "$tmpdir/absent.err" &&
    pass "rank 0 names the rank that cannot open its file (exit $rc)" ||
    fail "a rank without its file: rc $rc $(cat "$tmpdir/absent.err")"

LOOM_MPI_MODULE=$tmpdir/none.so $MPIRUN -np 2 -x LOOM_MPI_MODULE "$LOOM" run -m "$STORIES" \
    --prompt-ids 1 -n 1 >/dev/null 2>"$tmpdir/nomodule.err"
rc=$?
[ $rc != 0 ] && grep -q "loom run: LOOM_MPI_MODULE=$tmpdir/none.so: No such file" "$tmpdir/nomodule.err" &&
    pass "a missing MPI module is named (exit $rc)" ||
    fail "no MPI module: rc $rc $(cat "$tmpdir/nomodule.err")"
# each rank its own output file: mpirun interleaves the lines of ranks that share one
LOOM_DISTRIBUTED=0 $MPIRUN -np 2 -x LOOM_DISTRIBUTED sh -c 'exec "$@" >"$0.$OMPI_COMM_WORLD_RANK"' \
    "$tmpdir/alone" "$LOOM" run -m "$STORIES" --prompt-ids 1 -n 4 --temp 0 --json 2>/dev/null
[ "$(cat "$tmpdir/alone.0" "$tmpdir/alone.1" 2>/dev/null | jq -s 'map(.generated_ids | length) | add')" = 8 ] &&
    pass "LOOM_DISTRIBUTED=0: each rank runs alone" ||
    fail "LOOM_DISTRIBUTED=0: $(cat "$tmpdir/alone.0" "$tmpdir/alone.1" 2>&1)"

# ---- a rank that dies mid-generation ends the job, non-zero, within seconds
$MPIRUN -np 2 sh -c 'echo $$ >"$0.$OMPI_COMM_WORLD_RANK"; exec "$@"' "$tmpdir/pid" \
    "$LOOM" run -m "$tmpdir/160m.gguf" --prompt-ids 1,2,3 -n 2000 --temp 0 \
    >/dev/null 2>"$tmpdir/kill.err" &
launcher=$!
for _ in $(seq 300); do grep -q 'prompt tokens' "$tmpdir/kill.err" && break; sleep 0.1; done
sleep 1
kill -9 "$(cat "$tmpdir/pid.1")" 2>/dev/null
killed=$(date +%s)
wait $launcher
rc=$? took=$(($(date +%s) - killed))
[ $rc != 0 ] && [ $took -le 15 ] && grep -q 'rank 1' "$tmpdir/kill.err" &&
    pass "killing rank 1 mid-generation ends the job in ${took} s, exit $rc, naming rank 1" ||
    fail "killing rank 1: rc $rc after $took s: $(tail -n 8 "$tmpdir/kill.err")"

# ---- a request in flight when a rank dies gets an error response naming the rank
$MPIRUN -np 2 sh -c 'echo $$ >"$0.$OMPI_COMM_WORLD_RANK"; exec "$@"' "$tmpdir/spid" \
    "$LOOM" serve -m "$tmpdir/160m.gguf" --port 0 --model-name m >"$tmpdir/dead.log" 2>&1 &
launcher=$!
port=
for _ in $(seq 300); do
    port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9][0-9]*\).*/\1/p' "$tmpdir/dead.log")
    [ -n "$port" ] && break
    sleep 0.1
done
curl -s -m 60 -o "$tmpdir/dead.json" -w '%{http_code}' "http://127.0.0.1:${port:-1}/v1/completions" \
    -d '{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": true}' \
    >"$tmpdir/dead.code" 2>/dev/null &
client=$!
# kill rank 1 once the request is generating (bounded wait: 30 s)
for _ in $(seq 300); do
    curl -s "http://127.0.0.1:${port:-1}/metrics" | grep -q '^loom_generated_tokens_total [1-9]' && break
    sleep 0.1
done
kill -9 "$(cat "$tmpdir/spid.1")" 2>/dev/null
wait $client
wait $launcher
rc=$? code=$(cat "$tmpdir/dead.code" 2>/dev/null) msg=$(jq -r '.error.message' "$tmpdir/dead.json" 2>/dev/null)
[ $rc != 0 ] && [ "${code:-0}" -ge 500 ] && echo "$msg" | grep -q 'rank 1 stopped' &&
    pass "a request in flight when rank 1 dies gets $code: $msg; the job exits $rc" ||
    fail "rank 1 killed under a request: job rc $rc, HTTP ${code:-none}, body $(cat "$tmpdir/dead.json" 2>/dev/null); $(tail -n 5 "$tmpdir/dead.log")"

# ---- loom perplexity and loom bench join the job
TEXT=$FIXTURES/peers/llama2.c/expected_stdout_stories260K_t0_n200.txt
need_fixture "$TEXT"
ppl_args="perplexity -m $STORIES -f $TEXT -c 32 --chunks 3 --json --quiet"
one=$("$LOOM" $ppl_args 2>/dev/null | jq -r '.ppl')
$MPIRUN -np 1 -x LOOM_BACKEND="$BEST" "$LOOM" $ppl_args : -np 1 -x LOOM_BACKEND=ref "$LOOM" $ppl_args \
    >"$tmpdir/ppl.json" 2>"$tmpdir/ppl.err"
rc=$? two=$(jq -r '.ppl' "$tmpdir/ppl.json" 2>/dev/null)
if [ $rc = 0 ] && awk -v a="$one" -v b="$two" 'BEGIN {d = a - b; exit !(a > 1 && (d < 0 ? -d : d) <= 1e-4 * a)}'; then
    pass "loom perplexity over 2 ranks: $two, one process $one"
else
    fail "loom perplexity over 2 ranks: rc $rc, $two against one process's $one: $(tail -n 5 "$tmpdir/ppl.err")"
fi
$MPIRUN -np 2 "$LOOM" perplexity -m "$STORIES" -f "$TEXT" -c 32 --backends all >/dev/null 2>"$tmpdir/pplb.err"
rc=$?
[ $rc = 2 ] && grep -q 'cannot join this MPI job' "$tmpdir/pplb.err" &&
    pass "perplexity --backends under mpirun is refused, saying why (exit 2)" ||
    fail "perplexity --backends under mpirun: rc $rc $(cat "$tmpdir/pplb.err")"
$MPIRUN -np 2 "$LOOM" bench -m "$STORIES" -p 16 -n 8 -r 1 --json >"$tmpdir/bench.json" 2>"$tmpdir/bench.err"
rc=$?
tests=$(jq -r '[.results[] | select(.variant == "pipeline" and (.error | not) and .tokens_per_s > 0) | .test] | join(",")' \
    "$tmpdir/bench.json" 2>/dev/null)
stages=$(jq -r '.results[0].backend' "$tmpdir/bench.json" 2>/dev/null | grep -o 'rank [0-9]' | wc -l)
[ $rc = 0 ] && [ "$tests" = "pp16,tg8" ] && [ "$stages" = 2 ] &&
    pass "loom bench over 2 ranks measures the pipeline ($tests)" ||
    fail "loom bench over 2 ranks: rc $rc, tests '$tests', $stages ranks named: $(tail -n 5 "$tmpdir/bench.err")"

# ---- the serving tests, with the server a pipeline over 2 ranks: one server runs most of
# serve.sh (81 s on 2 cores, several times that under ASan), so its bound is wider
if LOOM_SERVE_MPIRUN="timeout 900 $MPIRUN_LOOPBACK -np 2" $SHELL "$top_srcdir/tests/serve.sh" >"$tmpdir/serve.out" 2>&1; then
    pass "tests/serve.sh over 2 ranks ($(grep -c '^ok:' "$tmpdir/serve.out") checks)"
else
    fail "tests/serve.sh over 2 ranks:"; grep -v '^ok:' "$tmpdir/serve.out" | tail -n 30 >&2
fi
finish
