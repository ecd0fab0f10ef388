/*
 * core/spm_model.c - see spm_model.h. Protobuf wire format: each field is a varint key
 * (number << 3 | wire type) then its value: 0 varint, 1 fixed 64 bits, 2 a varint length and
 * that many bytes, 5 fixed 32 bits. ModelProto: 1 pieces (repeated SentencePiece: 1 piece,
 * 2 score, 3 type), 2 trainer_spec (3 model_type, 35 byte_fallback, 40 unk_id, 41 bos_id,
 * 42 eos_id, 43 pad_id), 3 normalizer_spec (1 name, 2 precompiled_charsmap, 3 add_dummy_prefix,
 * 4 remove_extra_whitespaces, 5 escape_whitespaces).
 * Unknown fields are skipped, as protobuf requires.
 */
#include "spm_model.h"

#include "file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct pb {
    const unsigned char *p, *end;
} pb;

static int varint(pb *b, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64 && b->p < b->end; shift += 7) {
        unsigned char c = *b->p++;
        *v |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80))
            return 0;
    }
    return -1;
}

/* Reads the next field's number, wire type and value (sub: the bytes of a type-2 field). */
static int field(pb *b, uint32_t *num, int *wt, uint64_t *v, pb *sub)
{
    uint64_t key;
    if (varint(b, &key))
        return -1;
    *num = (uint32_t)(key >> 3);
    *wt = (int)(key & 7);
    switch (*wt) {
    case 0: return varint(b, v);
    case 1:
        if (b->end - b->p < 8)
            return -1;
        memcpy(v, b->p, 8);
        b->p += 8;
        return 0;
    case 2:
        if (varint(b, v) || *v > (uint64_t)(b->end - b->p))
            return -1;
        sub->p = b->p;
        sub->end = b->p + *v;
        b->p += *v;
        return 0;
    case 5: {
        uint32_t x;
        if (b->end - b->p < 4)
            return -1;
        memcpy(&x, b->p, 4);
        b->p += 4;
        *v = x;
        return 0;
    }
    default: return -1;
    }
}

void loom_spm_model_free(loom_spm_model *m)
{
    for (int32_t i = 0; m->pieces && i < m->n; i++)
        free(m->pieces[i]);
    free(m->pieces), free(m->scores), free(m->types);
    free(m->charsmap);
    memset(m, 0, sizeof *m);
}

static int add_piece(loom_spm_model *m, pb *sub, int32_t *cap)
{
    if (m->n == *cap) {
        int32_t c = *cap ? *cap * 2 : 1024;
        char **p = realloc(m->pieces, (size_t)c * sizeof *p);
        if (p)
            m->pieces = p;
        float *s = realloc(m->scores, (size_t)c * sizeof *s);
        if (s)
            m->scores = s;
        int32_t *t = realloc(m->types, (size_t)c * sizeof *t);
        if (t)
            m->types = t;
        if (!p || !s || !t)
            return -1;
        *cap = c;
    }
    char *text = NULL;
    float score = 0;
    int32_t type = 1;
    while (sub->p < sub->end) {
        uint32_t num;
        int wt;
        uint64_t v;
        pb s2;
        if (field(sub, &num, &wt, &v, &s2)) {
            free(text);
            return -1;
        }
        if (num == 1 && wt == 2) {
            free(text);
            text = malloc(v + 1);
            if (!text)
                return -1;
            memcpy(text, s2.p, v);
            text[v] = '\0';
        } else if (num == 2 && wt == 5) {
            uint32_t bits = (uint32_t)v;
            memcpy(&score, &bits, 4);
        } else if (num == 3 && wt == 0) {
            type = (int32_t)v;
        }
    }
    if (!text)
        return -1;
    m->pieces[m->n] = text;
    m->scores[m->n] = score;
    m->types[m->n] = type;
    m->n++;
    return 0;
}

int loom_spm_model_read(loom_spm_model *m, const char *path, char *err, size_t err_size)
{
    memset(m, 0, sizeof *m);
    m->unk_id = 0, m->bos_id = 1, m->eos_id = 2, m->pad_id = -1;
    m->add_dummy_prefix = 1, m->remove_extra_whitespaces = 1, m->escape_whitespaces = 1;
    m->model_type = 1;
    size_t size;
    unsigned char *data = (unsigned char *)loom_file_read(path, 512u << 20, &size, err, err_size);
    if (!data)
        return -1;
    pb b = {data, data + size};
    int32_t cap = 0;
    int rc = 0;
    while (b.p < b.end && rc == 0) {
        uint32_t num;
        int wt;
        uint64_t v;
        pb sub;
        if (field(&b, &num, &wt, &v, &sub)) {
            rc = -1;
            break;
        }
        if (num == 1 && wt == 2) {
            rc = add_piece(m, &sub, &cap);
        } else if ((num == 2 || num == 3) && wt == 2) {
            while (sub.p < sub.end && rc == 0) {
                uint32_t n2;
                int w2;
                uint64_t v2;
                pb s3;
                if (field(&sub, &n2, &w2, &v2, &s3)) {
                    rc = -1;
                    break;
                }
                if (num == 3 && n2 == 1 && w2 == 2) {
                    size_t k = v2 < sizeof m->normalizer - 1 ? (size_t)v2
                                                             : sizeof m->normalizer - 1;
                    memcpy(m->normalizer, s3.p, k);
                    m->normalizer[k] = '\0';
                }
                if (num == 3 && n2 == 2 && w2 == 2 && v2 > 0 && !m->charsmap) {
                    if (!(m->charsmap = malloc((size_t)v2))) {
                        rc = -1;
                        break;
                    }
                    memcpy(m->charsmap, s3.p, (size_t)v2);
                    m->charsmap_size = (size_t)v2;
                }
                if (w2 != 0)
                    continue;
                if (num == 2) {
                    if (n2 == 3)
                        m->model_type = (int32_t)v2;
                    else if (n2 == 35)
                        m->byte_fallback = v2 != 0;
                    else if (n2 == 40)
                        m->unk_id = (int32_t)v2;
                    else if (n2 == 41)
                        m->bos_id = (int32_t)v2;
                    else if (n2 == 42)
                        m->eos_id = (int32_t)v2;
                    else if (n2 == 43)
                        m->pad_id = (int32_t)v2;
                } else {
                    if (n2 == 3)
                        m->add_dummy_prefix = v2 != 0;
                    else if (n2 == 4)
                        m->remove_extra_whitespaces = v2 != 0;
                    else if (n2 == 5)
                        m->escape_whitespaces = v2 != 0;
                }
            }
        }
    }
    free(data);
    if (rc != 0 || m->n == 0) {
        snprintf(err, err_size, "%s: not a SentencePiece model (protobuf %s)", path,
                 rc ? "is malformed" : "holds no pieces");
        loom_spm_model_free(m);
        return -1;
    }
    return 0;
}
