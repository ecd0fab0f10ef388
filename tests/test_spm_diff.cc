/*
 * tests/test_spm_diff.cc - loom's SentencePiece tokenizers against the sentencepiece library
 * itself (Debian's libsentencepiece-dev), string by string, on every SentencePiece model in the
 * fixtures: Llama-2 (tiny-llama), stories260K, ChatGLM2/3 (tiny-chatglm3) and ChatGLM-6B
 * (ice_text.model, through its Hugging Face tokenizer's rewriting of newlines, tabs and space
 * runs, which is part of that family's reference). The corpus: tests/spm_corpus.txt (strings
 * that once told loom and the library apart, kept) and a few thousand generated ones per model
 * (random text across scripts, control characters, whitespace runs, emoji with ZWJ and skin-tone
 * modifiers, fullwidth forms and combining marks, repeated characters).
 *
 * C++ only because the reference is a C++ library; loom is used through its C API.
 */
#include <sentencepiece_processor.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <fstream>
#include <random>
#include <string>
#include <vector>

extern "C" {
#include <loom/loom.h>
}

static int failures, checks;

static std::string utf8(uint32_t cp)
{
    std::string s;
    if (cp < 0x80) {
        s += (char)cp;
    } else if (cp < 0x800) {
        s += (char)(0xc0 | cp >> 6), s += (char)(0x80 | (cp & 63));
    } else if (cp < 0x10000) {
        s += (char)(0xe0 | cp >> 12), s += (char)(0x80 | ((cp >> 6) & 63));
        s += (char)(0x80 | (cp & 63));
    } else {
        s += (char)(0xf0 | cp >> 18), s += (char)(0x80 | ((cp >> 12) & 63));
        s += (char)(0x80 | ((cp >> 6) & 63)), s += (char)(0x80 | (cp & 63));
    }
    return s;
}

static std::string random_text(std::mt19937 &g)
{
    static const uint32_t ranges[][2] = {
        {0x20, 0x7e},       {0x4e00, 0x9fff}, {0x3040, 0x30ff},   {0x400, 0x4ff}, {0x600, 0x6ff},
        {0x1f300, 0x1f64f}, {0x200b, 0x200f}, {0x1f3fb, 0x1f3ff}, {0x1, 0x1f},    {0xff01, 0xff5e},
        {0xa0, 0xff},       {0x300, 0x36f},   {0xac00, 0xd7a3},   {0x30, 0x39}};
    const size_t n_ranges = sizeof ranges / sizeof ranges[0];
    std::string s;
    int n = (int)(g() % 24) + 1;
    for (int i = 0; i < n; i++) {
        const uint32_t *r = ranges[g() % n_ranges];
        uint32_t cp = r[0] + g() % (r[1] - r[0] + 1);
        if (g() % 5 == 0)
            cp = ' ';
        else if (g() % 17 == 0)
            cp = 0x200d; /* zero-width joiner */
        else if (g() % 23 == 0)
            cp = g() % 2 ? '\n' : '\t';
        int repeat = g() % 10 == 0 ? (int)(g() % 12) + 1 : 1;
        for (int k = 0; k < repeat; k++)
            s += utf8(cp);
    }
    return s;
}

/* ChatGLM-6B's Hugging Face tokenizer rewrites text before SentencePiece sees it. */
static std::string glm_rewrite(std::string t)
{
    auto replace = [&](const std::string &a, const std::string &b) {
        for (size_t p = 0; (p = t.find(a, p)) != std::string::npos; p += b.size())
            t.replace(p, a.size(), b);
    };
    replace("\n", "<n>");
    replace("\t", "<|tab|>");
    for (int i = 80; i >= 2; i--)
        replace(std::string((size_t)i, ' '), "<|blank_" + std::to_string(i) + "|>");
    return t;
}

static std::string hex(const std::string &s)
{
    std::string h;
    char b[4];
    for (unsigned char c : s)
        snprintf(b, sizeof b, "%02x", c), h += b;
    return h;
}

static std::vector<std::string> fixed_corpus(const char *path)
{
    std::vector<std::string> out;
    std::ifstream f(path);
    for (std::string line; std::getline(f, line);) {
        if (line.empty() || line[0] == '#')
            continue;
        std::string s;
        for (size_t i = 0; line != "-" && i + 1 < line.size(); i += 2)
            s += (char)std::strtol(line.substr(i, 2).c_str(), nullptr, 16);
        out.push_back(s);
    }
    return out;
}

/* Which special-token strings a user's text may name, and what the reference does with them:
 * `inject` are written into the generated strings; `parsed` (text, id) are the ones the
 * family's reference tokenizer reads as the token, splitting the text there and encoding each
 * stretch on its own (ChatGLM3's tokenizer with encode_special_tokens). */
struct special_rule {
    std::vector<std::string> inject;
    std::vector<std::pair<std::string, int>> parsed;
};

static std::string with_specials(std::mt19937 &g, const special_rule &r)
{
    std::string s = random_text(g);
    for (int k = (int)(g() % 3) + 1; k > 0; k--)
        s += r.inject[g() % r.inject.size()] + (g() % 2 ? random_text(g) : std::string());
    return s;
}

static std::vector<int> reference_ids(sentencepiece::SentencePieceProcessor &sp,
                                      const std::string &s, bool glm, const special_rule *rule)
{
    std::vector<int> out, part;
    size_t at = 0;
    while (rule) {
        size_t best = std::string::npos, best_len = 0;
        int id = -1;
        for (const auto &p : rule->parsed) {
            size_t f = s.find(p.first, at);
            if (f < best || (f == best && p.first.size() > best_len))
                best = f, best_len = p.first.size(), id = p.second;
        }
        if (best == std::string::npos)
            break;
        if (best > at) {
            sp.Encode(s.substr(at, best - at), &part);
            out.insert(out.end(), part.begin(), part.end());
        }
        out.push_back(id);
        at = best + best_len;
    }
    if (at < s.size() || !rule) {
        sp.Encode(glm ? glm_rewrite(s.substr(at)) : s.substr(at), &part);
        out.insert(out.end(), part.begin(), part.end());
    }
    return out;
}

/* special: LOOM_SPECIAL_NONE or _TEXT (the family's rule for a user's text); rule: NULL for
 * plain generated strings, else strings with its special-token strings written in */
static void compare(const char *name, const char *model, const char *loom_path, bool glm,
                    const std::vector<std::string> &corpus, int n_random, int special,
                    const special_rule *rule)
{
    sentencepiece::SentencePieceProcessor sp;
    char err[1024];
    loom_vocab *v = nullptr;
    if (!sp.Load(model).ok() || !(v = loom_vocab_open(loom_path, err, sizeof err))) {
        fprintf(stderr, "FAIL: %s: cannot open %s / %s: %s\n", name, model, loom_path,
                v ? "" : err);
        failures++;
        return;
    }
    std::mt19937 g(2026);
    int differ = 0, total = 0;
    for (int i = 0; i < (int)corpus.size() + n_random; i++) {
        std::string s = i < (int)corpus.size() ? corpus[(size_t)i]
            : rule                             ? with_specials(g, *rule)
                                               : random_text(g);
        std::vector<int> want = reference_ids(sp, s, glm, special ? rule : nullptr);
        std::vector<int32_t> got(s.size() * 4 + 16);
        int64_t n = loom_vocab_encode(v, s.c_str(), 0, special, got.data(), (int64_t)got.size());
        bool same = n == (int64_t)want.size();
        for (size_t k = 0; same && k < want.size(); k++)
            same = got[k] == want[k];
        total++;
        if (!same && ++differ <= 3) {
            fprintf(stderr, "%s: the string %s (hex) tokenizes as", name, hex(s).c_str());
            for (int w : want)
                fprintf(stderr, " %d", w);
            fprintf(stderr, "\n  in the reference, and in loom as");
            for (int64_t k = 0; k < n && k < (int64_t)got.size(); k++)
                fprintf(stderr, " %d", got[(size_t)k]);
            fprintf(stderr, "\n");
        }
    }
    checks++;
    if (differ) {
        fprintf(stderr, "FAIL: %s: %d of %d strings tokenize differently\n", name, differ, total);
        failures++;
    } else {
        printf("ok: %s: %d strings, each as the reference tokenizes it\n", name, total);
    }
    loom_vocab_close(v);
}

int main()
{
    const char *fx = getenv("LOOM_FIXTURES");
    std::string dir = fx && *fx
        ? fx
        : std::string(getenv("top_srcdir") ? getenv("top_srcdir") : ".") + "/../shared/fixtures";
    std::string top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
    if (!std::ifstream(dir + "/stories260K/tokenizer.model")) {
        const char *ci = getenv("CI");
        if (ci && !strcmp(ci, "true")) {
            fprintf(stderr, "FAIL: fixtures missing under CI=true: %s\n", dir.c_str());
            return 1;
        }
        printf("SKIP: fixtures not found in %s\n", dir.c_str());
        return 77;
    }
    std::vector<std::string> corpus = fixed_corpus((top + "/tests/spm_corpus.txt").c_str());
    int n = getenv("LOOM_SPM_DIFF_N") ? atoi(getenv("LOOM_SPM_DIFF_N")) : 3000;
    /* plain text, then text with special-token strings that must stay characters */
    special_rule llama = {{"<s>", "</s>", "<unk>", "<0x41>", "[INST]", "<<SYS>>"}, {}};
    for (const char *m : {"tiny-llama", "stories260K", "tiny-chatglm3"}) {
        std::string spm = dir + "/" + m + "/tokenizer.model", path = dir + "/" + m;
        compare(m, spm.c_str(), path.c_str(), false, corpus, n, LOOM_SPECIAL_NONE, nullptr);
        compare((std::string(m) + ", specials as text").c_str(), spm.c_str(), path.c_str(), false,
                {}, n / 3, LOOM_SPECIAL_NONE, &llama);
    }
    /* ChatGLM3 (tokenizer_config.json: encode_special_tokens): the four role tokens are read
     * in text, the other five of ChatGLM's specials never are (the fixture's README) */
    const int glm3_pieces = 64789;
    special_rule glm3 = {{"[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>",
                          "<|assistant|>", "<|observation|>", "<s>", "</s>"},
                         {{"<|system|>", glm3_pieces + 5},
                          {"<|user|>", glm3_pieces + 6},
                          {"<|assistant|>", glm3_pieces + 7},
                          {"<|observation|>", glm3_pieces + 8}}};
    compare("tiny-chatglm3, specials in text", (dir + "/tiny-chatglm3/tokenizer.model").c_str(),
            (dir + "/tiny-chatglm3").c_str(), false, {}, n / 3, LOOM_SPECIAL_TEXT, &glm3);
    compare("tiny-chatglm3, its specials as text", (dir + "/tiny-chatglm3/tokenizer.model").c_str(),
            (dir + "/tiny-chatglm3").c_str(), false, {}, n / 3, LOOM_SPECIAL_NONE, &glm3);
    /* ChatGLM-6B's tokenizer alone (no model): through loom's converter */
    char gguf[] = "/tmp/loom-spm-diff-XXXXXX", err[1024];
    int fd = mkstemp(gguf);
    if (fd >= 0)
        close(fd);
    if (loom_convert_tokenizer((dir + "/tokenizers/chatglm1").c_str(), gguf, err, sizeof err) !=
        0) {
        fprintf(stderr, "FAIL: converting ice_text.model: %s\n", err);
        failures++;
    } else {
        std::string ice = dir + "/tokenizers/chatglm1/ice_text.model";
        compare("ChatGLM-6B (ice_text.model)", ice.c_str(), gguf, true, corpus, n,
                LOOM_SPECIAL_NONE, nullptr);
        /* chatglm.cpp reads no special token in text: all of it goes through SentencePiece */
        special_rule glm1 = {{"[MASK]", "[gMASK]", "<sop>", "<eop>", "<s>", "</s>", "<n>"}, {}};
        compare("ChatGLM-6B, specials in text", ice.c_str(), gguf, true, {}, n / 3,
                LOOM_SPECIAL_TEXT, &glm1);
    }
    printf("test_spm_diff: %d comparisons, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
