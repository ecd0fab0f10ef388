#!/bin/sh
# tests/fuzz/run.sh SRCDIR SECONDS [BUILDDIR] - builds the libFuzzer harnesses with clang (ASan
# + UBSan) and runs each for SECONDS, seeded from tests/fuzz/corpus/ and from the shared
# fixtures when they are there, as many at a time as there are cores. `make fuzz`; CI runs it
# when clang is present. A crash fails
# the run and leaves its input in ./fuzz-crashes/HARNESS/: add it to tests/fuzz/corpus/HARNESS/
# once fixed, so that every later run tries it first.
set -eu
src=${1:-.} seconds=${2:-60} build=${3:-.}
CLANG=${CLANG:-clang}
command -v "$CLANG" >/dev/null || { echo "make fuzz needs clang (apt-get install clang)"; exit 2; }
src=$(cd "$src" && pwd) build=$(cd "$build" && pwd)
fixtures=${LOOM_FIXTURES:-$src/../shared/fixtures}
work=$(mktemp -d "${TMPDIR:-/tmp}/loom-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
flags="-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I$src/include -I$src -I$build"
libs="$(pkg-config --libs libcjson libpcre2-8 libutf8proc libxxhash) -lm"
cflags="$(pkg-config --cflags libcjson libpcre2-8 libutf8proc libxxhash)"
core="$src/core/gguf.c $src/core/safetensors.c $src/core/tokenizer.c $src/core/tokenizer_bpe.c $src/core/tokenizer_spm.c $src/core/utf8.c $src/core/name_index.c $src/core/file.c"
harnesses="gguf safetensors tokenizer jinja grammar"
# the request parser tokenizes with a real model, and the chat templates ask the model
# families for their defaults: they link the built libloom
if [ -f "$build/.libs/libloom.so" ]; then harnesses="$harnesses chat_template openai_request"
else echo "fuzz: $build/.libs/libloom.so not built; chat_template and openai_request skipped"; fi
libloom="-L$build/.libs -Wl,-rpath,$build/.libs -lloom"
for h in $harnesses; do
    echo "fuzz: building fuzz_$h"
    case $h in
        chat_template) extra="$src/chat/chat.c $libloom" ;;
        openai_request) extra="$src/tools/openai_request.c $src/tools/openai_fields.c $src/tools/anthropic_request.c $src/tools/responses_request.c $libloom" ;;
        jinja) extra="$src/chat/jinja.c" ;;
        grammar) extra="$src/chat/grammar.c $src/chat/json_schema.c $src/chat/regex_gbnf.c $src/core/sampler.c $core" ;;
        *) extra=$core ;;
    esac
    # shellcheck disable=SC2086
    "$CLANG" $flags $cflags -o "$work/fuzz_$h" "$src/tests/fuzz/fuzz_$h.c" $extra $libs
    mkdir -p "$work/corpus_$h"
    [ -d "$src/tests/fuzz/corpus/$h" ] && cp "$src/tests/fuzz/corpus/$h"/* "$work/corpus_$h/"
done
# seeds: real files and texts, small enough to mutate
for f in "$src"/tests/structured_schemas/*.json; do
    jq -c '.[].schema' "$f" | while read -r schema; do
        printf '\001%s' "$schema" >"$work/corpus_grammar/$(printf '%s' "$schema" | cksum | cut -d' ' -f1)"
    done
done
printf '\000root ::= "{" ws (item ("," ws item)*)? "}"\nitem ::= [a-z]+ ws\nws ::= [ \\t\\n]{0,4}\n' >"$work/corpus_grammar/gbnf"
cp "$src"/tests/templates/*.jinja "$work/corpus_jinja/"
for d in tiny-llama tiny-qwen2 tiny-chatglm3 tiny-mistral tiny-llama31; do
    [ -f "$fixtures/$d/tokenizer_config.json" ] &&
        jq -j .chat_template "$fixtures/$d/tokenizer_config.json" >"$work/corpus_jinja/$d" 2>/dev/null
done
[ -f "$fixtures/stories260K/original/stories260K.gguf" ] && cp "$fixtures/stories260K/original/stories260K.gguf" "$work/corpus_gguf/"
[ -f "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" ] && head -c 65536 "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" > "$work/corpus_gguf/truncated-vocab"
[ -f "$fixtures/tiny-qwen2/model.safetensors" ] && cp "$fixtures/tiny-qwen2/model.safetensors" "$work/corpus_safetensors/"
for f in "$fixtures"/peers/llama.cpp/*.inp; do [ -f "$f" ] && split -l 3 "$f" "$work/corpus_tokenizer/$(basename "$f")-"; done
vocabs=""
[ -f "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" ] && vocabs="$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf"
[ -f "$fixtures/stories260K/original/stories260K.gguf" ] && vocabs="$vocabs${vocabs:+:}$fixtures/stories260K/original/stories260K.gguf"
# fuzz_one H: one harness for SECONDS; its verdict in $work/H.status, its crashes in
# $work/crashes_H/
fuzz_one() {
    mkdir -p "$work/crashes_$1"
    if LOOM_FUZZ_VOCABS=$vocabs LOOM_FUZZ_MODEL="$fixtures/stories260K/original/stories260K.gguf" \
         LOOM_BACKEND=ref LOOM_BACKEND_PATH="$build/backends/ref/.libs" \
         ASAN_OPTIONS=detect_leaks=0 "$work/fuzz_$1" -max_total_time="$seconds" -max_len=65536 \
         -timeout=10 -print_final_stats=1 -artifact_prefix="$work/crashes_$1/" "$work/corpus_$1" \
         2>"$work/$1.log"; then echo ok >"$work/$1.status"; else echo failed >"$work/$1.status"; fi
}
# as many harnesses at a time as there are cores (FUZZ_JOBS): each is one process
jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)} running=0 ran=""
for h in $harnesses; do
    if [ "$h" = tokenizer ] && [ -z "$vocabs" ]; then echo "fuzz: no vocabulary fixtures; tokenizer skipped"; continue; fi
    if [ "$h" = openai_request ] && [ ! -f "$fixtures/stories260K/original/stories260K.gguf" ]; then
        echo "fuzz: no stories260K fixture; openai_request skipped"; continue; fi
    echo "fuzz: fuzz_$h for ${seconds}s"
    fuzz_one "$h" &
    ran="$ran $h" running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then wait; running=0; fi
done
wait
status=0
for h in $ran; do
    if [ "$(cat "$work/$h.status" 2>/dev/null)" != ok ]; then
        status=1
        tail -40 "$work/$h.log"
        mkdir -p "fuzz-crashes/$h" && cp "$work/crashes_$h"/* "fuzz-crashes/$h/" 2>/dev/null || true
        echo "fuzz: fuzz_$h failed; its input is in fuzz-crashes/$h/"
    fi
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$work/$h.log" | sed "s/^/  $h /" || true
done
exit $status
