# tests/out_of_tree.sh - what a third party does: install loom (into a DESTDIR), build a backend
# against the installed header alone via `pkg-config --cflags loom-backend`, and check it with
# the installed loom-conformance. Also: the installed `loom` finds the installed backends.
. "$top_srcdir/tests/lib.sh"
unset LOOM_BACKEND LOOM_CPU_VARIANT LOOM_CPU_MAX_ISA LOOM_EXPLAIN LOOM_BACKEND_PATH

dest="$tmpdir/dest"
if ! ${MAKE:-make} -C "$top_builddir" install DESTDIR="$dest" > "$tmpdir/install.log" 2>&1; then
    fail "make install DESTDIR"; tail -20 "$tmpdir/install.log" >&2; finish
fi
prefix=$(sed -n 's/^prefix=//p' "$top_builddir/loom-backend.pc")
pcdir=$(dirname "$(find "$dest" -name loom-backend.pc | head -1)")
cflags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --define-variable=prefix="$dest$prefix" --cflags loom-backend) ||
    fail "pkg-config --cflags loom-backend"
echo "cflags: $cflags"
case "$cflags" in *"$dest"*) pass "cflags point into the install";; *) fail "cflags: $cflags";; esac

# the third party's source: a copy of ref outside the tree, so no loom-internal path can leak in
mkdir -p "$tmpdir/thirdparty"
cp "$top_srcdir/backends/ref/ref.c" "$tmpdir/thirdparty/mybackend.c"
# shellcheck disable=SC2086
if ${CC:-cc} -std=c11 -O1 -fPIC -shared $cflags -o "$tmpdir/thirdparty/mybackend.so" \
        "$tmpdir/thirdparty/mybackend.c" -lm 2> "$tmpdir/cc.log"; then
    pass "built against the installed header"
else
    fail "out-of-tree build:"; cat "$tmpdir/cc.log" >&2; finish
fi

bindir="$dest$prefix/bin"
"$bindir/loom" backends > "$tmpdir/installed.txt" 2>&1 || fail "installed loom backends exit $?"
expect_grep "lib/loom/backends/loom-ref.so" "$tmpdir/installed.txt" "installed loom finds installed ref"
"$bindir/loom" backends --json > "$tmpdir/installed.json" || fail "installed loom backends --json"
best=$(best_of "$tmpdir/installed.json")
expect_grep "^\* $best\$" "$tmpdir/installed.txt" "and chooses the best installed backend ($best)"
case $(jq -r .chosen "$tmpdir/installed.json") in
    "$dest"*) pass "the chosen module is the installed one";;
    *) fail "chosen module outside the install: $(jq -r .chosen "$tmpdir/installed.json")";;
esac

if "$bindir/loom-conformance" --quiet "$tmpdir/thirdparty/mybackend.so" > "$tmpdir/conf.txt" 2>&1; then
    pass "out-of-tree module passes the installed conformance tool"
else
    fail "out-of-tree conformance:"; cat "$tmpdir/conf.txt" >&2
fi
finish
