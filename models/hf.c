/*
 * models/hf.c - the helpers the families' Hugging Face tables and hooks use: config.json
 * lookups and the hyper-parameters being assembled.
 */
#include "family.h"

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

double loom_hf_num(const cJSON *config, const char *keys, double fallback)
{
    const cJSON *o = first(config, keys, cJSON_IsNumber);
    return o ? o->valuedouble : fallback;
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
