#!/bin/sh
# tests/fuzz/run.sh SRCDIR SECONDS - builds the libFuzzer harnesses with clang (ASan + UBSan)
# and runs each for SECONDS, seeded from the shared fixtures when they are there. `make fuzz`.
# Crashes are left as crash-* files in the working directory, with the input that caused them.
set -eu
src=${1:-.} seconds=${2:-60}
CLANG=${CLANG:-clang}
command -v "$CLANG" >/dev/null || { echo "make fuzz needs clang (apt-get install clang)"; exit 2; }
fixtures=${LOOM_FIXTURES:-$src/../shared/fixtures}
work=$(mktemp -d "${TMPDIR:-/tmp}/loom-fuzz.XXXXXX")
flags="-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I$src/include -I$src"
libs="$(pkg-config --libs libcjson libpcre2-8 libutf8proc) -lm"
cflags="$(pkg-config --cflags libcjson libpcre2-8 libutf8proc)"
core="$src/core/gguf.c $src/core/safetensors.c $src/core/tokenizer.c"
for h in gguf safetensors tokenizer; do
    echo "fuzz: building fuzz_$h"
    # shellcheck disable=SC2086
    "$CLANG" $flags $cflags -o "$work/fuzz_$h" "$src/tests/fuzz/fuzz_$h.c" $core $libs
    mkdir -p "$work/corpus_$h"
done
# seeds: real files and texts, small enough to mutate
[ -f "$fixtures/stories260K/original/stories260K.gguf" ] && cp "$fixtures/stories260K/original/stories260K.gguf" "$work/corpus_gguf/"
[ -f "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" ] && head -c 65536 "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" > "$work/corpus_gguf/truncated-vocab"
[ -f "$fixtures/tiny-qwen2/model.safetensors" ] && cp "$fixtures/tiny-qwen2/model.safetensors" "$work/corpus_safetensors/"
for f in "$fixtures"/peers/llama.cpp/*.inp; do [ -f "$f" ] && split -l 3 "$f" "$work/corpus_tokenizer/$(basename "$f")-"; done
vocabs=""
[ -f "$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf" ] && vocabs="$fixtures/peers/llama.cpp/ggml-vocab-llama-spm.gguf"
[ -f "$fixtures/stories260K/original/stories260K.gguf" ] && vocabs="$vocabs${vocabs:+:}$fixtures/stories260K/original/stories260K.gguf"
status=0
for h in gguf safetensors tokenizer; do
    if [ "$h" = tokenizer ] && [ -z "$vocabs" ]; then echo "fuzz: no vocabulary fixtures; tokenizer skipped"; continue; fi
    echo "fuzz: fuzz_$h for ${seconds}s"
    LOOM_FUZZ_VOCABS=$vocabs "$work/fuzz_$h" -max_total_time="$seconds" -max_len=65536 -timeout=10 \
        -print_final_stats=1 "$work/corpus_$h" 2>"$work/$h.log" || { status=1; tail -40 "$work/$h.log"; }
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$work/$h.log" | sed "s/^/  $h /" || true
done
rm -rf "$work"
exit $status
