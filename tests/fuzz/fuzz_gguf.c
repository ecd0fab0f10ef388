/*
 * tests/fuzz/fuzz_gguf.c - libFuzzer harness for the GGUF reader: any bytes must give a
 * parsed file or an error, never a crash, a hang or a read outside the input. A file that
 * parses is also walked the way loom does (every key, every tensor's data).
 */
#include "core/gguf.h"

#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    loom_gguf g;
    char err[512];
    if (loom_gguf_parse(&g, data, size, "fuzz", err, sizeof err) != 0) {
        loom_gguf_close(&g); /* what the parse made before it stopped */
        return 0;
    }
    volatile uint64_t sink = 0;
    for (uint64_t i = 0; i < g.n_kv; i++) {
        const loom_gguf_kv *kv = &g.kv[i];
        const char *s;
        uint64_t len;
        double d;
        int64_t v;
        if (loom_gguf_get_str(&g, kv->key, &s, &len) == 0 && len)
            sink += (unsigned char)s[len - 1];
        if (loom_gguf_get_i64(&g, kv->key, &v) == 0 || loom_gguf_get_f64(&g, kv->key, &d) == 0)
            sink++;
        for (uint64_t k = 0; kv->type == LOOM_GGUF_ARRAY && k < kv->count && k < 64; k++)
            if (loom_gguf_array_str(&g, kv, k, &s, &len) == 0 && len)
                sink += (unsigned char)s[0];
    }
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const unsigned char *p = loom_gguf_tensor_data(&g, &g.tensors[i]);
        if (g.tensors[i].size)
            sink += p[0] + p[g.tensors[i].size - 1];
    }
    loom_gguf_close(&g);
    return 0;
}
