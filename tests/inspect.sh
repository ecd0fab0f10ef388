# tests/inspect.sh - `loom inspect` on a file loom wrote (its synthetic tiny model), on the real
# stories260K.gguf llama.cpp wrote (a fixture), on a Hugging Face folder (a fixture) and on broken
# copies.
. "$top_srcdir/tests/lib.sh"
tiny=$(suite_model tiny)
"$LOOM" inspect "$tiny" > "$tmpdir/tiny.txt" 2>&1 || fail "inspect exit $?"
expect_grep "^architecture: llama" "$tmpdir/tiny.txt" "architecture"
expect_grep "llama.block_count  *2" "$tmpdir/tiny.txt" "hyper-parameters"
expect_grep "tokenizer.ggml.tokens  *\[512 x string\]" "$tmpdir/tiny.txt" "tokenizer summary"
expect_grep "blk.1.ffn_down.weight  *64 x 192  *f32  *49152" "$tmpdir/tiny.txt" "tensor line"
expect_grep "all inside the file" "$tmpdir/tiny.txt" "data check"
"$LOOM" inspect --json "$tiny" > "$tmpdir/tiny.json" || fail "inspect --json exit $?"
jq -e '.architecture == "llama" and (.tensors | length) == 21 and .metadata["llama.embedding_length"] == 64
       and ([.tensors[] | .bytes] | add) == .tensor_bytes' "$tmpdir/tiny.json" > /dev/null &&
    pass "json: 21 tensors (3 + 2 layers of 9), their bytes summed" || fail "json report"

gguf="$FIXTURES/stories260K/original/stories260K.gguf"
if have_fixture "$gguf" "inspecting the GGUF llama.cpp wrote"; then
"$LOOM" inspect "$gguf" > "$tmpdir/out.txt" 2>&1 || fail "inspect exit $?"
expect_grep "llama.block_count  *5" "$tmpdir/out.txt" "hyper-parameters"
expect_grep "blk.4.ffn_down.weight  *64 x 172  *f32  *44032" "$tmpdir/out.txt" "tensor line"
"$LOOM" inspect --json "$gguf" > "$tmpdir/out.json" || fail "inspect --json exit $?"
jq -e '.architecture == "llama" and (.tensors | length) == 48 and .metadata["llama.embedding_length"] == 64
       and ([.tensors[] | .bytes] | add) == .tensor_bytes' "$tmpdir/out.json" > /dev/null &&
    pass "json" || fail "json report"
fi

# a Hugging Face folder is inspected through its in-memory conversion
if have_fixture "$FIXTURES/tiny-chatglm3/config.json" "inspecting a Hugging Face folder"; then
"$LOOM" inspect --json "$FIXTURES/tiny-chatglm3" > "$tmpdir/glm.json" 2> /dev/null || fail "inspect a folder: exit $?"
jq -e '.architecture == "chatglm" and .metadata["chatglm.block_count"] == 2
       and .metadata["tokenizer.loom.stop_token_ids"].length == 3
       and .metadata["tokenizer.loom.prefix_tokens"].length == 2' "$tmpdir/glm.json" > /dev/null &&
    pass "inspect a ChatGLM3 folder: architecture, stop and prefix tokens" || fail "folder inspect json"
fi

head -c 600000 "$tiny" > "$tmpdir/cut.gguf"
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
