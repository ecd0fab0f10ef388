/*
 * tests/fuzz/fuzz_safetensors.c - libFuzzer harness for the safetensors reader (single files):
 * the input goes into an anonymous in-memory file that the reader opens and maps as it would a
 * real one; it must open it or refuse it, and every tensor it accepts must lie inside.
 */
#define _GNU_SOURCE
#include "core/safetensors.h"

#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("fuzz.safetensors", 0);
    if (fd < 0)
        return 0;
    if (write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64], err[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    loom_safetensors st;
    if (loom_safetensors_open(&st, path, err, sizeof err) == 0) {
        volatile uint64_t sink = 0;
        for (int i = 0; i < st.n_tensors; i++) {
            const unsigned char *p = st.tensors[i].data;
            if (st.tensors[i].size)
                sink += p[0] + p[st.tensors[i].size - 1];
        }
        loom_safetensors_close(&st);
    }
    close(fd);
    return 0;
}
