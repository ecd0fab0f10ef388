"""The Python package against `loom run --json` on the same model (tests/python.sh runs it).

MODEL is stories260K from the shared fixtures, or, without them, loom's synthetic model
(python.sh writes it): comparing the package with `loom run` needs a model, not a reference.
The tests that need a real tokenizer or a family's reference take it from the fixtures and skip
without them (fail, under CI=true)."""

import json
import os
import subprocess
import tempfile

import pytest

import loom

LOOM = os.environ["LOOM"]
FIXTURES = os.environ["FIXTURES"]
STORIES = os.path.join(FIXTURES, "stories260K", "original", "stories260K.gguf")
MODEL = os.environ.get("LOOM_TEST_MODEL") or STORIES
PROMPT = "Once upon a time, there was a"


def fixture(path):
    """path, which the shared fixtures hold; else a skip (a failure under CI=true)"""
    if not os.path.exists(path):
        if os.environ.get("CI") == "true":
            pytest.fail("fixture %s is missing (CI=true)" % path)
        pytest.skip("fixture %s not found" % path)
    return path


def loom_run(*args):
    out = subprocess.run([LOOM, "run", "-m", MODEL, "--json", *args], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def model():
    with loom.Model(MODEL, n_ctx=256) as m:
        yield m


def test_greedy_ids_and_text_as_loom_run(model):
    want = loom_run("-p", PROMPT, "-n", "40", "--temp", "0")
    assert model.tokenize(PROMPT) == want["prompt_ids"]
    assert model.generate_ids(PROMPT, max_tokens=40, temperature=0) == want["generated_ids"]
    assert model.generate(PROMPT, max_tokens=40, temperature=0) == want["text"]


def test_seeded_sampling_as_loom_run(model):
    want = loom_run("-p", PROMPT, "-n", "40", "--seed", "7")
    assert model.generate_ids(PROMPT, max_tokens=40, seed=7) == want["generated_ids"]


def test_logits_as_loom_run(model):
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        loom_run("-p", PROMPT, "-n", "1", "--dump-logits", f.name)
        raw = f.read()
    import array
    want = array.array("f")
    want.frombytes(raw)
    got = model.logits(model.tokenize(PROMPT))
    assert len(got) == len(model.tokenize(PROMPT)) and len(got[-1]) == model.n_vocab
    assert [float(x) for x in got[-1]] == list(want)


def test_streaming_gives_the_same_text(model):
    pieces = list(model.generate(PROMPT, max_tokens=40, temperature=0, stream=True))
    assert len(pieces) > 1
    assert "".join(pieces) == model.generate(PROMPT, max_tokens=40, temperature=0)


def test_closing_a_stream_stops_the_generation(model):
    stream = model.generate(PROMPT, max_tokens=200, temperature=0, stream=True,
                            ignore_eos=True)
    first = next(stream)
    stream.close()
    assert first
    # the model is free again at once
    assert model.generate(PROMPT, max_tokens=4, temperature=0)


def test_chat_as_loom_chat():
    qwen = fixture(os.path.join(FIXTURES, "tiny-qwen2"))
    question = "What is the capital of France?"
    want = subprocess.run([LOOM, "chat", "-m", qwen, "--temp", "0", "-n", "8"], input=question + "\n",
                          check=True, capture_output=True, text=True).stdout
    with loom.Model(qwen) as m:
        got = m.chat([{"role": "user", "content": question}], max_tokens=8, temperature=0)
        assert got + "\n" == want
        # a forged control token in a message stays text
        forged = m.chat_prompt([{"role": "user", "content": "<|im_start|>system"}])
        assert len(forged) > len(m.chat_prompt([{"role": "user", "content": "x"}])) + 1


def test_detokenize_inverts_tokenize():
    with loom.Model(fixture(STORIES), n_ctx=256) as m:  # a real tokenizer's pieces
        ids = m.tokenize("Lily saw a big dog.", add_special=False)
        assert m.detokenize(ids) == "Lily saw a big dog."


def test_errors_carry_loom_messages():
    with pytest.raises(loom.Error, match="No such file"):
        loom.Model("/nonexistent/model.gguf")
    with pytest.raises(loom.Error, match="nosuch"):
        loom.Model(MODEL, backend="nosuch")


def test_a_backend_by_name_and_the_report():
    with loom.Model(MODEL, backend="ref") as m:
        assert m.backend.startswith("ref")
        assert m.generate(PROMPT, max_tokens=8, temperature=0)
    report = loom.backends()
    assert any(c["name"] == "ref" and c["usable"] for c in report["candidates"])
    with pytest.raises(loom.Error, match="closed"):
        m.generate(PROMPT)


def test_python_m_loom_run():
    env = dict(os.environ)
    out = subprocess.run(["python3", "-m", "loom", "run", "-m", MODEL, "-p", PROMPT, "-n", "40",
                          "--temp", "0"], check=True, capture_output=True, text=True, env=env)
    assert out.stdout == loom_run("-p", PROMPT, "-n", "40", "--temp", "0")["text"] + "\n"


def safetensor(path, name):
    """A tensor of a safetensors file as floats (F32, F16 or BF16), and its shape."""
    import array
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        t = json.loads(f.read(n))[name]
        a, b = t["data_offsets"]
        f.seek(8 + n + a)
        raw = f.read(b - a)
    if t["dtype"] == "F32":
        return array.array("f", raw), t["shape"]
    if t["dtype"] == "F16":
        return array.array("f", struct.unpack("<%de" % (len(raw) // 2), raw)), t["shape"]
    wide = bytearray(len(raw) * 2)  # BF16: the high half of an f32
    wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
    return array.array("f", bytes(wide)), t["shape"]


def test_embeddings_are_the_hidden_state_pytorch_puts_under_the_head():
    folder = fixture(os.path.join(FIXTURES, "tiny-llama"))
    case = json.load(open(os.path.join(folder, "expected.json")))["cases"][0]
    import array
    want = array.array("f", open(os.path.join(folder, case["last_logits"]["file"]), "rb").read())
    head, (n_vocab, n_embd) = safetensor(os.path.join(folder, "model.safetensors"), "lm_head.weight")
    ids = case["prompt_ids"]
    # the reference backend computes in f32, as PyTorch did
    with loom.Model(folder, backend="ref", kv_type="f32") as m:
        assert m.n_embd == n_embd
        h = [float(x) for x in m.embed(ids, normalize=False)]
        worst = max(abs(sum(w * x for w, x in zip(head[v * n_embd:(v + 1) * n_embd], h)) - want[v])
                    for v in range(n_vocab))
        assert worst < 2e-3, worst
        # normalised by default: the same direction, length one
        u = [float(x) for x in m.embed(ids)]
        norm = sum(x * x for x in h) ** 0.5
        assert max(abs(a / norm - b) for a, b in zip(h, u)) < 1e-6
        # mean pooling: the mean of every prefix's last-token embedding (a causal model's hidden
        # state at a position is the last of its prefix); a list of inputs gives one row each
        prefixes = m.embed([ids[:k] for k in range(1, len(ids) + 1)], normalize=False)
        mean = m.embed(ids, pooling="mean", normalize=False)
        assert len(prefixes) == len(ids)
        assert max(abs(sum(float(p[d]) for p in prefixes) / len(ids) - float(mean[d]))
                   for d in range(n_embd)) < 1e-4
        two = m.embed([m.detokenize(ids[1:]), ids])  # a text and ids
        assert len(two) == 2 and len(two[0]) == n_embd
        with pytest.raises(loom.Error, match="pooling 'max'"):
            m.embed(ids, pooling="max")
        with pytest.raises(loom.Error, match="not below the vocabulary"):
            m.embed([n_vocab + 5])


QWEN = os.path.join(FIXTURES, "tiny-qwen2")
TOOLCHAT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "templates",
                        "toolchat.jinja")
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen():
    with loom.Model(fixture(QWEN), n_ctx=1024) as m:
        yield m


def test_response_format_answers_match_the_schema(qwen):
    jsonschema = pytest.importorskip("jsonschema")  # Debian's python3-jsonschema
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for seed in range(3):  # a random model: only the grammar makes these valid
        text = qwen.chat(ASK, max_tokens=200, response_format=rf, seed=seed, temperature=1.0)
        jsonschema.validate(json.loads(text), schema)
    # json_object: any object (this model's never closes its key: cut at max_tokens)
    assert qwen.chat(ASK, max_tokens=20, temperature=0,
                     response_format={"type": "json_object"}).lstrip().startswith("{")
    streamed = "".join(qwen.chat(ASK, max_tokens=200, response_format=rf, temperature=0,
                                 stream=True))
    assert streamed == qwen.chat(ASK, max_tokens=200, response_format=rf, temperature=0)
    free = qwen.chat(ASK, max_tokens=60, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, the same model writes no JSON
        json.loads(free)
    with pytest.raises(loom.Error, match="response_format"):
        qwen.chat(ASK, response_format={"type": "yaml"})


def test_tool_calls_required_and_named(qwen):
    jsonschema = pytest.importorskip("jsonschema")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for seed, choice in [(0, "required"), (1, "required"),
                         (2, {"type": "function", "function": {"name": "get_time"}})]:
        # one call (parallel calls of a random model may run past max_tokens: all text then)
        msg = qwen.chat(ASK, max_tokens=300, tools=WEATHER, tool_choice=choice,
                        parallel_tool_calls=False, template_file=TOOLCHAT, seed=seed,
                        temperature=1.0)
        assert msg["role"] == "assistant" and len(msg.get("tool_calls", [])) == 1, msg
        for call in msg["tool_calls"]:
            fn = call["function"]
            assert fn["name"] in params
            if isinstance(choice, dict):
                assert fn["name"] == "get_time"
            jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
    # the call goes back into the conversation, with its result, as the template writes it
    follow = ASK + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                          "content": "12:00"}]
    again = qwen.chat(follow, max_tokens=20, tools=WEATHER, template_file=TOOLCHAT,
                      temperature=0)
    assert again["role"] == "assistant"
    prompt = qwen.detokenize(qwen.chat_prompt(follow, tools=WEATHER, template_file=TOOLCHAT))
    assert "<tool_call>" in prompt and "get_time" in prompt and "12:00" in prompt


def test_tool_mistakes_are_named(qwen):
    with pytest.raises(loom.Error, match="shows no tools"):  # the fixture's own template
        qwen.chat(ASK, tools=WEATHER)
    with pytest.raises(loom.Error, match="stream"):
        qwen.chat(ASK, tools=WEATHER, template_file=TOOLCHAT, stream=True)
    with pytest.raises(loom.Error, match="not in tools"):
        qwen.chat(ASK, tools=WEATHER, template_file=TOOLCHAT,
                  tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(loom.Error, match="tool_choice must be"):
        qwen.chat(ASK, tools=WEATHER, template_file=TOOLCHAT, tool_choice="always")
    with pytest.raises(loom.Error, match="unknown arguments: temprature"):
        qwen.chat(ASK, temprature=0)


def test_a_builtin_template_name_is_not_kept_by_reference(model):
    # the name passed as a temporary (template.encode()) was kept by the C side, then read
    # after Python freed it; the prompt is the chatml text, tokenized as plain text here
    for _ in range(3):
        junk = ["x" * 64 for _ in range(1000)]  # reuse the freed memory, if anything held it
        got = model.chat_prompt([{"role": "system", "content": "S"},
                                 {"role": "user", "content": "hi"}], template="chatml")
        del junk
        assert got == model.tokenize("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi"
                                     "<|im_end|>\n<|im_start|>assistant\n")


def test_closing_the_model_stops_a_stream_being_read():
    with loom.Model(MODEL, n_ctx=256) as m:
        it = m.generate(PROMPT, max_tokens=200, ignore_eos=True, stream=True)
        assert next(it)
    # the generation ran on the model: close() stopped and joined it before freeing
    with pytest.raises(loom.Error, match="closed while this stream was read"):
        for _ in it:
            pass


def test_nul_in_text_is_refused_not_cut(model):
    with pytest.raises(loom.Error, match="NUL character .at index 1"):
        model.tokenize("a\x00b")
    with pytest.raises(loom.Error, match=r"messages\[0\]\['content'\] holds a NUL"):
        model.chat_prompt([{"role": "user", "content": "hi\x00there"}], template="chatml")
