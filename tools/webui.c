/* tools/webui.c - serves the chat page (see tools/webui.html). The page carries its script and
 * style inline; a nonce made for each response, placed in both and in the Content-Security-Policy,
 * keeps any other script from running there even if some text ever did become markup. */
#include "webui.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

extern const unsigned char loom_webui_html[];
extern const size_t loom_webui_html_len;

#define NONCE_MARK "@NONCE@"

enum MHD_Result webui_send(struct MHD_Connection *con)
{
    unsigned char raw[16];
    char nonce[2 * sizeof raw + 1];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
        return MHD_NO;
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(nonce + 2 * i, 3, "%02x", raw[i]);
    /* the page with every mark replaced (the nonce is longer than the mark) */
    const char *page = (const char *)loom_webui_html;
    size_t mark = strlen(NONCE_MARK), n_marks = 0;
    for (const char *p = page; (p = strstr(p, NONCE_MARK)); p += mark)
        n_marks++;
    size_t cap = loom_webui_html_len + n_marks * (strlen(nonce) - mark) + 1, len = 0;
    char *out = malloc(cap);
    if (!out)
        return MHD_NO;
    for (const char *p = page, *hit;; p = hit + mark) {
        hit = strstr(p, NONCE_MARK);
        size_t n = hit ? (size_t)(hit - p) : strlen(p);
        memcpy(out + len, p, n);
        len += n;
        if (!hit)
            break;
        memcpy(out + len, nonce, strlen(nonce));
        len += strlen(nonce);
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, out, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(out);
        return MHD_NO;
    }
    char csp[256];
    snprintf(csp, sizeof csp,
             "default-src 'none'; script-src 'nonce-%s'; style-src 'nonce-%s'; "
             "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
             "frame-ancestors 'none'",
             nonce, nonce);
    MHD_add_response_header(r, "Content-Type", "text/html; charset=utf-8");
    MHD_add_response_header(r, "Content-Security-Policy", csp);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ok = MHD_queue_response(con, 200, r);
    MHD_destroy_response(r);
    return ok;
}
