# tests/jinja.sh - loom's Jinja (api/jinja.c) against Debian's python3-jinja2 set up as
# transformers' apply_chat_template sets it up (tests/jinja_ref.py): every template below,
# with every conversation, rendered by `loom template` and by Python, byte for byte; a
# template Python refuses (raise_exception, a sandbox error) is refused by loom too. Then the
# spans that keep a message from forging control tokens, and hostile templates that must stop
# with an error, quickly.
#   templates: the fixtures' own (tokenizer_config.json), tests/templates/*.jinja (a tour of
#   the subset, tool calling, thinking), and with LOOM_TEMPLATES_DIR every *.jinja there (e.g.
#   llama.cpp's models/templates: not part of the suite, it is not in CI).
. "$top_srcdir/tests/lib.sh"
need_fixture "$FIXTURES/tiny-qwen2/tokenizer_config.json"
command -v python3 >/dev/null && python3 -c 'import jinja2' 2>/dev/null || {
    [ "${CI:-}" = true ] && { echo "FAIL: python3-jinja2 is missing (CI=true)" >&2; exit 1; }
    echo "SKIP: python3-jinja2 not installed (scripts/install-deps installs it)"; exit 77; }
REF="python3 $top_srcdir/tests/jinja_ref.py"
CONV=$top_srcdir/tests/templates/conversations

# the fixtures' templates, with the BOS/EOS text their folders give
for d in tiny-llama tiny-qwen2 tiny-chatglm3 tiny-mistral tiny-llama31; do
    cfg=$FIXTURES/$d/tokenizer_config.json
    need_fixture "$cfg"
    jq -j .chat_template "$cfg" >"$tmpdir/$d.jinja"
    jq -r '[.bos_token // "", .eos_token // ""] | map(if type == "object" then .content else . end)
           | .[]' "$cfg" >"$tmpdir/$d.tokens"
done

compared=0 differ=0
# compare TEMPLATE BOS EOS CONVERSATION [loom and python flags...]
compare() {
    t=$1 bos=$2 eos=$3 conv=$4; shift 4
    $REF "$t" "$CONV/$conv.json" --bos "$bos" --eos "$eos" "$@" >"$tmpdir/py.out" 2>"$tmpdir/py.err"
    prc=$?
    "$LOOM" template --template "$t" --messages "$CONV/$conv.json" --bos "$bos" --eos "$eos" "$@" \
        >"$tmpdir/loom.out" 2>"$tmpdir/loom.err"
    lrc=$?
    compared=$((compared + 1))
    what="$(basename "$t") with $conv${*:+ ($*)}"
    if [ $prc = 0 ] && [ $lrc = 0 ] && cmp -s "$tmpdir/py.out" "$tmpdir/loom.out"; then
        return
    elif [ $prc = 3 ] && [ $lrc = 1 ]; then # both refused: with the template's own words
        msg=$(sed -n 's/^ERROR: //p' "$tmpdir/py.err" | head -n1)
        if grep -qF -- "$msg" "$tmpdir/loom.err" || ! grep -q "refused" "$tmpdir/loom.err"; then
            return
        fi
    fi
    differ=$((differ + 1))
    fail "$what: python exit $prc, loom exit $lrc"
    sed 's/^/    python: /' "$tmpdir/py.err" >&2
    sed 's/^/    loom: /' "$tmpdir/loom.err" >&2
    [ $prc = 0 ] && [ $lrc = 0 ] && diff "$tmpdir/py.out" "$tmpdir/loom.out" | head -n 10 >&2
}

# compare_all TEMPLATE BOS EOS: the template with each conversation, with and without tools
compare_all() {
    for conv in plain system_multiturn unicode tool_calls thinking alternation_broken; do
        compare "$1" "$2" "$3" $conv --kwargs '{"date_string": "26 Jul 2024"}'
    done
    compare "$1" "$2" "$3" plain --tools "$CONV/tools.json"
    compare "$1" "$2" "$3" tool_calls --tools "$CONV/tools.json"
    compare "$1" "$2" "$3" tool_calls --tools "$CONV/tools.json" --no-generation-prompt
    compare "$1" "$2" "$3" thinking --kwargs '{"enable_thinking": false}'
}

for d in tiny-llama tiny-qwen2 tiny-chatglm3 tiny-mistral tiny-llama31; do
    compare_all "$tmpdir/$d.jinja" "$(sed -n 1p "$tmpdir/$d.tokens")" "$(sed -n 2p "$tmpdir/$d.tokens")"
done
for t in "$top_srcdir"/tests/templates/*.jinja; do
    compare_all "$t" "<s>" "</s>"
done
[ $differ = 0 ] && pass "$compared renders of $(ls "$top_srcdir"/tests/templates/*.jinja | wc -l) own and 5 fixture templates equal python3-jinja2's, byte for byte"
if [ -n "${LOOM_TEMPLATES_DIR:-}" ]; then
    before=$compared differ=0
    for t in "$LOOM_TEMPLATES_DIR"/*.jinja; do compare_all "$t" "<s>" "</s>"; done
    [ $differ = 0 ] && pass "$((compared - before)) renders of $(ls "$LOOM_TEMPLATES_DIR"/*.jinja | wc -l) templates in $LOOM_TEMPLATES_DIR equal python3-jinja2's"
fi

# a model's own template, read from its folder and from its GGUF; BOS from the file
"$LOOM" template -m "$FIXTURES/tiny-qwen2" --messages "$CONV/unicode.json" >"$tmpdir/q.out" 2>&1 &&
    $REF "$tmpdir/tiny-qwen2.jinja" "$CONV/unicode.json" >"$tmpdir/q.ref" &&
    cmp -s "$tmpdir/q.out" "$tmpdir/q.ref" && pass "loom template -m FOLDER renders the folder's template" ||
    fail "loom template -m tiny-qwen2: $(head -c 300 "$tmpdir/q.out")"
if [ -e "$FIXTURES/tiny-llama31/model.gguf" ]; then
    "$LOOM" template -m "$FIXTURES/tiny-llama31/model.gguf" --messages "$CONV/plain.json" \
        --kwargs '{"date_string": "26 Jul 2024"}' >"$tmpdir/l.out" 2>&1 &&
        $REF "$tmpdir/tiny-llama31.jinja" "$CONV/plain.json" --bos '<|begin_of_text|>' \
            --kwargs '{"date_string": "26 Jul 2024"}' >"$tmpdir/l.ref" &&
        cmp -s "$tmpdir/l.out" "$tmpdir/l.ref" &&
        pass "loom template -m GGUF: the file's template with the file's BOS text" ||
        fail "loom template -m tiny-llama31/model.gguf: $(head -c 300 "$tmpdir/l.out")"
fi

# spans: what a message said is marked as text, so "<|im_start|>system" typed by a user cannot
# become the control token; the template's own markers lie outside every span
"$LOOM" template -m "$FIXTURES/tiny-qwen2" --messages "$CONV/unicode.json" --json >"$tmpdir/s.json"
python3 - "$tmpdir/s.json" "$CONV/unicode.json" <<'PY' && pass "spans cover each message's text and none of the template's markers" || fail "spans"
import json, sys
out = json.load(open(sys.argv[1])); msgs = json.load(open(sys.argv[2]))
p = out["prompt"].encode(); spans = [p[a:b].decode() for a, b in out["spans"]]
assert all(m["content"] in spans for m in msgs), spans
covered = set(i for a, b in out["spans"] for i in range(a, b))
starts = [i for i in range(len(p)) if p.startswith(b"<|im_start|>", i)]
inside = [i for i in starts if i in covered]
assert len(inside) == 1, inside  # only the forged one, inside the user's text
PY

# hostile templates stop with an error naming the limit, in well under a second each
hostile() { # NAME TEMPLATE-TEXT EXPECTED-ERROR
    printf '%s' "$2" >"$tmpdir/h.jinja"
    start=$(date +%s%N)
    "$LOOM" template --template "$tmpdir/h.jinja" --messages "$CONV/plain.json" >/dev/null 2>"$tmpdir/h.err"
    rc=$? ms=$((($(date +%s%N) - start) / 1000000))
    if [ $rc != 0 ] && grep -q -- "$3" "$tmpdir/h.err" && [ $ms -lt 5000 ]; then
        pass "$1: refused in $ms ms ($(cut -c1-90 "$tmpdir/h.err"))"
    else
        fail "$1: exit $rc after $ms ms: $(cat "$tmpdir/h.err")"
    fi
}
hostile "a loop of 10^8" '{% for i in range(100000000) %}x{% endfor %}' "longer than the template may loop"
hostile "a macro calling itself" '{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}' "more than 200 deep"
hostile "doubling a string 60 times" \
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}" \
    "output passed\|memory"
hostile "a string times 10^11" "{{ 'a' * 100000000000 }}" "output limit"
hostile "nested loops of 10^9 turns" \
    '{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}{% endfor %}{% endfor %}' \
    "steps\|memory"
hostile "parentheses 10000 deep" "{{ $(printf '(%.0s' $(seq 10000))1$(printf ')%.0s' $(seq 10000)) }}" "200 deep"
hostile "an unclosed block" '{% for m in messages %}{{ m.content }}' "line 1: the template ends inside a block: 'endfor' is missing"
hostile "an unknown filter" '{{ messages | frobnicate }}' "'frobnicate' is not a filter"
hostile "a list changed in place" '{% set l = [] %}{{ l.append(1) }}' "cannot change a list"
hostile "reading a file" "{{ open('/etc/passwd') }}" "'open' is undefined"
hostile "Python internals" "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}" "no method\|undefined"
finish
