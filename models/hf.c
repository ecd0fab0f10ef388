/*
 * models/hf.c - the helpers the families' Hugging Face tables and hooks use: config.json
 * lookups and the hyper-parameters being assembled.
 */
#include "family.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void loom_hf_set(loom_hf_values *v, const char *key, loom_hf_kind kind, double num)
{
    int i = 0;
    while (i < v->n && strcmp(v->v[i].key, key) != 0)
        i++;
    if (i == LOOM_HF_MAX_VALUES) /* a family's table is code: more is a programming error */
        return;
    if (i == v->n)
        v->n++;
    v->v[i].key = key, v->v[i].kind = kind, v->v[i].num = num, v->v[i].str = NULL;
}

void loom_hf_set_str(loom_hf_values *v, const char *key, const char *str)
{
    loom_hf_set(v, key, LOOM_HF_STR, 0);
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->v[i].key, key))
            v->v[i].str = str;
}

double loom_hf_get(const loom_hf_values *v, const char *key)
{
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->v[i].key, key))
            return v->v[i].num;
    return 0;
}

/* The value of one key, "a.b" meaning b in object a; NULL when absent. */
static const cJSON *lookup(const cJSON *config, const char *key, size_t len)
{
    const cJSON *o = config;
    while (o && len) {
        const char *dot = memchr(key, '.', len);
        size_t part = dot ? (size_t)(dot - key) : len;
        char name[128];
        if (part >= sizeof name)
            return NULL;
        memcpy(name, key, part);
        name[part] = '\0';
        o = cJSON_GetObjectItemCaseSensitive(o, name);
        key += dot ? part + 1 : part;
        len -= dot ? part + 1 : part;
    }
    return o;
}

/* The first of keys ('|' between) whose value passes is_kind. */
static const cJSON *first(const cJSON *config, const char *keys,
                          cJSON_bool (*is_kind)(const cJSON *))
{
    while (keys && *keys) {
        size_t len = strcspn(keys, "|");
        const cJSON *o = lookup(config, keys, len);
        if (is_kind(o))
            return o;
        keys += len + (keys[len] == '|');
    }
    return NULL;
}

const cJSON *loom_hf_array(const cJSON *config, const char *keys)
{
    return first(config, keys, cJSON_IsArray);
}

double loom_hf_num(const cJSON *config, const char *keys, double fallback)
{
    const cJSON *o = first(config, keys, cJSON_IsNumber);
    return o ? o->valuedouble : fallback;
}

/* The first of keys present with a value other than null, and its name in name. */
static const cJSON *first_present(const cJSON *config, const char *keys, char *name,
                                  size_t name_size)
{
    while (keys && *keys) {
        size_t len = strcspn(keys, "|");
        const cJSON *o = lookup(config, keys, len);
        if (o && !cJSON_IsNull(o)) {
            snprintf(name, name_size, "%.*s", (int)len, keys);
            return o;
        }
        keys += len + (keys[len] == '|');
    }
    return NULL;
}

/* The first of keys present, in *o with its value as a number (NaN when it is not one); 0
 * when none is present. */
static int present_number(const cJSON *config, const char *keys, const cJSON **o, double *x,
                          char *name, size_t name_size)
{
    *o = first_present(config, keys, name, name_size);
    *x = *o && cJSON_IsNumber(*o) ? (*o)->valuedouble : NAN;
    return *o != NULL;
}

/* "KEY is VALUE; it must be RULE" in err; returns -1. */
static int bad_value(const cJSON *o, const char *name, const char *rule, char *err, size_t err_size)
{
    char *text = cJSON_PrintUnformatted(o);
    snprintf(err, err_size, "%s is %.40s; it must be %s", name, text ? text : "not a number", rule);
    free(text);
    return -1;
}

int loom_hf_int(const cJSON *config, const char *keys, int64_t fallback, int64_t lo, int64_t hi,
                int64_t *out, char *err, size_t err_size)
{
    char name[128], rule[96];
    const cJSON *o;
    double x;
    if (!present_number(config, keys, &o, &x, name, sizeof name))
        *out = fallback;
    else if (x == floor(x) && x >= (double)lo && x <= (double)hi)
        *out = (int64_t)x;
    else {
        snprintf(rule, sizeof rule, "a whole number from %lld to %lld", (long long)lo,
                 (long long)hi);
        return bad_value(o, name, rule, err, err_size);
    }
    return 0;
}

int loom_hf_real(const cJSON *config, const char *keys, double fallback, double above, double hi,
                 double *out, char *err, size_t err_size)
{
    char name[128], rule[96];
    const cJSON *o;
    double x;
    if (!present_number(config, keys, &o, &x, name, sizeof name))
        *out = fallback;
    else if (x > above && x <= hi)
        *out = x;
    else {
        snprintf(rule, sizeof rule, "a number above %g, at most %g", above, hi);
        return bad_value(o, name, rule, err, err_size);
    }
    return 0;
}

const char *loom_hf_str(const cJSON *config, const char *keys)
{
    const cJSON *o = first(config, keys, cJSON_IsString);
    return o ? o->valuestring : NULL;
}

int loom_hf_true(const cJSON *config, const char *key)
{
    return cJSON_IsTrue(lookup(config, key, strlen(key)));
}
