/*
 * tools/json_text.c - see json_text.h.
 */
#include "json_text.h"

#include <loom/loom.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

cJSON *json_text(const char *text, size_t len)
{
    size_t n;
    char *valid = loom_utf8_sanitize(text ? text : "", text ? len : 0, &n);
    char *lit = valid && n < ((size_t)-1) / 6 - 3 ? malloc(6 * n + 3) : NULL;
    cJSON *item = NULL;
    if (lit) {
        size_t k = 0;
        lit[k++] = '"';
        for (size_t i = 0; i < n; i++) {
            unsigned char c = (unsigned char)valid[i];
            if (c == '"' || c == '\\') {
                lit[k++] = '\\', lit[k++] = (char)c;
            } else if (c == '\n') {
                lit[k++] = '\\', lit[k++] = 'n';
            } else if (c == '\t') {
                lit[k++] = '\\', lit[k++] = 't';
            } else if (c == '\r') {
                lit[k++] = '\\', lit[k++] = 'r';
            } else if (c < 0x20) { /* the other controls, NUL included */
                k += (size_t)snprintf(lit + k, 7, "\\u%04x", c);
            } else {
                lit[k++] = (char)c;
            }
        }
        lit[k++] = '"';
        lit[k] = '\0';
        item = cJSON_CreateRaw(lit);
    }
    free(lit);
    free(valid);
    return item;
}

int json_add_text(cJSON *o, const char *key, const char *text, size_t len)
{
    cJSON *item = json_text(text, len);
    if (!item || !cJSON_AddItemToObject(o, key, item)) {
        cJSON_Delete(item);
        return -1;
    }
    return 0;
}
