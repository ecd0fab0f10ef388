/*
 * api/generate.c - generating one sequence: the decode loop of loom run and loom chat, with or
 * without speculative decoding (loom.h's loom_speculation).
 *
 * One loop serves both. Each round the target model evaluates the last accepted token and the
 * k tokens a drafter proposed (k = 0: a plain decode step) in one pass, at the positions after
 * the accepted text, and reads back all k + 1 rows of logits. Rejected proposals need no undo:
 * a single sequence's KV slot is its position, so the next round overwrites them; a drafter
 * model's cache is trimmed the same way, to the prefix of what it evaluated that the text
 * still has. Under a grammar (loom_generate_constrained) nothing is proposed: each token is
 * drawn as the engine draws a constrained request's (grammar_sample).
 */
#define _GNU_SOURCE
#include "chat/grammar.h"
#include "api/internal.h"

#include "core/runner.h"
#include "core/sampler.h"
#include "core/tokenizer.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DRAFT_MAX_DEFAULT 8
#define DRAFT_MAX_LIMIT 64

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- Drafters ---------------------------------------------------------------------------- */

typedef struct drafter {
    const loom_speculation *spec; /* NULL: no speculation */
    loom_model *model;            /* spec->draft */
    int32_t n_vocab;
    loom_draft_cache *seen; /* the tokens the drafter model's cache holds, positions 0.. */
    float *q;      /* [draft_max][n_vocab]: the drafter model's distributions, sampling only */
    float *logits; /* [n_vocab] scratch */
    uint64_t rng;
    /* a multi-token-prediction drafter: the target's runner it follows, and its own last
     * hidden state (the input of its next proposal) */
    struct loom_runner *target;
    float *own;
    int out_of_memory; /* a hidden state could not be kept: no proposals this generation */
} drafter;

/* The drafter model must spell every id as the target does, or its proposals mean other text. */
static int same_vocabulary(loom_model *m, loom_model *d, char *err, size_t err_size)
{
    int32_t n = loom_model_n_vocab(m);
    if (loom_model_n_vocab(d) != n) {
        snprintf(err, err_size,
                 "the draft model has %d tokens and the model %d: a drafter needs the same "
                 "vocabulary (a smaller model of the same family, or --draft-layers)",
                 loom_model_n_vocab(d), n);
        return -1;
    }
    char a[512], b[512];
    for (int32_t id = 0; id < n; id++) {
        int la = loom_token_piece(m, -1, id, a, sizeof a);
        int lb = loom_token_piece(d, -1, id, b, sizeof b);
        int unused_a = loom_model_token_unused(m, id), unused_b = loom_model_token_unused(d, id);
        if (la != lb || (la > 0 && memcmp(a, b, (size_t)la) != 0) || unused_a != unused_b) {
            snprintf(err, err_size,
                     "the draft model's token %d is not the model's (%.*s vs %.*s): a drafter "
                     "needs the same vocabulary",
                     id, lb > 0 ? (lb < 40 ? lb : 40) : 0, b, la > 0 ? (la < 40 ? la : 40) : 0, a);
            loom_text_printable(err);
            return -1;
        }
    }
    return 0;
}

int loom_speculation_check(loom_model *m, const loom_speculation *spec, char *err, size_t err_size)
{
    if (!spec)
        return 0;
    if (spec->draft && spec->lookup > 0) {
        snprintf(err, err_size, "choose one drafter: a draft model or prompt lookup, not both");
        return -1;
    }
    if (spec->draft_max < 0 || spec->draft_max > DRAFT_MAX_LIMIT || spec->draft_min < 0 ||
        spec->lookup < 0 || (spec->draft_max && spec->draft_min > spec->draft_max) ||
        !(spec->p_min >= 0 && spec->p_min <= 1)) {
        snprintf(err, err_size,
                 "speculation: draft_max %d and draft_min %d must be 1 to %d with min <= max, "
                 "lookup %d at least 0, p_min %g from 0 to 1",
                 spec->draft_max, spec->draft_min, DRAFT_MAX_LIMIT, spec->lookup,
                 (double)spec->p_min);
        return -1;
    }
    if (spec->draft == m) {
        snprintf(err, err_size,
                 "the draft model is the model itself: open it again with "
                 "first_layers for self-speculation");
        return -1;
    }
    /* the model's own state is checkpointed and restored around a pass (generate); a drafter
     * with recurrent layers would need the same for its proposals, which it does not have */
    if (spec->draft && loom_runner_state_slots(loom_model_runner(spec->draft))) {
        snprintf(err, err_size,
                 "a drafter with recurrent layers (%s) cannot take back its rejected proposals "
                 "yet: use --lookup, or a drafter without them",
                 loom_runner_hparams(loom_model_runner(spec->draft))->arch);
        return -1;
    }
    /* a multi-token-prediction block reads the model's hidden states: its own model's */
    const loom_hparams *a = loom_runner_hparams(loom_model_runner(m));
    const loom_hparams *b = spec->draft ? loom_runner_hparams(loom_model_runner(spec->draft)) : a;
    if (spec->draft && loom_model_draft_cache(spec->draft)->mtp &&
        (strcmp(a->arch, b->arch) != 0 || a->n_embd != b->n_embd || a->n_layer != b->n_layer)) {
        snprintf(err, err_size,
                 "the multi-token-prediction drafter is another model's (%s, %d layers of %d, "
                 "against %s, %d of %d): open it from the model's own file",
                 b->arch, b->n_layer, b->n_embd, a->arch, a->n_layer, a->n_embd);
        return -1;
    }
    return spec->draft ? same_vocabulary(m, spec->draft, err, err_size) : 0;
}

/* ---- The model's own multi-token-prediction block as the drafter --------------------------
 * The block proposes the token after next from the target's final hidden state at a position
 * and the id that follows it there; its proposals chain on its own hidden state. It follows the
 * target (loom_runner_follow): every state the target computes is kept in its draft cache until
 * the id after it is settled, then taken into its KV cache. */

int loom_mtp_states_put(loom_mtp_states *s, int32_t pos0, const float *rows, int32_t n)
{
    const size_t row = (size_t)s->n_embd * sizeof(float);
    assert(s->n_embd > 0 && pos0 >= 0 && n >= 0);
    if (pos0 < s->from || pos0 > s->from + s->n)
        s->from = pos0, s->n = 0;
    const int32_t need = pos0 - s->from + n;
    if (need > s->cap) {
        float *h = realloc(s->rows, (size_t)need * row);
        if (!h) {
            s->n = 0;
            return -1;
        }
        s->rows = h, s->cap = need;
    }
    memcpy(s->rows + (size_t)(pos0 - s->from) * (size_t)s->n_embd, rows, (size_t)n * row);
    s->n = need;
    return 0;
}

void loom_mtp_states_drop_before(loom_mtp_states *s, int32_t pos)
{
    int32_t drop = pos - s->from;
    if (drop <= 0)
        return;
    drop = drop < s->n ? drop : s->n;
    s->n -= drop, s->from += drop;
    memmove(s->rows, s->rows + (size_t)drop * (size_t)s->n_embd,
            (size_t)s->n * (size_t)s->n_embd * sizeof *s->rows);
}

const float *loom_mtp_states_at(const loom_mtp_states *s, int32_t pos)
{
    return pos >= s->from && pos < s->from + s->n
        ? s->rows + (size_t)(pos - s->from) * (size_t)s->n_embd
        : NULL;
}

/* The target's states at positions pos0.. (loom_runner_follow). */
static void keep_target_states(void *user, int32_t pos0, const float *rows, int32_t n)
{
    drafter *d = user;
    if (loom_mtp_states_put(&d->seen->states, pos0, rows, n) != 0)
        d->out_of_memory = 1;
}

/* The block's own state after its last row: the input of the proposal after. */
static void keep_own_state(void *user, int32_t pos0, const float *rows, int32_t n)
{
    drafter *d = user;
    (void)pos0;
    const size_t n_embd = (size_t)d->seen->states.n_embd;
    memcpy(d->own, rows + (size_t)(n - 1) * n_embd, n_embd * sizeof *d->own);
}

/* Brings the block's cache to the pairs at positions [0, n_text - 1) (the last id's state is
 * not known until the target runs it), so that its logits propose the id after text. Returns 1
 * when they do, 0 when the target's state before the last id is not at hand (nothing to
 * propose from), -1 on error. */
static int mtp_sync(drafter *d, const int32_t *text, int32_t n_text, char *err, size_t err_size)
{
    loom_draft_cache *c = d->seen;
    if (d->out_of_memory || n_text < 2)
        return 0;
    int32_t keep = 0; /* pair i stands while ids 0..i + 1 do */
    while (keep < c->n && keep < n_text && c->ids[keep] == text[keep])
        keep++;
    const int32_t end = n_text - 1;
    int32_t from = keep > 0 ? keep - 1 : 0;
    if (from >= end)
        from = end - 1;        /* run the last pair again: its logits are what proposes */
    if (from < c->states.from) /* states never kept (a prefix evaluated before it followed): */
        from = c->states.from; /* its cache keeps what it had there, worse proposals at most */
    if (from >= end || !loom_mtp_states_at(&c->states, end - 1))
        return 0;
    c->n = from < keep ? from + 1 : 0; /* a failed eval leaves the rest unknown */
    if (loom_runner_eval_mtp(loom_model_runner(d->model), text + from + 1,
                             loom_mtp_states_at(&c->states, from), end - from, from, err,
                             err_size) != 0)
        return -1;
    memcpy(c->ids, text, (size_t)n_text * sizeof *text);
    c->n = n_text;
    /* the states taken go, but the one at end - 1 (for the next sync to run its pair again if
     * nothing new came) and those after it: the prompt's last is the next pair's, and any
     * other the target rewrites (its next pass starts at end) before a sync reads it */
    loom_mtp_states_drop_before(&c->states, end - 1);
    return 1;
}

static int drafter_init(drafter *d, loom_model *m, const loom_speculation *spec, int32_t draft_max,
                        const loom_sampling *s, char *err, size_t err_size)
{
    memset(d, 0, sizeof *d);
    if (!spec || (!spec->draft && spec->lookup <= 0))
        return 0;
    if (loom_speculation_check(m, spec, err, err_size) != 0)
        return -1;
    d->spec = spec;
    d->model = spec->draft;
    d->n_vocab = loom_model_n_vocab(m);
    d->rng = s->seed ^ 0x5bd1e9955bd1e995ull; /* its own stream: the target's stays the same */
    if (!d->model)
        return 0;
    if (d->model == m) {
        snprintf(err, err_size,
                 "the draft model is the model itself: open it again with "
                 "first_layers for self-speculation");
        return -1;
    }
    if (same_vocabulary(m, d->model, err, err_size) != 0)
        return -1;
    d->seen = loom_model_draft_cache(d->model);
    d->logits = malloc((size_t)d->n_vocab * sizeof *d->logits);
    d->q = malloc((size_t)draft_max * (size_t)d->n_vocab * sizeof *d->q);
    if (!d->logits || !d->q) {
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    if (d->seen->mtp) { /* (loom_speculation_check saw it is the model's own) */
        const int32_t n_embd = loom_model_n_embd(m);
        d->seen->states.n_embd = n_embd;
        if (!(d->own = malloc((size_t)n_embd * sizeof *d->own))) {
            snprintf(err, err_size, "out of memory");
            return -1;
        }
        d->target = loom_model_runner(m);
        loom_runner_follow(d->target, keep_target_states, d);
        loom_runner_follow(loom_model_runner(d->model), keep_own_state, d);
    }
    return 0;
}

static void drafter_free(drafter *d)
{
    if (d->target) {
        loom_runner_follow(d->target, NULL, NULL);
        loom_runner_follow(loom_model_runner(d->model), NULL, NULL);
    }
    free(d->q), free(d->logits), free(d->own);
}

int32_t loom_lookup_draft(const int32_t *text, int32_t n_text, int32_t n_max, int32_t k,
                          int32_t *out)
{
    int32_t n_min = n_max > 1 ? 2 : 1;
    for (int32_t n = n_max < n_text - 1 ? n_max : n_text - 1; n >= n_min; n--) {
        const int32_t *tail = text + n_text - n;
        for (int32_t at = n_text - n - 1; at >= 0; at--) {
            if (memcmp(text + at, tail, (size_t)n * sizeof *text) != 0)
                continue;
            int32_t from = at + n, got = 0;
            while (got < k && from + got < n_text)
                out[got] = text[from + got], got++;
            if (got > 0)
                return got;
        }
    }
    return 0;
}

/* The drafter model's proposals after text: it first evaluates what of the text its cache
 * lacks, then proposes token by token, drawing from its own distribution (kept in d->q when
 * sampling) with the same sampling options as the target. */
/* Brings the drafter model's cache to text[0..n_text - 1] evaluated, keeping what of it the
 * text still has, so that its logits are those after the text. */
static int drafter_sync(drafter *d, const int32_t *text, int32_t n_text, char *err, size_t err_size)
{
    loom_draft_cache *seen = d->seen;
    int32_t keep = 0;
    while (keep < seen->n && keep < n_text && seen->ids[keep] == text[keep])
        keep++;
    if (keep == n_text)
        keep--;     /* evaluate the last token again: its logits are what proposes */
    seen->n = keep; /* a failed eval leaves the rest unknown */
    if (loom_runner_eval(loom_model_runner(d->model), text + keep, n_text - keep, keep, err,
                         err_size) != 0)
        return -1;
    memcpy(seen->ids + keep, text + keep, (size_t)(n_text - keep) * sizeof *text);
    seen->n = n_text;
    return 0;
}

static int32_t model_draft(drafter *d, const int32_t *text, int32_t n_text, int32_t k,
                           const loom_sampler_params *sp, int sampling, int32_t *out, char *err,
                           size_t err_size)
{
    loom_model *dm = d->model;
    struct loom_runner *r = loom_model_runner(dm);
    if (n_text + k > loom_model_n_ctx(dm))
        k = loom_model_n_ctx(dm) - n_text;
    if (k <= 0)
        return 0;
    const int mtp = d->seen->mtp;
    if (mtp) {
        int ready = mtp_sync(d, text, n_text, err, err_size);
        if (ready <= 0)
            return ready;
    } else if (drafter_sync(d, text, n_text, err, err_size) != 0) {
        return -1;
    }
    /* the history the penalties see: the text, then the proposals so far */
    int32_t *hist = d->seen->ids;
    int32_t n = 0;
    while (n < k) {
        memcpy(d->logits, loom_runner_logits(r), (size_t)d->n_vocab * sizeof *d->logits);
        loom_model_mask_unsampled(dm, d->logits);
        float *q = sampling ? d->q + (size_t)n * (size_t)d->n_vocab : NULL;
        int32_t tok;
        float confidence;
        if (sampling) {
            if (loom_sampler_probs(d->logits, d->n_vocab, sp, hist, n_text + n, q) != 0)
                break;
            tok = loom_sampler_draw(q, d->n_vocab, &d->rng);
            confidence = 0;
            for (int32_t i = 0; i < d->n_vocab; i++)
                confidence = q[i] > confidence ? q[i] : confidence;
        } else {
            tok = loom_sampler_sample(d->logits, d->n_vocab, sp, hist, n_text + n, &d->rng);
            /* greedy has no distribution of its own: the softmax at temperature 1 (a pass over
             * the vocabulary, skipped when no p_min asks for it) */
            confidence = 1;
            if (d->spec->p_min > 0) {
                float max = d->logits[tok];
                double sum = 0;
                for (int32_t i = 0; i < d->n_vocab; i++)
                    sum += expf(d->logits[i] - max);
                confidence = (float)(1.0 / sum);
            }
        }
        if (tok < 0 || confidence < d->spec->p_min)
            break;
        out[n++] = tok;
        if (n == k)
            break;
        /* its cache takes the proposal, so that it can propose the next (the MTP block's with
         * its own state beside it, one position behind) */
        if ((mtp ? loom_runner_eval_mtp(r, &tok, d->own, 1, n_text + n - 2, err, err_size)
                 : loom_runner_eval(r, &tok, 1, n_text + n - 1, err, err_size)) != 0)
            return -1;
        d->seen->ids[d->seen->n++] = tok;
    }
    if (mtp) /* what it ran on its own states does not stand: the target's will replace them */
        d->seen->n = n_text;
    return n;
}

/* ---- How many to propose ---------------------------------------------------------------- */

/* Measured costs and acceptance, with the expected speed of each proposal length: a round of k
 * proposals accepted independently with probability a yields (1 - a^(k+1)) / (1 - a) tokens and
 * costs k drafted tokens plus a pass over k + 1 tokens. */
typedef struct spec_control {
    double t_one;         /* ms: the model's pass over one token */
    double t_extra;       /* ms: what each further token adds to a pass */
    double t_draft;       /* ms: the drafter's time per proposed token */
    double ok, miss;      /* decayed counts of accepted and rejected proposals */
    int32_t plain_rounds; /* rounds without proposals since the last */
    int32_t probe_after;  /* plain rounds before trying proposals again: 16, doubling while
                           * tries fail, up to 512 */
} spec_control;

static double ema(double old, double x)
{
    return old <= 0 ? x : 0.8 * old + 0.2 * x;
}

static double expected_rate(const spec_control *c, double a, int32_t k)
{
    double tokens = a >= 1 ? k + 1 : (1 - pow(a, k + 1)) / (1 - a);
    return tokens / (k * c->t_draft + c->t_one + k * c->t_extra);
}

/* The proposal length for this round: the best expected tokens per ms among
 * [draft_min, draft_max], or 0 when plain decoding is expected to be faster. After some plain
 * rounds it tries once more, so that a drafter whose text became predictable is noticed; the
 * wait doubles while tries keep failing, so a drafter that never agrees costs next to
 * nothing. */
static int32_t choose_k(spec_control *c, const loom_speculation *spec, int32_t draft_min,
                        int32_t draft_max)
{
    if (spec->fixed)
        return draft_max;
    if (c->t_one <= 0)
        return 0; /* the first round measures a plain pass */
    double a = (c->ok + 1) / (c->ok + c->miss + 2);
    int32_t best = 0;
    double best_rate = 1 / c->t_one;
    for (int32_t k = draft_min; k <= draft_max; k++) {
        double rate = expected_rate(c, a, k);
        if (rate > best_rate * 1.02) /* a margin: the estimates are noisy */
            best = k, best_rate = rate;
    }
    if (c->probe_after == 0)
        c->probe_after = 16;
    if (best == 0 && ++c->plain_rounds >= c->probe_after) {
        c->plain_rounds = 0;
        c->probe_after = c->probe_after < 512 ? 2 * c->probe_after : 512;
        return draft_min;
    }
    if (best)
        c->plain_rounds = 0, c->probe_after = 16;
    return best;
}

static void note_round(spec_control *c, int32_t k, int32_t accepted, double pass_ms,
                       double draft_ms)
{
    if (k == 0) {
        c->t_one = ema(c->t_one, pass_ms);
        return;
    }
    if (c->t_one > 0)
        c->t_extra = ema(c->t_extra, fmax(0, pass_ms - c->t_one) / k);
    c->t_draft = ema(c->t_draft, draft_ms / k);
    c->ok = 0.9 * c->ok + accepted;
    c->miss = 0.9 * c->miss + (accepted < k);
}

/* A drafter model that proposed nothing (its first token below p_min) cost its time for no
 * token: counted as one rejected proposal of that cost. */
static void note_declined(spec_control *c, double draft_ms)
{
    c->t_draft = ema(c->t_draft, draft_ms);
    c->miss = 0.9 * c->miss + 1;
    c->ok *= 0.9;
}

/* ---- The loop ---------------------------------------------------------------------------- */

/* loom_generate_from and loom_generate_speculative: the prompt at positions pos0.. after
 * `before`, the pos0 ids the cache holds (NULL: not known; a drafter model then cannot follow
 * and prompt lookup sees the prompt on). */
static int generate(loom_model *m, const loom_speculation *spec, const loom_constraint *c,
                    const int32_t *before, const int32_t *prompt, int32_t n_prompt, int32_t pos0,
                    int32_t n_predict, const loom_sampling *s, loom_token_fn on_token, void *user,
                    loom_generation *stats, char *err, size_t err_size)
{
    loom_generation st = {.n_prompt = n_prompt};
    struct loom_runner *runner = loom_model_runner(m);
    /* a model with recurrent layers keeps a checkpoint of its state in slot 1 during a pass */
    const int recurrent = loom_runner_state_slots(runner) >= 2;
    struct loom_tokenizer *tok = loom_model_tokenizer(m);
    int32_t n_ctx = loom_model_n_ctx(m), n_vocab = loom_model_n_vocab(m);
    if (n_prompt <= 0) {
        snprintf(err, err_size, "the prompt is empty");
        return -1;
    }
    if (pos0 > 0 && !loom_model_extends_cache(m)) {
        snprintf(err, err_size,
                 "%s cannot continue a cached sequence (its prompt prefix attends "
                 "both ways): run the whole prompt from position 0",
                 loom_model_name(m));
        return -1;
    }
    if (pos0 < 0 || pos0 + n_prompt > n_ctx) {
        snprintf(err, err_size,
                 "the prompt has %d tokens but the context holds %d (raise it with "
                 "-c, up to the model's training context)",
                 pos0 + n_prompt, n_ctx);
        return -1;
    }
    if (spec && spec->draft && pos0 > 0 && !before) {
        snprintf(err, err_size,
                 "a draft model needs the whole sequence, not only what follows "
                 "the cached part (loom_generate_speculative)");
        return -1;
    }
    /* text[i] is the id at position base + i: the whole sequence when it is known */
    int32_t n_before = before ? pos0 : 0, base = pos0 - n_before;
    loom_model_draft_cache(m)->n = 0; /* its cache is the target's now */
    int32_t draft_max = spec && spec->draft_max ? spec->draft_max : DRAFT_MAX_DEFAULT;
    int32_t draft_min = spec && spec->draft_min ? spec->draft_min : 1;
    if (n_predict < 0 || pos0 + n_prompt + n_predict > n_ctx)
        n_predict = n_ctx - pos0 - n_prompt;
    loom_sampler_params sp = loom_sampler_params_of(s);
    int sampling = s->temperature > 1e-5f && s->top_k != 1;
    uint64_t rng = s->seed, accept_rng = s->seed ^ 0x9e3779b97f4a7c15ull;
    drafter d;
    int control_text = c && c->control_text;
    grammar_vocab *gv = NULL;
    grammar_matcher *gm = NULL;
    int32_t *text = malloc((size_t)(n_before + n_prompt + n_predict + draft_max + 1) *
                           sizeof *text);
    float *rows = malloc((size_t)(draft_max + 1) * (size_t)n_vocab * sizeof *rows);
    float *p = sampling || (c && c->grammar) ? malloc((size_t)n_vocab * sizeof *p) : NULL;
    char piece[512]; /* a token is at most 512 bytes */
    loom_text_stream ts;
    loom_text_stream_init(&ts, NULL, 0);
    int rc = drafter_init(&d, m, spec, draft_max, s, err, err_size);
    if (rc == 0 && c && c->grammar && d.spec) {
        snprintf(err, err_size, "speculative decoding under a grammar is not supported");
        rc = -1;
    }
    if (rc == 0 && c && c->grammar &&
        (!(gv = grammar_vocab_new(tok, control_text, err, err_size)) ||
         !(gm = grammar_matcher_new(c->grammar, gv, err, err_size))))
        rc = -1;
    if (rc == 0 && (!text || !rows || ((sampling || gm) && !p))) { /* p: gm's scratch too */
        snprintf(err, err_size, "out of memory");
        rc = -1;
    }
    spec_control ctl = {0};
    int32_t n_text = n_before + n_prompt;
    double t0 = now_ms(), t_prefill = 0, t_decode0 = 0;
    if (rc == 0) {
        if (n_before)
            memcpy(text, before, (size_t)n_before * sizeof *text);
        memcpy(text + n_before, prompt, (size_t)n_prompt * sizeof *text);
        rc = loom_runner_eval(runner, prompt, n_prompt, pos0, err, err_size);
        /* the drafter's prefill counts as the prompt's (and warms its weights' layouts) */
        if (rc == 0 && d.model && d.seen->mtp)
            rc = mtp_sync(&d, text, n_text, err, err_size) < 0 ? -1 : 0;
        else if (rc == 0 && d.model)
            rc = drafter_sync(&d, text, n_text, err, err_size);
        t_prefill = now_ms() - t0, t_decode0 = now_ms();
    }
    if (rc == 0) {
        memcpy(loom_model_prompt_logits_buffer(m), loom_runner_logits(runner),
               (size_t)n_vocab * sizeof(float));
        memcpy(rows, loom_runner_logits(runner), (size_t)n_vocab * sizeof *rows);
    }
    /* Each round: rows[0] is the next token's logits; rows[1..k] those after each of the k
     * proposals text[n_text..n_text + k), when there were any. */
    int32_t k = 0, done = n_predict == 0, measured = 0;
    double pass_ms = 0, draft_ms = 0; /* the last round's, noted once its outcome is known */
    while (rc == 0 && !done) {
        /* the round's new tokens: accepted proposals, then one of the model's own */
        int32_t n_new = 0, accepted = 0;
        for (int32_t i = 0; i <= k; i++) {
            float *row = rows + (size_t)i * (size_t)n_vocab;
            loom_model_mask_unsampled(m, row);
            int32_t next;
            if (i < k && !sampling) {
                next = loom_sampler_sample(row, n_vocab, &sp, text, n_text + i, &rng);
            } else if (i < k) {
                const float *q = d.model ? d.q + (size_t)i * (size_t)n_vocab : NULL;
                if (loom_sampler_probs(row, n_vocab, &sp, text, n_text + i, p) != 0) {
                    snprintf(err, err_size, "out of memory");
                    rc = -1;
                    break;
                }
                next = loom_sampler_verify(p, q, text[n_text + i], n_vocab, &accept_rng, &rng);
            } else if (gm) {
                next = grammar_sample(gm, row, p, n_vocab, &sp, text, n_text, &rng, err, err_size);
                if (next == -2) {
                    rc = -1;
                    break;
                }
                if (next == -1) { /* the grammar is complete, and so is the answer */
                    done = 1;
                    break;
                }
            } else {
                next = loom_sampler_sample(row, n_vocab, &sp, text, n_text + i, &rng);
            }
            n_new++;
            if (i < k && next == text[n_text + i]) {
                accepted++;
                continue;
            }
            text[n_text + i] = next;
            break;
        }
        if (rc != 0 || done)
            break;
        /* recurrent layers ran every proposal: back to the checkpoint before the pass, then
         * again over what was kept (the KV slots are rewritten with the same values) */
        if (recurrent && k > 0 && accepted < k) {
            rc = loom_runner_state_copy(runner, 1, 0, err, err_size);
            if (rc == 0)
                rc = loom_runner_eval(runner, text + n_text - 1, accepted + 1, base + n_text - 1,
                                      err, err_size);
            if (rc != 0)
                break;
        }
        if (k > 0)
            st.n_accepted += accepted;
        if (d.spec && measured)
            note_round(&ctl, k, accepted, pass_ms, draft_ms);
        /* hand them out as a plain loop would, one by one */
        for (int32_t i = 0; rc == 0 && i < n_new; i++) {
            int32_t next = text[n_text];
            if (st.n_generated == 0 && i == 0)
                st.ttft_ms = now_ms() - t0;
            if ((!s->ignore_eos || gm) && loom_tokenizer_is_stop(tok, next)) {
                st.stopped_at_eos = 1;
                done = 1;
                break;
            }
            if (gm && grammar_accept(gm, next) != 0) { /* the draw keeps to the mask */
                snprintf(err, err_size, "internal: a token outside the grammar was drawn");
                rc = -1;
                break;
            }
            n_text++;
            st.n_generated++;
            int len = (control_text ? loom_tokenizer_piece_control : loom_tokenizer_piece)(
                tok, text[n_text - 2], next, piece, sizeof piece);
            loom_text_stream_push(&ts, piece, len > 0 ? (size_t)len : 0);
            if ((on_token && on_token(user, next, ts.out, ts.n_out)) ||
                st.n_generated >= n_predict) {
                done = 1;
                break;
            }
        }
        if (rc != 0 || done)
            break;
        /* the next round's proposals, then one pass over the last token and them */
        int32_t room = n_predict - st.n_generated - 1; /* the pass's own token counts too */
        int32_t want = d.spec ? choose_k(&ctl, d.spec, draft_min, draft_max) : 0;
        if (want > room)
            want = room;
        double t_draft = now_ms();
        k = 0;
        if (want > 0 && d.model)
            k = model_draft(&d, text, n_text, want, &sp, sampling, text + n_text, err, err_size);
        else if (want > 0)
            k = loom_lookup_draft(text, n_text, d.spec->lookup, want, text + n_text);
        if (k < 0) {
            rc = -1;
            break;
        }
        if (k > 0 && k < draft_min)
            k = 0;
        double t_pass = now_ms();
        draft_ms = t_pass - t_draft;
        if (recurrent && k > 0 && loom_runner_state_copy(runner, 0, 1, err, err_size) != 0) {
            rc = -1;
            break;
        }
        rc = loom_runner_eval_all(runner, text + n_text - 1, k + 1, base + n_text - 1, rows, err,
                                  err_size);
        pass_ms = now_ms() - t_pass;
        /* a round that wanted proposals and got none says nothing of a plain pass's cost;
         * but a drafter model that declined still cost its time */
        measured = k > 0 || want == 0;
        if (want > 0 && k == 0 && d.model)
            note_declined(&ctl, draft_ms);
        if (k > 0) {
            st.n_drafted += k;
            st.n_verify++;
        }
    }
    loom_text_stream_flush(&ts);
    if (rc == 0 && ts.n_out && on_token)
        on_token(user, -1, ts.out, ts.n_out); /* whatever is left, even if incomplete */
    loom_text_stream_free(&ts);
    double t_decode = now_ms() - t_decode0;
    st.prefill_tok_s = t_prefill > 0 ? n_prompt / (t_prefill / 1e3) : 0;
    st.decode_tok_s = t_decode > 0 && st.n_generated > 1 ? (st.n_generated - 1) / (t_decode / 1e3)
                                                         : 0;
    if (stats)
        *stats = st;
    drafter_free(&d);
    grammar_matcher_free(gm);
    grammar_vocab_free(gv);
    free(text), free(rows), free(p);
    return rc;
}

int loom_generate_speculative(loom_model *m, const loom_speculation *spec, const int32_t *ids,
                              int32_t n_ids, int32_t n_cached, int32_t n_predict,
                              const loom_sampling *s, loom_token_fn on_token, void *user,
                              loom_generation *stats, char *err, size_t err_size)
{
    if (n_cached < 0 || n_cached >= n_ids) {
        snprintf(err, err_size, "%d of %d tokens cached: at least one must be new", n_cached,
                 n_ids);
        return -1;
    }
    /* recurrent layers hold the conversation in a state that cannot be cut back: a cached
     * prefix shorter than what the state has seen is recomputed from the start */
    const loom_runner *r = loom_model_runner(m);
    if (n_cached && loom_runner_state_slots(r) && loom_runner_state_position(r, 0) != n_cached)
        n_cached = 0;
    return generate(m, spec, NULL, ids, ids + n_cached, n_ids - n_cached, n_cached, n_predict, s,
                    on_token, user, stats, err, err_size);
}

int loom_generate_from(loom_model *m, const int32_t *prompt, int32_t n_prompt, int32_t pos0,
                       int32_t n_predict, const loom_sampling *s, loom_token_fn on_token,
                       void *user, loom_generation *stats, char *err, size_t err_size)
{
    return generate(m, NULL, NULL, NULL, prompt, n_prompt, pos0, n_predict, s, on_token, user,
                    stats, err, err_size);
}

int loom_generate_constrained(loom_model *m, const loom_constraint *c, const int32_t *prompt,
                              int32_t n_prompt, int32_t pos0, int32_t n_predict,
                              const loom_sampling *s, loom_token_fn on_token, void *user,
                              loom_generation *stats, char *err, size_t err_size)
{
    return generate(m, NULL, c, NULL, prompt, n_prompt, pos0, n_predict, s, on_token, user, stats,
                    err, err_size);
}

int loom_generate(loom_model *m, const int32_t *prompt, int32_t n_prompt, int32_t n_predict,
                  const loom_sampling *s, loom_token_fn on_token, void *user,
                  loom_generation *stats, char *err, size_t err_size)
{
    return loom_generate_from(m, prompt, n_prompt, 0, n_predict, s, on_token, user, stats, err,
                              err_size);
}
