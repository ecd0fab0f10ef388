/*
 * tools/serve/stored.c - the Responses API's stored responses (a request's "store", true unless
 * it says false): each kept with the conversation it ended (its chat messages through its own
 * answer), so that a later request's previous_response_id continues it, and GET / DELETE
 * /v1/responses/{id} read and remove it. At most --responses-max of them; past it the oldest
 * is dropped (its id then answers 404, as an unknown one). In memory: a restart forgets them.
 */
#define _GNU_SOURCE
#include "tools/serve/server.h"

#include <stdlib.h>
#include <string.h>

struct stored_response {
    char id[48];
    cJSON *conversation, *response;
    struct stored_response *next;
};

static void stored_free(stored_response *s)
{
    cJSON_Delete(s->conversation);
    cJSON_Delete(s->response);
    free(s);
}

void stored_put(server *srv, const char *id, cJSON *conversation, cJSON *response)
{
    stored_response *s = calloc(1, sizeof *s);
    if (!s || !conversation || !response) { /* out of memory: the answer is given, not kept */
        free(s);
        cJSON_Delete(conversation), cJSON_Delete(response);
        return;
    }
    snprintf(s->id, sizeof s->id, "%s", id);
    s->conversation = conversation, s->response = response;
    pthread_mutex_lock(&srv->stored_lock);
    if (srv->stored_tail)
        srv->stored_tail->next = s;
    else
        srv->stored_head = s;
    srv->stored_tail = s;
    srv->n_stored++;
    while (srv->n_stored > srv->stored_max) { /* the oldest goes */
        stored_response *old = srv->stored_head;
        srv->stored_head = old->next;
        if (!srv->stored_head)
            srv->stored_tail = NULL;
        srv->n_stored--;
        stored_free(old);
    }
    pthread_mutex_unlock(&srv->stored_lock);
}

/* the kept response id (stored_lock held), or NULL; *before: the one before it in the list */
static stored_response *find(server *srv, const char *id, stored_response **before)
{
    stored_response *prev = NULL;
    for (stored_response *s = srv->stored_head; s; prev = s, s = s->next)
        if (!strcmp(s->id, id)) {
            if (before)
                *before = prev;
            return s;
        }
    return NULL;
}

cJSON *stored_get(server *srv, const char *id, int conversation)
{
    pthread_mutex_lock(&srv->stored_lock);
    stored_response *s = find(srv, id, NULL);
    cJSON *copy = s ? cJSON_Duplicate(conversation ? s->conversation : s->response, 1) : NULL;
    pthread_mutex_unlock(&srv->stored_lock);
    return copy;
}

int stored_delete(server *srv, const char *id)
{
    pthread_mutex_lock(&srv->stored_lock);
    stored_response *before = NULL, *s = find(srv, id, &before);
    if (s) {
        if (before)
            before->next = s->next;
        else
            srv->stored_head = s->next;
        if (srv->stored_tail == s)
            srv->stored_tail = before;
        srv->n_stored--;
    }
    pthread_mutex_unlock(&srv->stored_lock);
    if (s)
        stored_free(s);
    return s ? 0 : -1;
}

void stored_clear(server *srv)
{
    for (stored_response *s = srv->stored_head, *next; s; s = next) {
        next = s->next;
        stored_free(s);
    }
    srv->stored_head = srv->stored_tail = NULL;
    srv->n_stored = 0;
}
