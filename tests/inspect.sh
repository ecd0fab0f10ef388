# tests/inspect.sh - `loom inspect` on the real stories260K.gguf and on broken copies of it.
. "$top_srcdir/tests/lib.sh"
gguf="$FIXTURES/stories260K/original/stories260K.gguf"
need_fixture "$gguf"

"$LOOM" inspect "$gguf" > "$tmpdir/out.txt" 2>&1 || fail "inspect exit $?"
expect_grep "^architecture: llama" "$tmpdir/out.txt" "architecture"
expect_grep "llama.block_count  *5" "$tmpdir/out.txt" "hyper-parameters"
expect_grep "tokenizer.ggml.tokens  *\[512 x string\]" "$tmpdir/out.txt" "tokenizer summary"
expect_grep "blk.4.ffn_down.weight  *64 x 172  *f32  *44032" "$tmpdir/out.txt" "tensor line"
expect_grep "all inside the file" "$tmpdir/out.txt" "data check"

"$LOOM" inspect --json "$gguf" > "$tmpdir/out.json" || fail "inspect --json exit $?"
jq -e '.architecture == "llama" and (.tensors | length) == 48 and .metadata["llama.embedding_length"] == 64
       and ([.tensors[] | .bytes] | add) == .tensor_bytes' "$tmpdir/out.json" > /dev/null &&
    pass "json" || fail "json report"

# a Hugging Face folder is inspected through its in-memory conversion
"$LOOM" inspect --json "$FIXTURES/tiny-chatglm3" > "$tmpdir/glm.json" 2> /dev/null || fail "inspect a folder: exit $?"
jq -e '.architecture == "chatglm" and .metadata["chatglm.block_count"] == 2
       and .metadata["tokenizer.loom.stop_token_ids"].length == 3
       and .metadata["tokenizer.loom.prefix_tokens"].length == 2' "$tmpdir/glm.json" > /dev/null &&
    pass "inspect a ChatGLM3 folder: architecture, stop and prefix tokens" || fail "folder inspect json"

head -c 1000000 "$gguf" > "$tmpdir/cut.gguf"
"$LOOM" inspect "$tmpdir/cut.gguf" > /dev/null 2> "$tmpdir/err.txt"
[ $? -eq 2 ] && pass "truncated: exit 2" || fail "truncated file: want exit 2"
expect_grep "truncated (an incomplete download?)" "$tmpdir/err.txt" "truncation named"

printf 'not a model' > "$tmpdir/text.gguf"
"$LOOM" inspect "$tmpdir/text.gguf" > /dev/null 2> "$tmpdir/err.txt"
[ $? -eq 2 ] && pass "text file: exit 2" || fail "text file: want exit 2"
expect_grep "not a GGUF file" "$tmpdir/err.txt" "wrong magic named"
"$LOOM" inspect > /dev/null 2> "$tmpdir/err.txt"
[ $? -eq 2 ] && pass "no file: exit 2" || fail "no file: want exit 2"
finish
