# tests/out_of_tree.sh - what a third party does: install loom (into a DESTDIR), copy the
# installed backend template, build it with its own Makefile against the installed header alone
# (`pkg-config loom-backend`), check it with the installed loom-conformance (ops and a model),
# install it and run a model on it. Also: the installed `loom` finds the installed backends.
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

# the third party's source: the backend template as installed, built by its own Makefile with
# pkg-config alone (pointed into the DESTDIR install), outside the tree
template="$dest$prefix/share/loom/backend-template"
[ -f "$template/example.c" ] && [ -f "$template/Makefile" ] && [ -f "$template/README.md" ] &&
    pass "the backend template is installed" || { fail "no template in $template"; finish; }
cp -r "$template" "$tmpdir/thirdparty"
if PKG_CONFIG_PATH="$pcdir" MAKEFLAGS= ${MAKE:-make} -C "$tmpdir/thirdparty" CC="${CC:-cc}" \
        PKG_CONFIG="pkg-config --define-variable=prefix=$dest$prefix" > "$tmpdir/cc.log" 2>&1; then
    pass "the template builds from the installed header alone"
else
    fail "out-of-tree build:"; cat "$tmpdir/cc.log" >&2; finish
fi
grep -q -- "-Wall -Wextra" "$tmpdir/cc.log" && ! grep -v "^make" "$tmpdir/cc.log" | grep -q "warning:" &&
    pass "without warnings" || { fail "template warnings:"; grep "warning:" "$tmpdir/cc.log" >&2; }
nm -D --defined-only "$tmpdir/thirdparty/loom-example.so" | awk '{print $3}' > "$tmpdir/exports.txt"
[ "$(cat "$tmpdir/exports.txt")" = loom_backend_entry ] && pass "it exports only loom_backend_entry" ||
    { fail "template exports:"; cat "$tmpdir/exports.txt" >&2; }

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

# conformance and model-level conformance on it, with the installed tool, as `make check` does;
# the model is loom's synthetic one (f32), which the installed loom writes: no fixture needed
model="$tmpdir/tiny.gguf"
"$bindir/loom" bench --synthetic tiny --type f32 --write "$model" > "$tmpdir/write.log" 2>&1 ||
    fail "writing the synthetic model: $(cat "$tmpdir/write.log")"
if MAKEFLAGS= ${MAKE:-make} -C "$tmpdir/thirdparty" check CONFORMANCE="$bindir/loom-conformance --quiet" \
        MODEL="$model" PKG_CONFIG=true BACKENDDIR=unused > "$tmpdir/conf.txt" 2>&1; then
    pass "the template passes the installed conformance tool, ops and a model"
else
    fail "out-of-tree conformance:"; grep -E "FAIL|error" "$tmpdir/conf.txt" >&2
fi
expect_grep "example (ABI [0-9.]*): 0 check(s) failed" "$tmpdir/conf.txt" "the report names the template"
# installed next to loom's own backends, loom lists it and LOOM_BACKEND=example runs it
MAKEFLAGS= ${MAKE:-make} -C "$tmpdir/thirdparty" install BACKENDDIR="$dest$prefix/lib/loom/backends" \
    PKG_CONFIG=true > /dev/null 2>&1 || fail "make install of the template"
"$bindir/loom" backends > "$tmpdir/with-example.txt" 2>&1
expect_grep "example" "$tmpdir/with-example.txt" "the installed loom lists the template"
LOOM_BACKEND=example "$bindir/loom" run -m "$model" -p "Once upon a time" -n 8 --temp 0 --json \
    > "$tmpdir/example-run.json" 2> "$tmpdir/example-run.err" || fail "loom run on the template: exit $?"
jq -e '.backend | startswith("example")' "$tmpdir/example-run.json" > /dev/null &&
    pass "LOOM_BACKEND=example runs a model on it" ||
    { fail "run on the template:"; cat "$tmpdir/example-run.json" "$tmpdir/example-run.err" >&2; }
finish
