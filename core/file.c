/*
 * core/file.c - see file.h. The file is opened with O_NONBLOCK (a FIFO opens at once instead
 * of waiting for a writer), checked with fstat, then switched back to blocking reads.
 */
#define _GNU_SOURCE
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *kind_of(mode_t mode)
{
    return S_ISFIFO(mode) ? "a FIFO"
        : S_ISDIR(mode)   ? "a folder"
        : S_ISCHR(mode)   ? "a character device"
        : S_ISBLK(mode)   ? "a block device"
        : S_ISSOCK(mode)  ? "a socket"
                          : "not a plain file";
}

int loom_file_open(const char *path, struct stat *st, char *err, size_t err_size)
{
    struct stat s;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        int e = errno;
        snprintf(err, err_size, "%s: %s", path, strerror(e));
        errno = e;
        return -1;
    }
    if (fstat(fd, &s) != 0) {
        int e = errno;
        snprintf(err, err_size, "%s: %s", path, strerror(e));
        close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(s.st_mode)) {
        snprintf(err, err_size, "%s: not a regular file (%s)", path, kind_of(s.st_mode));
        close(fd);
        errno = EINVAL;
        return -1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (st)
        *st = s;
    return fd;
}

FILE *loom_file_fopen(const char *path, char *err, size_t err_size)
{
    int fd = loom_file_open(path, NULL, err, err_size);
    FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (fd >= 0 && !f) {
        snprintf(err, err_size, "%s: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

char *loom_file_read(const char *path, size_t max, size_t *len, char *err, size_t err_size)
{
    struct stat st;
    int fd = loom_file_open(path, &st, err, err_size);
    if (fd < 0)
        return NULL;
    if ((uint64_t)st.st_size > max) {
        snprintf(err, err_size, "%s: %lld bytes, more than the %zu loom reads for such a file",
                 path, (long long)st.st_size, max);
        close(fd);
        errno = EFBIG;
        return NULL;
    }
    size_t size = (size_t)st.st_size, got = 0;
    char *text = malloc(size + 1);
    while (text && got < size) {
        ssize_t n = read(fd, text + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (!text || got != size) {
        snprintf(err, err_size, "%s: %s", path, text ? "cannot read it whole" : "out of memory");
        free(text);
        errno = text ? EIO : ENOMEM;
        return NULL;
    }
    text[size] = '\0';
    if (len)
        *len = size;
    return text;
}
