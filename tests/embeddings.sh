# tests/embeddings.sh - /v1/embeddings in loom serve, against PyTorch: an embedding is the final
# hidden state (after the model's final norm), so the model's own head applied to it (read here
# from model.safetensors, in Python) gives the PyTorch reference's logits of that position, for
# Llama, Qwen2 (tied head) and ChatGLM3 folders and the stories260K GGUF. Mean pooling equals the
# mean of the last-token embeddings of every prefix (a causal model's hidden state at a position
# is the last one of its prefix); normalised ones have length one; text and token ids, float and
# base64, a list in one request all agree; what a client gets wrong is a 400 naming it. The
# PyTorch comparisons need the fixtures; the rest runs on loom's synthetic tiny model.
. "$top_srcdir/tests/lib.sh"
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
KEY=test-key

# head_check FIXTURE-DIR HEAD-TENSOR RESPONSE: the head times the embedding against the case's
# PyTorch logits; prints the largest difference, fails past 2e-3
head_check() {
    python3 - "$1" "$2" "$3" <<'PY'
import array, json, struct, sys
folder, head, resp = sys.argv[1:]
def tensor(path, name):
    f = open(path, "rb"); n = struct.unpack("<Q", f.read(8))[0]; hdr = json.loads(f.read(n))
    t = hdr[name]; a, b = t["data_offsets"]; f.seek(8 + n + a); raw = f.read(b - a)
    if t["dtype"] == "F32":
        return array.array("f", raw), t["shape"]
    if t["dtype"] == "F16":
        return array.array("f", struct.unpack("<%de" % (len(raw) // 2), raw)), t["shape"]
    wide = bytearray(len(raw) * 2); wide[2::4] = raw[0::2]; wide[3::4] = raw[1::2]  # BF16
    return array.array("f", bytes(wide)), t["shape"]
w, (n_vocab, n_embd) = tensor(folder + "/model.safetensors", head)
h = json.load(open(resp))["data"][0]["embedding"]
assert len(h) == n_embd, (len(h), n_embd)
case = json.load(open(folder + "/expected.json"))["cases"][0]
want = array.array("f", open(folder + "/" + case["last_logits"]["file"], "rb").read())
worst = max(abs(sum(map(float.__mul__, w[v * n_embd:(v + 1) * n_embd], h)) - want[v]) for v in range(n_vocab))
print("%.2g" % worst)
sys.exit(worst > 2e-3)
PY
}
ids_of() { jq -c '.cases[0].prompt_ids' "$1/expected.json"; }

families=
have_fixture "$FIXTURES/tiny-llama/expected.json" "the embeddings against PyTorch's logits" &&
    families="tiny-llama:lm_head.weight tiny-qwen2:model.embed_tokens.weight
        tiny-chatglm3:transformer.output_layer.weight stories260K:model.embed_tokens.weight"
. "$top_srcdir/tests/serve_lib.sh"
for fx in $families; do
    fx=$(echo "$fx" | tr : ' ')
    set -- $fx
    dir=$FIXTURES/$1 MODEL=$FIXTURES/$1
    [ "$1" = stories260K ] && MODEL=$dir/original/stories260K.gguf
    # the reference backend computes in f32 as PyTorch does (a bf16 kernel may round the
    # activations: that is the backend's precision, not what an embedding is)
    LOOM_BACKEND=ref start_server "$tmpdir/s.log" -c 256 --kv-type f32 --model-name m
    post /v1/embeddings "{\"model\": \"m\", \"input\": $(ids_of "$dir"), \"normalize\": false}" |
        sed '$d' >"$tmpdir/raw-$1.json"
    got=$(head_check "$dir" "$2" "$tmpdir/raw-$1.json") &&
        pass "$1 ($(basename "$MODEL")): its head on the embedding gives PyTorch's last logits (within $got)" ||
        fail "$1: the head on the embedding is off PyTorch's logits by $got: $(head -c 300 "$tmpdir/raw-$1.json")"
    post /v1/embeddings "{\"model\": \"m\", \"input\": $(ids_of "$dir")}" | sed '$d' >"$tmpdir/unit.json"
    jq -e -s '(.[0].data[0].embedding) as $r | (.[1].data[0].embedding) as $u |
        ([$r[] | . * .] | add | sqrt) as $n | ([$u[] | . * .] | add) as $len |
        ($len - 1 | fabs) < 1e-5 and ([range($r | length) | ($r[.] / $n - $u[.]) | fabs] | max) < 1e-6' \
        "$tmpdir/raw-$1.json" "$tmpdir/unit.json" >/dev/null &&
        pass "$1: by default the embedding is the same scaled to length one" ||
        fail "$1: normalised embedding: $(head -c 300 "$tmpdir/unit.json")"
    stop_server
done

MODEL=$(suite_model tiny)
# on ref: the CPU variants' bf16 kernels round activations to bf16 once a step is wide enough,
# so an input's floats would depend on what shared its step (1e-2 here, more than the 1e-4
# these checks of the pooling arithmetic allow)
LOOM_BACKEND=ref start_server "$tmpdir/s.log" -c 256 --kv-type f32 --model-name m
text='"Hello! My name is Loom and I can count: 1, 2, 3."'
ids=$("$LOOM" tokenize -m "$MODEL" --json "$(echo "$text" | jq -r .)")
post /v1/embeddings "{\"model\": \"m\", \"input\": $ids, \"normalize\": false}" | sed '$d' >"$tmpdir/alone.json"
# mean pooling: every prefix's last-token embedding, in one
# request (its inputs run in the batch side by side), averaged, is the whole input's mean
prefixes=$(echo "$ids" | jq -c '[range(1; length + 1) as $k | .[:$k]]')
post /v1/embeddings "{\"model\": \"m\", \"input\": $prefixes, \"normalize\": false}" | sed '$d' >"$tmpdir/prefixes.json"
post /v1/embeddings "{\"model\": \"m\", \"input\": $ids, \"normalize\": false, \"pooling\": \"mean\"}" |
    sed '$d' >"$tmpdir/mean.json"
jq -e -s --argjson n "$(echo "$ids" | jq length)" '(.[0].data | map(.embedding)) as $p |
    (.[1].data[0].embedding) as $m | ($p | length) == $n and ([.[0].data[].index] == [range($n)]) and
    ([range($m | length) as $d | ([$p[][$d]] | add / $n) - $m[$d] | fabs] | max) < 1e-4 and
    .[0].usage.prompt_tokens == ($n * ($n + 1) / 2)' "$tmpdir/prefixes.json" "$tmpdir/mean.json" >/dev/null &&
    pass "mean pooling is the mean of the $(echo "$ids" | jq length) prefixes' last-token embeddings (one request of that many inputs)" ||
    fail "mean pooling: $(head -c 300 "$tmpdir/mean.json") / $(head -c 200 "$tmpdir/prefixes.json")"
# the last prefix in that batch is the whole input alone
jq -e -s '(.[0].data[-1].embedding) as $a | (.[1].data[0].embedding) as $b |
    [range($a | length) | ($a[.] - $b[.]) | fabs] | max < 1e-4' "$tmpdir/prefixes.json" "$tmpdir/alone.json" >/dev/null &&
    pass "an input run in a batch of many gives what it gives alone" || fail "batched input differs from alone"
# text is tokenized as a completion's prompt is; base64 carries the same floats
post /v1/embeddings "{\"model\": \"m\", \"input\": [$text], \"normalize\": false, \"encoding_format\": \"base64\"}" |
    sed '$d' >"$tmpdir/b64.json"
python3 - "$tmpdir/b64.json" "$tmpdir/alone.json" <<'PY' && pass "text input, base64: the same floats as the token ids' float answer" || fail "base64/text: $(head -c 300 "$tmpdir/b64.json")"
import array, base64, json, sys
b = json.load(open(sys.argv[1])); f = json.load(open(sys.argv[2]))
got = array.array("f", base64.b64decode(b["data"][0]["embedding"]))
want = f["data"][0]["embedding"]
assert len(got) == len(want) and max(abs(x - y) for x, y in zip(got, want)) < 1e-6, (got[:4], want[:4])
assert b["usage"]["prompt_tokens"] == f["usage"]["prompt_tokens"] and b["object"] == "list" and b["model"] == "m"
PY
# the whole context may be input (no token is generated); one more is refused
long=$(jq -cn '[range(256) | 100 + .]')
got=$(post /v1/embeddings "{\"model\": \"m\", \"input\": $long}" | tail -n1)
[ "$got" = 200 ] && pass "an input of the whole context (256 tokens) is embedded" || fail "256-token input: $got"
bad() { # WHAT BODY-MEMBERS PARAM TEXT [STATUS]
    post /v1/embeddings "{\"model\": \"m\", $2}" >"$tmpdir/e.out"
    got=$(sed '$d' "$tmpdir/e.out" | jq -r '"\(.error.param): \(.error.message)"')
    [ "$(tail -n1 "$tmpdir/e.out")" = "${5:-400}" ] && case "$got" in "$3: "*"$4"*) true;; *) false;; esac &&
        pass "$1: ${5:-400} '$got'" || fail "$1: $(cat "$tmpdir/e.out")"
}
bad "no input" '"encoding_format": "float"' input "Missing required parameter"
bad "an empty list" '"input": []' input "empty array"
bad "an empty string" '"input": ["a", ""]' "input[1]" "empty string"
bad "an empty id list" '"input": [[1], []]' "input[1]" "gives no tokens"
bad "an id outside the vocabulary" '"input": [5, 512]' input "from 0 to 511"
bad "a mixed list" '"input": ["a", 3]' "input[1]" "is a number"
bad "too long" "\"input\": [[1], $(jq -cn '[range(257) | 100 + .]')]" "input[1]" "maximum context length is 256"
bad "another dimension" '"input": "a", "dimensions": 12' dimensions "have 64 dimensions"
bad "a pooling loom lacks" '"input": "a", "pooling": "cls"' pooling "'last'"
bad "an encoding loom lacks" '"input": "a", "encoding_format": "int8"' encoding_format "'float' or 'base64'"
bad "an unknown field" '"input": "a", "truncate": 3' truncate "Unrecognized"
post /v1/embeddings '{"model": "other", "input": "a"}' | tail -n1 | grep -qx 404 &&
    pass "another model's name: 404" || fail "another model's name was not a 404"
stop_server

# an answer's size is bounded: 2048 one-token inputs to a 4160-wide model (a synthetic one) would
# be 8.5 million numbers (~100 MB of JSON for an 8 kB request); 2^22 is the most, and the 400
# says how many inputs fit
"$LOOM" bench --synthetic wide --type q8_0 --write "$tmpdir/wide.gguf" >/dev/null 2>&1 ||
    fail "writing the synthetic wide model"
MODEL=$tmpdir/wide.gguf
start_server "$tmpdir/wide.log" -c 256 --model-name m
many=$(jq -cn '[range(2048) | [5]]')
bad "2048 inputs of 4160 numbers each" "\"input\": $many" input "at most 1008 inputs a request"
few=$(jq -cn '[range(4) | [5]]')
got=$(post /v1/embeddings "{\"model\": \"m\", \"input\": $few}" | sed '$d' | jq '[.data[].embedding | length] | unique')
[ "$got" = "$(printf '[\n  4160\n]')" ] && pass "4 inputs of that model: 4160 numbers each" ||
    fail "the wide model's embeddings: $got"
stop_server
finish
