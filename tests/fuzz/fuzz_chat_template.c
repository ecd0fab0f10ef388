/*
 * tests/fuzz/fuzz_chat_template.c - libFuzzer harness for the chat templates: the input is a
 * template choice and a conversation (NUL-separated role and content strings); every template
 * must render it or refuse it with a message, and the spans it reports for the messages' text
 * must lie inside the output, in order, and hold exactly text from the messages (what the
 * tokenizer trusts when it keeps special tokens out of them).
 */
#include <loom/loom.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const templates[] = {"llama2", "llama3", "chatml", "chatglm3", "glm4"};
static const char *const roles[] = {"system", "user", "assistant", "tool"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    char *text = malloc(size + 1);
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    loom_chat_message msgs[16];
    int n = 0;
    for (char *p = text; n < 16 && p < text + size - 1; p += strlen(p) + 1, n++) {
        msgs[n].role = roles[(unsigned char)p[0] % 4];
        msgs[n].content = p[0] ? p + 1 : p;
    }
    char *out = NULL, err[256];
    loom_text_span *spans = NULL;
    int n_spans = 0;
    const char *name = templates[data[0] % 5];
    if (loom_chat_render_spans(name, msgs, n, data[0] & 0x80, &out, &spans, &n_spans, err,
                               sizeof err) == 0) {
        size_t len = strlen(out), prev = 0;
        for (int k = 0; k < n_spans; k++) {
            if (spans[k].start < prev || spans[k].end < spans[k].start || spans[k].end > len)
                __builtin_trap();
            prev = spans[k].end;
        }
        free(out);
        free(spans);
    } else if (!err[0]) {
        __builtin_trap();
    }
    free(text);
    return 0;
}
