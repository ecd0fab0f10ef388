/*
 * core/utf8.c - the UTF-8 helpers of tokenizer.h: well-formed prefixes, replacement of
 * ill-formed bytes, printable text, and where a stream may be cut.
 */
#define _GNU_SOURCE
#include "tokenizer_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The bytes at s (n left) that begin a UTF-8 character: *whole is set when they are all of
 * one (Unicode's table of well-formed sequences: no overlong forms, surrogates or code points
 * above U+10FFFF), and the count is otherwise the "maximal subpart" that a decoder replaces
 * with one U+FFFD, as Python's and ICU's do. */
size_t tok_utf8_char(const unsigned char *s, size_t n, int *whole)
{
    unsigned c = s[0], lo = 0x80, hi = 0xbf;
    size_t need;
    *whole = c < 0x80;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        need = 2;
    else if (c >= 0xe0 && c <= 0xef)
        need = 3, lo = c == 0xe0 ? 0xa0 : lo, hi = c == 0xed ? 0x9f : hi;
    else if (c >= 0xf0 && c <= 0xf4)
        need = 4, lo = c == 0xf0 ? 0x90 : lo, hi = c == 0xf4 ? 0x8f : hi;
    else
        return 1;
    size_t k = 1;
    for (; k < need && k < n && s[k] >= lo && s[k] <= hi; k++)
        lo = 0x80, hi = 0xbf;
    *whole = k == need;
    return k;
}

void loom_text_printable(char *s)
{
    size_t len = strlen(s);
    for (size_t i = 0; i < len;) {
        size_t ok = loom_utf8_valid_prefix(s + i, len - i);
        for (size_t k = i; k < i + ok; k++)
            if (((unsigned char)s[k] < 0x20 && s[k] != '\n' && s[k] != '\t') || s[k] == 0x7f)
                s[k] = '?';
        i += ok;
        if (i < len)
            s[i++] = '?'; /* one byte of an ill-formed sequence; the walk resumes after it */
    }
}

size_t loom_utf8_valid_prefix(const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    int whole = 1;
    while (i < len) {
        size_t k = tok_utf8_char(s + i, len - i, &whole);
        if (!whole)
            break;
        i += k;
    }
    return i;
}

char *loom_utf8_sanitize(const char *text, size_t len, size_t *out_len)
{
    const unsigned char *s = (const unsigned char *)text;
    if (len > SIZE_MAX / 3 - 1)
        return NULL;
    char *out = malloc(3 * len + 1); /* one replacement (3 bytes) per bad byte at most */
    if (!out)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < len;) {
        int whole;
        size_t c = tok_utf8_char(s + i, len - i, &whole);
        if (whole)
            memcpy(out + k, s + i, c), k += c;
        else
            memcpy(out + k, "\xef\xbf\xbd", 3), k += 3;
        i += c;
    }
    out[k] = '\0';
    *out_len = k;
    return out;
}

size_t loom_utf8_complete(const char *s, size_t n)
{
    /* look back at most 3 bytes for the start of a character that runs past the end */
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xc0) == 0x80)
            continue; /* a continuation byte: keep looking for the lead */
        size_t need = c < 0x80 ? 1
            : (c >> 5) == 6    ? 2
            : (c >> 4) == 14   ? 3
            : (c >> 3) == 30   ? 4
                               : 1;
        return need > back ? n - back : n;
    }
    return n;
}
