/*
 * tools/json_text.h - model output as a JSON string: given by length (a generated NUL byte is
 * "\u0000", not the end), and always valid UTF-8 (ill-formed bytes become U+FFFD), so that
 * strict clients can decode every body and event loom sends.
 */
#ifndef LOOM_TOOLS_JSON_TEXT_H
#define LOOM_TOOLS_JSON_TEXT_H

#include <cjson/cJSON.h>
#include <stddef.h>

/* A cJSON string item holding len bytes of text (a raw item, printed as built); NULL when out
 * of memory. */
cJSON *json_text(const char *text, size_t len);

/* Adds it to o under key; 0, or -1 when out of memory. */
int json_add_text(cJSON *o, const char *key, const char *text, size_t len);

#endif
