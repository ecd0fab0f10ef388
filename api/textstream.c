/*
 * api/textstream.c - turning generated tokens' bytes into text a client can be shown: never a
 * split UTF-8 character, never the start of a stop string that might still complete.
 */
#define _GNU_SOURCE
#include "api/internal.h"

#include "core/tokenizer.h"

#include <stdlib.h>
#include <string.h>

void loom_text_stream_init(loom_text_stream *ts, const char *const *stops, int n_stops)
{
    *ts = (loom_text_stream){.stops = stops, .n_stops = n_stops};
}

void loom_text_stream_free(loom_text_stream *ts)
{
    free(ts->held), free(ts->out);
    *ts = (loom_text_stream){0};
}

static int grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *nb = realloc(*buf, c);
    if (!nb)
        return -1;
    *buf = nb, *cap = c;
    return 0;
}

/* Moves the first n held bytes to the output. */
static void emit(loom_text_stream *ts, size_t n)
{
    if (grow(&ts->out, &ts->out_cap, n + 1) != 0)
        n = 0;
    if (!ts->out)
        return; /* out of memory: nothing to show */
    if (n) {
        memcpy(ts->out, ts->held, n);
        memmove(ts->held, ts->held + n, ts->n_held - n);
    }
    ts->out[n] = 0;
    ts->n_out = n;
    ts->n_held -= n;
}

int loom_text_stream_push(loom_text_stream *ts, const char *bytes, size_t n)
{
    ts->n_out = 0;
    if (grow(&ts->held, &ts->held_cap, ts->n_held + n + 1) != 0)
        return -1;
    if (n)
        memcpy(ts->held + ts->n_held, bytes, n);
    ts->n_held += n;
    /* the earliest stop string ends the text there */
    size_t cut = (size_t)-1;
    for (int i = 0; i < ts->n_stops; i++) {
        size_t ls = strlen(ts->stops[i]);
        if (!ls || ls > ts->n_held)
            continue;
        const char *at = memmem(ts->held, ts->n_held, ts->stops[i], ls);
        if (at && (size_t)(at - ts->held) < cut)
            cut = (size_t)(at - ts->held), ts->stopped_by = i + 1;
    }
    if (cut != (size_t)-1) {
        ts->n_held = cut;
        emit(ts, cut);
        return 1;
    }
    /* hold back a tail that could still grow into a stop string, and an unfinished character */
    size_t safe = ts->n_held;
    for (int i = 0; i < ts->n_stops; i++) {
        size_t ls = strlen(ts->stops[i]);
        for (size_t k = ls - 1 < ts->n_held ? ls - 1 : ts->n_held; k > 0; k--)
            if (memcmp(ts->held + ts->n_held - k, ts->stops[i], k) == 0) {
                if (ts->n_held - k < safe)
                    safe = ts->n_held - k;
                break;
            }
    }
    emit(ts, loom_utf8_complete(ts->held, safe));
    return 0;
}

void loom_text_stream_flush(loom_text_stream *ts)
{
    emit(ts, ts->n_held);
}
