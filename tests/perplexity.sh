# tests/perplexity.sh - loom perplexity on stories260K: its figure equals the one worked out by
# hand from `loom run --dump-logits` (llama.cpp's method: chunks from a fresh context starting
# with BOS, the second half of each scored); KL divergence against itself is zero and against a
# q4_0 copy is not; every usable backend gives the same figure; wrong input is named.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH

model="$FIXTURES/stories260K/original/stories260K.gguf"
text="$FIXTURES/peers/llama2.c/expected_stdout_stories260K_t0_n200.txt"
need_fixture "$model"
need_fixture "$text"

# ---- the figure, by hand: chunks of 16, positions 8..14 of each predict 9..15
ctx=16
"$LOOM" perplexity -m "$model" -f "$text" -c $ctx --chunks 2 --json > "$tmpdir/ppl.json" 2> "$tmpdir/ppl.err" ||
    { fail "loom perplexity: exit $?"; cat "$tmpdir/ppl.err" >&2; finish; }
"$LOOM" tokenize -m "$model" --json -f "$text" | jq -r '.[]' > "$tmpdir/ids.txt"
: > "$tmpdir/nll.txt"
for c in 0 1; do
    for j in $(seq $((ctx / 2)) $((ctx - 2))); do
        # the chunk's tokens 0..j, the first one BOS (1), and the token that follows
        prompt=$(sed -n "$((c * ctx + 1)),$((c * ctx + j + 1))p" "$tmpdir/ids.txt" |
                 awk 'NR == 1 {printf "1"; next} {printf ",%s", $1}')
        next_id=$(sed -n "$((c * ctx + j + 2))p" "$tmpdir/ids.txt")
        "$LOOM" run -m "$model" --prompt-ids "$prompt" -n 0 --dump-logits "$tmpdir/l.f32" \
            > /dev/null 2>&1 || fail "loom run --dump-logits (chunk $c, position $j)"
        od -An -f -v "$tmpdir/l.f32" | tr -s ' ' '\n' | grep -v '^$' |
            awk -v t="$next_id" '{x[NR - 1] = $1; if (NR == 1 || $1 > mx) mx = $1}
                END {for (i in x) s += exp(x[i] - mx); print -(x[t] - mx - log(s))}' >> "$tmpdir/nll.txt"
    done
done
want=$(awk '{s += $1} END {printf "%.6f", exp(s / NR)}' "$tmpdir/nll.txt")
got=$(jq -r '.ppl' "$tmpdir/ppl.json")
awk -v a="$got" -v b="$want" 'BEGIN {exit !(b > 0 && (a / b - 1) ^ 2 < 1e-6)}' &&
    pass "PPL $got equals the figure worked out position by position ($want)" ||
    fail "PPL $got, by hand $want"
[ "$(jq -r '.scored' "$tmpdir/ppl.json")" = 14 ] && pass "14 positions scored (7 per chunk)" ||
    fail "scored: $(jq -r .scored "$tmpdir/ppl.json")"

# ---- KL divergence: against itself nothing, against q4_0 something
"$LOOM" perplexity -m "$model" -f "$text" -c 32 --save-logits "$tmpdir/base.kld" --quiet > /dev/null ||
    fail "--save-logits: exit $?"
"$LOOM" perplexity -m "$model" -f "$text" -c 32 --kl-base "$tmpdir/base.kld" --json > "$tmpdir/self.json" ||
    fail "--kl-base: exit $?"
jq -e '.kl_base.kld_mean < 1e-6 and .kl_base.same_top == 1 and (.kl_base.ppl_ratio - 1 | fabs) < 1e-6' \
    "$tmpdir/self.json" > /dev/null && pass "KL divergence of a model against itself: 0, same top token everywhere" ||
    { fail "self KLD:"; cat "$tmpdir/self.json" >&2; }
"$LOOM" quantize "$model" "$tmpdir/q4.gguf" --type q4_0 --quiet > /dev/null 2>&1 || fail "quantize q4_0"
"$LOOM" perplexity -m "$tmpdir/q4.gguf" -f "$text" -c 32 --kl-base "$tmpdir/base.kld" --json > "$tmpdir/q4.json" ||
    fail "--kl-base q4_0: exit $?"
jq -e '.kl_base.kld_mean > 0.001 and .kl_base.same_top < 1' "$tmpdir/q4.json" > /dev/null &&
    pass "q4_0 against f32: KLD $(jq -r '.kl_base.kld_mean' "$tmpdir/q4.json"), same top token $(jq -r '.kl_base.same_top' "$tmpdir/q4.json")" ||
    { fail "q4 KLD:"; cat "$tmpdir/q4.json" >&2; }
# a base keeping only the top 8 logits: the rest is one bucket, so the KLD is a lower bound
"$LOOM" perplexity -m "$model" -f "$text" -c 32 --save-logits "$tmpdir/top8.kld" --kl-top 8 --quiet > /dev/null ||
    fail "--kl-top 8: exit $?"
"$LOOM" perplexity -m "$tmpdir/q4.gguf" -f "$text" -c 32 --kl-base "$tmpdir/top8.kld" --json > "$tmpdir/q4top8.json" ||
    fail "--kl-base (top 8): exit $?"
jq -e --slurpfile full "$tmpdir/q4.json" '.kl_base.kld_exact == false and $full[0].kl_base.kld_exact == true
        and .kl_base.kld_mean > 0 and .kl_base.kld_mean <= $full[0].kl_base.kld_mean
        and .kl_base.same_top == $full[0].kl_base.same_top' "$tmpdir/q4top8.json" > /dev/null &&
    pass "a top-8 base gives a lower bound ($(jq -r .kl_base.kld_mean "$tmpdir/q4top8.json")) of the exact KLD" ||
    { fail "top-8 KLD is no lower bound:"; cat "$tmpdir/q4top8.json" >&2; }
"$LOOM" perplexity -m "$tmpdir/q4.gguf" -f "$text" -c 16 --kl-base "$tmpdir/base.kld" > /dev/null 2> "$tmpdir/e1" &&
    fail "a base from another -c accepted"
expect_grep "was saved from another run" "$tmpdir/e1" "a base from another run is refused, saying why"

# ---- every usable backend, side by side: the same figure
"$LOOM" perplexity -m "$model" -f "$text" -c 32 --backends all > "$tmpdir/side.txt" 2> "$tmpdir/side.err" ||
    { fail "--backends all: exit $?"; cat "$tmpdir/side.txt" "$tmpdir/side.err" >&2; }
rows=$(grep '^| [a-z]' "$tmpdir/side.txt" | grep -vc '^| backend')
spread=$(awk -F'|' '/^\| [a-z]/ && $3 + 0 > 0 {v = $3 + 0; if (!n++ || v < lo) lo = v; if (v > hi) hi = v}
                    END {print (n ? hi / lo - 1 : 1)}' "$tmpdir/side.txt")
[ "$rows" -ge 2 ] && awk -v s="$spread" 'BEGIN {exit !(s < 0.005)}' &&
    pass "$rows backends side by side, within $(awk -v s="$spread" 'BEGIN {printf "%.4f%%", 100 * s}') of each other" ||
    { fail "backends side by side ($rows rows, spread $spread):"; cat "$tmpdir/side.txt" >&2; }
grep -q "^| ref" "$tmpdir/side.txt" && pass "ref is among them" || fail "ref missing from --backends all"

# ---- what a user can get wrong
"$LOOM" perplexity -m "$model" -f "$text" -c 4096 > /dev/null 2> "$tmpdir/e2" && fail "a too short text accepted"
expect_grep "needs at least 8192 (a longer text, or a smaller -c)" "$tmpdir/e2" "a too short text is named, with the fix"
"$LOOM" perplexity -m "$model" > /dev/null 2> "$tmpdir/e3"
[ $? -eq 2 ] && pass "no -f: usage error" || fail "no -f: exit not 2"
"$LOOM" perplexity -m "$model" -f "$tmpdir/nosuch.txt" > /dev/null 2> "$tmpdir/e4" && fail "missing text accepted"
expect_grep "nosuch.txt" "$tmpdir/e4" "a missing text file is named"
finish
