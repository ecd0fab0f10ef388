"""loom from Python: a ctypes binding of libloom (include/loom/loom.h).

    import loom
    with loom.Model("stories260K.gguf", backend="cpu") as m:
        print(m.generate("Once upon a time", max_tokens=32, temperature=0))
        for piece in m.generate("Once upon a time", max_tokens=32, stream=True):
            print(piece, end="", flush=True)

A Model is not thread-safe: use one per thread (each holds its own KV cache). Calls into libloom
release the GIL (ctypes does), so other Python threads run while a model generates.

libloom is found by LOOM_LIBRARY (a path), else as the system's libloom.so.0.
"""

import ctypes
import ctypes.util
import json
import os
import queue
import tempfile
import threading
from typing import Iterator, List, Optional, Sequence, Union

__all__ = ["Error", "Model", "backends", "version"]


class Error(Exception):
    """A failure loom reported, with loom's own message."""


def _load():
    path = os.environ.get("LOOM_LIBRARY") or ctypes.util.find_library("loom") or "libloom.so.0"
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise Error(f"cannot load libloom ({path}): {e}; set LOOM_LIBRARY to libloom.so") from e


_lib = _load()
_c = ctypes
_ERR = 4096


class _ModelOptions(_c.Structure):
    _fields_ = [("n_ctx", _c.c_int32), ("kv_type", _c.c_char_p), ("backend", _c.c_char_p),
                ("n_threads", _c.c_int32), ("kv_blocks", _c.c_int32),
                ("kv_sequences", _c.c_int32), ("block_size", _c.c_int32),
                ("backend_module", _c.c_char_p), ("profile", _c.c_int32),
                ("repack", _c.c_int32), ("strict", _c.c_int32), ("trace", _c.c_char_p),
                ("distributed", _c.c_int32), ("stage_layers", _c.c_char_p),
                ("experts_on", _c.c_char_p), ("first_layers", _c.c_int32)]


class _SamplingField(_c.Structure):
    _fields_ = [("name", _c.c_char_p), ("kind", _c.c_int), ("offset", _c.c_size_t)]


def _sampling_struct():
    """loom_sampling as the library lays it out (loom_sampling_fields), not a copy kept here."""
    f = _lib.loom_sampling_fields
    f.restype, f.argtypes = _c.POINTER(_SamplingField), [_c.POINTER(_c.c_int)]
    n = _c.c_int()
    rows = f(_c.byref(n))
    kinds = [_c.c_float, _c.c_int32, _c.c_uint64, _c.c_int]  # loom_sampling_kind's order
    fields = [(rows[i].name.decode(), kinds[rows[i].kind]) for i in range(n.value)]
    cls = type("_Sampling", (_c.Structure,), {"_fields_": fields})
    for i, (name, _t) in enumerate(fields):
        if getattr(cls, name).offset != rows[i].offset:
            raise ImportError("libloom's loom_sampling is laid out otherwise than ctypes lays "
                              "out its fields (%s at %d, not %d)"
                              % (name, rows[i].offset, getattr(cls, name).offset))
    return cls


_Sampling = _sampling_struct()


class _Generation(_c.Structure):
    _fields_ = [("n_prompt", _c.c_int32), ("n_generated", _c.c_int32), ("ttft_ms", _c.c_double),
                ("prefill_tok_s", _c.c_double), ("decode_tok_s", _c.c_double),
                ("stopped_at_eos", _c.c_int), ("n_drafted", _c.c_int32),
                ("n_accepted", _c.c_int32), ("n_verify", _c.c_int32)]


_TOKEN_FN = _c.CFUNCTYPE(_c.c_int, _c.c_void_p, _c.c_int32, _c.POINTER(_c.c_char), _c.c_size_t)


def _fn(name, restype, *argtypes):
    f = getattr(_lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


_version = _fn("loom_version", _c.c_char_p)
_open = _fn("loom_model_open", _c.c_void_p, _c.c_char_p, _c.POINTER(_ModelOptions), _c.c_char_p,
            _c.c_size_t)
_close = _fn("loom_model_close", None, _c.c_void_p)
_backend = _fn("loom_model_backend", _c.c_char_p, _c.c_void_p)
_n_vocab = _fn("loom_model_n_vocab", _c.c_int32, _c.c_void_p)
_n_ctx = _fn("loom_model_n_ctx", _c.c_int32, _c.c_void_p)
_n_embd = _fn("loom_model_n_embd", _c.c_int32, _c.c_void_p)
_name = _fn("loom_model_name", _c.c_char_p, _c.c_void_p)
_tokenize = _fn("loom_tokenize", _c.c_int64, _c.c_void_p, _c.c_char_p, _c.c_int, _c.c_int,
                _c.POINTER(_c.c_int32), _c.c_int64, _c.c_char_p, _c.c_size_t)
_piece = _fn("loom_token_piece", _c.c_int, _c.c_void_p, _c.c_int32, _c.c_int32, _c.c_char_p,
             _c.c_int)
_defaults = _fn("loom_sampling_defaults", _Sampling)


class _Constraint(_c.Structure):
    _fields_ = [("grammar", _c.c_void_p), ("control_text", _c.c_int)]


_generate = _fn("loom_generate_constrained", _c.c_int, _c.c_void_p, _c.POINTER(_Constraint),
                _c.POINTER(_c.c_int32), _c.c_int32, _c.c_int32, _c.c_int32,
                _c.POINTER(_Sampling), _TOKEN_FN, _c.c_void_p, _c.POINTER(_Generation),
                _c.c_char_p, _c.c_size_t)
_grammar_compile = _fn("loom_grammar_compile", _c.c_void_p, _c.c_char_p, _c.c_char_p,
                       _c.c_size_t)
_grammar_from_schema = _fn("loom_grammar_from_json_schema", _c.c_void_p, _c.c_char_p,
                           _c.c_char_p, _c.c_size_t)
_grammar_free = _fn("loom_grammar_free", None, _c.c_void_p)
_embed = _fn("loom_embed", _c.c_int, _c.c_void_p, _c.POINTER(_c.c_int32), _c.c_int32, _c.c_int,
              _c.c_int, _c.POINTER(_c.c_float), _c.c_char_p, _c.c_size_t)
_POOLING = {"last": 1, "mean": 2}  # loom_pooling
_eval_logits = _fn("loom_eval_logits", _c.c_int, _c.c_void_p, _c.POINTER(_c.c_int32), _c.c_int32,
                   _c.POINTER(_c.c_float), _c.c_char_p, _c.c_size_t)


class _ChatFormat(_c.Structure):
    _fields_ = [("jinja", _c.c_void_p), ("builtin", _c.c_char_p), ("about", _c.c_char * 512)]


class _ChatVars(_c.Structure):
    _fields_ = [("messages_json", _c.c_char_p), ("tools_json", _c.c_char_p),
                ("kwargs_json", _c.c_char_p), ("add_generation_prompt", _c.c_int)]


class _Span(_c.Structure):
    _fields_ = [("start", _c.c_size_t), ("end", _c.c_size_t)]


class _ToolCall(_c.Structure):
    _fields_ = [("name", _c.c_char_p), ("arguments", _c.c_char_p), ("id", _c.c_char_p)]


class _ToolCalls(_c.Structure):
    _fields_ = [("content_len", _c.c_size_t), ("calls", _c.POINTER(_ToolCall)),
                ("n_calls", _c.c_int)]


_format_choose = _fn("loom_chat_format_choose", _c.c_int, _c.c_void_p, _c.c_char_p, _c.c_char_p,
                     _c.POINTER(_ChatFormat), _c.c_char_p, _c.c_size_t)
_format_free = _fn("loom_chat_format_free", None, _c.POINTER(_ChatFormat))
_render_vars = _fn("loom_chat_format_render_vars", _c.c_int, _c.POINTER(_ChatFormat),
                   _c.POINTER(_ChatVars), _c.POINTER(_c.c_void_p), _c.POINTER(_c.c_void_p),
                   _c.POINTER(_c.c_int), _c.POINTER(_c.c_int), _c.c_char_p, _c.c_size_t)
_tokenize_spans = _fn("loom_tokenize_spans", _c.c_int64, _c.c_void_p, _c.c_char_p, _c.c_size_t,
                      _c.c_int, _c.c_int, _c.c_void_p, _c.c_int, _c.POINTER(_c.c_int32),
                      _c.c_int64, _c.c_char_p, _c.c_size_t)
_tool_syntax = _fn("loom_chat_format_tool_syntax", _c.c_int, _c.POINTER(_ChatFormat))
_tool_calls_gbnf = _fn("loom_tool_calls_gbnf", _c.c_void_p, _c.c_int, _c.c_char_p, _c.c_char_p,
                       _c.c_int, _c.c_char_p, _c.c_size_t)
_tool_calls_parse = _fn("loom_tool_calls_parse", _c.c_int, _c.c_int, _c.c_char_p, _c.c_size_t,
                        _c.POINTER(_c.c_char_p), _c.c_int, _c.POINTER(_ToolCalls))
_tool_calls_free = _fn("loom_tool_calls_free", None, _c.POINTER(_ToolCalls))
_TOOLS_NONE, _TOOLS_UNKNOWN = 0, 1  # loom_tool_syntax
_libc = _c.CDLL(None)
_libc.free.argtypes = [_c.c_void_p]
_fopen = _libc.fopen
_fopen.restype, _fopen.argtypes = _c.c_void_p, [_c.c_char_p, _c.c_char_p]
_fclose = _libc.fclose
_fclose.argtypes = [_c.c_void_p]
_report = _fn("loom_backends_report", _c.c_int, _c.c_void_p, _c.c_int, _c.c_char_p, _c.c_size_t)


def version() -> str:
    """libloom's version, "MAJOR.MINOR.PATCH"."""
    return _version().decode()


def backends() -> dict:
    """Every backend module found and which a run would use: `loom backends --json`."""
    err = _c.create_string_buffer(_ERR)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        f = _fopen(tmp.name.encode(), b"w")
        if not f:
            raise Error(f"cannot write {tmp.name}")
        _report(f, 1, err, _ERR)
        _fclose(f)
        with open(tmp.name, encoding="utf-8") as r:
            return json.load(r)


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


class _Grammar:
    """A compiled grammar, freed with this object."""

    def __init__(self, g):
        self.g = g

    def __del__(self):
        if self.g:
            _grammar_free(self.g)
            self.g = None

    @classmethod
    def of_format(cls, rf) -> Optional["_Grammar"]:
        """OpenAI's response_format, as loom serve reads it."""
        t = rf.get("type") if isinstance(rf, dict) else None
        if t == "text":
            return None
        if t == "json_object":
            schema = {"type": "object"}
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise Error('response_format json_schema needs "json_schema": {"name": ..., '
                            '"schema": {...}}')
            schema = js.get("schema", {})
        else:
            raise Error("response_format must be {\"type\": ...} with text, json_object or "
                        "json_schema, not %r" % (rf,))
        err = _c.create_string_buffer(_ERR)
        g = _grammar_from_schema(json.dumps(schema).encode(), err, _ERR)
        if not g:
            raise Error("json_schema: " + _text(err.value))
        return cls(g)

    @classmethod
    def of_tools(cls, syntax, tools, only, parallel) -> "_Grammar":
        """An answer of nothing but calls to tools (or to the one named only)."""
        err = _c.create_string_buffer(_ERR)
        gbnf = _tool_calls_gbnf(syntax, json.dumps(list(tools)).encode(),
                                only.encode() if only else None, int(parallel), err, _ERR)
        if not gbnf:
            raise Error("tool_choice %s: %s" % (only or "required", _text(err.value)))
        try:
            g = _grammar_compile(_c.string_at(gbnf), err, _ERR)
        finally:
            _libc.free(gbnf)
        if not g:
            raise Error(_text(err.value))
        return cls(g)


def _message(syntax, text: bytes, names) -> dict:
    """An answer with tool calls as OpenAI's assistant message."""
    arr = (_c.c_char_p * len(names))(*[n.encode() for n in names])
    calls = _ToolCalls()
    if _tool_calls_parse(syntax, text, len(text), arr, len(names), _c.byref(calls)) != 0:
        raise Error("out of memory")
    try:
        content = _text(text[:calls.content_len]).strip()
        out = {"role": "assistant", "content": content or None}
        if calls.n_calls:
            out["tool_calls"] = [
                {"id": _text(c.id) if c.id else "call_%d" % i, "type": "function",
                 "function": {"name": _text(c.name), "arguments": _text(c.arguments)}}
                for i, c in enumerate(calls.calls[:calls.n_calls])]
        return out
    finally:
        _tool_calls_free(_c.byref(calls))


def _no_nul(value, what: str) -> None:
    """Raises Error where a string in value (a text, or a JSON-like structure) holds NUL: loom's
    text ends at NUL, so "a\\x00b" would silently be "a"."""
    if isinstance(value, str):
        if "\x00" in value:
            raise Error("%s holds a NUL character (at index %d); loom does not accept NUL in "
                        "text" % (what, value.index("\x00")))
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul(k, what)
            _no_nul(v, "%s[%r]" % (what, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_nul(v, "%s[%d]" % (what, i))


class Model:
    """A model file (GGUF) or Hugging Face folder, opened on a backend.

    backend: a LOOM_BACKEND-style name ("cpu", "cpu-avx2", "ref", "cuda"); None: the best here.
    n_ctx: the context (0: the model's, up to 4096); threads: CPU threads (0: the default).
    """

    def __init__(self, path: Union[str, os.PathLike], backend: Optional[str] = None,
                 n_ctx: int = 0, threads: int = 0, kv_type: Optional[str] = None):
        self._streams: set = set()  # (stop event, worker thread) of each stream being read
        opts = _ModelOptions(n_ctx=n_ctx, n_threads=threads,
                             backend=backend.encode() if backend else None,
                             kv_type=kv_type.encode() if kv_type else None)
        err = _c.create_string_buffer(_ERR)
        self._m = _open(os.fsencode(path), _c.byref(opts), err, _ERR)
        if not self._m:
            raise Error(_text(err.value))
        self.path = os.fspath(path)

    def close(self) -> None:
        """Frees the model (also at the end of a `with` block). A stream still being read is
        stopped first (its generation runs on the model); reading it further raises Error."""
        if getattr(self, "_m", None):
            for stop, worker in list(self._streams):
                stop.set()
                worker.join()
            _close(self._m)
            self._m = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def _live(self):
        if not self._m:
            raise Error("the model is closed")
        return self._m

    @property
    def backend(self) -> str:
        """The backend and device it runs on ("cpu-avx512 (device 0: ...)")."""
        return _text(_backend(self._live()))

    @property
    def name(self) -> str:
        return _text(_name(self._live()))

    @property
    def n_vocab(self) -> int:
        return _n_vocab(self._live())

    @property
    def n_embd(self) -> int:
        """The width of the model's hidden state: an embedding's length."""
        return _n_embd(self._live())

    @property
    def n_ctx(self) -> int:
        return _n_ctx(self._live())

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> List[int]:
        """Text to token ids; add_special: BOS and the like; special: control-token text a
        user may type ("<|im_start|>") is read as the token where the family's reference does."""
        _no_nul(text, "the text")
        m, data, err = self._live(), text.encode("utf-8"), _c.create_string_buffer(_ERR)
        cap = len(data) + 16
        while True:
            ids = (_c.c_int32 * cap)()
            n = _tokenize(m, data, int(add_special), 1 if special else 0, ids, cap, err, _ERR)
            if n < 0:
                raise Error(_text(err.value))
            if n <= cap:
                return list(ids[:n])
            cap = n

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text, each piece as it reads after the one before."""
        out, buf, prev = bytearray(), _c.create_string_buffer(512), -1
        for i in ids:
            k = _piece(self._live(), prev, int(i), buf, 512)
            if k < 0:
                raise Error(f"token id {i} is not in the vocabulary of {self.n_vocab}")
            out += buf.raw[:k]
            prev = int(i)
        return _text(bytes(out))

    def _sampling(self, temperature, top_k, top_p, min_p, repeat_penalty, seed, ignore_eos):
        s = _defaults()
        for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                     ("min_p", min_p), ("repeat_penalty", repeat_penalty), ("seed", seed)):
            if v is not None:
                setattr(s, k, v)
        s.ignore_eos = int(ignore_eos)
        return s

    def _ids(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise Error("the prompt gives no tokens")
        return ids

    def _run(self, ids, max_tokens, sampling, on_piece, constraint=None):
        """Generates after ids, calling on_piece(id, text) for each token (id -1: the text held
        back until the end); on_piece returns True to stop. constraint: a _Constraint, or None.
        Returns the generation's stats."""
        err, stats = _c.create_string_buffer(_ERR), _Generation()
        arr = (_c.c_int32 * len(ids))(*ids)
        failure = []

        def cb(_user, tok, text, n):
            try:
                return 1 if on_piece(tok, _c.string_at(text, n)) else 0
            except BaseException as e:  # raised again once libloom has returned
                failure.append(e)
                return 1

        fn = _TOKEN_FN(cb)
        rc = _generate(self._live(), _c.byref(constraint) if constraint else None, arr, len(ids),
                       0, max_tokens, _c.byref(sampling), fn, None, _c.byref(stats), err, _ERR)
        if failure:
            raise failure[0]
        if rc != 0:
            raise Error(_text(err.value))
        return stats

    def generate_ids(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128,
                     temperature: Optional[float] = None, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, min_p: Optional[float] = None,
                     repeat_penalty: Optional[float] = None, seed: int = 0,
                     ignore_eos: bool = False) -> List[int]:
        """The generated token ids (the prompt is text, tokenized with BOS, or ids)."""
        out: List[int] = []
        s = self._sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed, ignore_eos)
        self._run(self._ids(prompt), max_tokens, s, lambda t, _b: out.append(t) if t >= 0 else None)
        return out

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128,
                 temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repeat_penalty: Optional[float] = None, seed: int = 0,
                 ignore_eos: bool = False, stream: bool = False) -> Union[str, Iterator[str]]:
        """The text generated after prompt, stopping at the model's end of text or after
        max_tokens. Sampling as `loom run`'s flags (None: loom's defaults: temperature 0.8,
        top_k 40, top_p 0.95, min_p 0.05; temperature 0 is greedy). stream: a generator of text
        pieces as they come (a character split over tokens comes whole); closing it early stops
        the generation."""
        ids = self._ids(prompt)
        s = self._sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed, ignore_eos)
        if not stream:
            out = bytearray()
            self._run(ids, max_tokens, s, lambda _t, b: out.extend(b))
            return _text(bytes(out))
        return self._stream(ids, max_tokens, s)

    def _stream(self, ids, max_tokens, s, constraint=None) -> Iterator[str]:
        q: "queue.Queue" = queue.Queue()
        stop = threading.Event()
        done = object()

        def work():
            try:
                self._run(ids, max_tokens, s, lambda _t, b: (q.put(b), stop.is_set())[1],
                          constraint)
                q.put(done)
            except BaseException as e:
                q.put(e)

        t = threading.Thread(target=work, daemon=True)
        live = (stop, t)
        self._streams.add(live)
        t.start()
        try:
            while True:
                item = q.get()
                if not self._m:
                    raise Error("the model was closed while this stream was read")
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item:
                    yield _text(item)
        finally:
            stop.set()
            t.join()
            self._streams.discard(live)

    def _format(self, template, template_file):
        fmt, err = _ChatFormat(), _c.create_string_buffer(_ERR)
        if _format_choose(self._live(), template.encode() if template else None,
                          os.fsencode(template_file) if template_file else None, _c.byref(fmt),
                          err, _ERR) != 0:
            raise Error(_text(err.value))
        return fmt

    def _render(self, fmt, messages, kwargs, tools) -> List[int]:
        for value, what in ((messages, "messages"), (kwargs, "kwargs"), (tools, "tools")):
            _no_nul(value, what)
        m, err = self._live(), _c.create_string_buffer(_ERR)
        v = _ChatVars(messages_json=json.dumps(list(messages)).encode(),
                      tools_json=json.dumps(list(tools)).encode() if tools else None,
                      kwargs_json=json.dumps(kwargs).encode() if kwargs else None,
                      add_generation_prompt=1)
        out, spans = _c.c_void_p(), _c.c_void_p()
        n_spans, add_special = _c.c_int(), _c.c_int()
        if _render_vars(_c.byref(fmt), _c.byref(v), _c.byref(out), _c.byref(spans),
                        _c.byref(n_spans), _c.byref(add_special), err, _ERR) != 0:
            raise Error(_text(err.value))
        try:
            text = _c.string_at(out)
            cap = len(text) + 16
            while True:
                ids = (_c.c_int32 * cap)()
                n = _tokenize_spans(m, text, len(text), add_special, 2, spans, n_spans, ids,
                                    cap, err, _ERR)  # 2: LOOM_SPECIAL_ALL
                if n < 0:
                    raise Error(_text(err.value))
                if n <= cap:
                    return list(ids[:n])
                cap = n
        finally:
            _libc.free(out)
            _libc.free(spans)

    def chat_prompt(self, messages: Sequence[dict], template: Optional[str] = None,
                    kwargs: Optional[dict] = None, tools: Optional[Sequence[dict]] = None,
                    template_file: Optional[Union[str, os.PathLike]] = None) -> List[int]:
        """The token ids of a conversation (OpenAI-style messages: role and content, tool calls
        and results) rendered with the model's own chat template, as `loom chat` and `loom
        serve` render it, up to the opening of the assistant's turn. template: a built-in
        format's name instead; template_file: a Jinja template instead; tools: an OpenAI tools
        array the template shows; kwargs: the template's extra variables."""
        fmt = self._format(template, template_file)
        try:
            return self._render(fmt, messages, kwargs, tools)
        finally:
            _format_free(_c.byref(fmt))

    def chat(self, messages: Sequence[dict], max_tokens: int = 512, stream: bool = False,
             template: Optional[str] = None, kwargs: Optional[dict] = None,
             tools: Optional[Sequence[dict]] = None, tool_choice: Union[str, dict] = "auto",
             parallel_tool_calls: bool = True, response_format: Optional[dict] = None,
             template_file: Optional[Union[str, os.PathLike]] = None,
             **sampling) -> Union[str, dict, Iterator[str]]:
        """The assistant's answer to a conversation (see chat_prompt), as generate gives it
        (sampling: generate's keyword arguments; stream: a generator of pieces).

        response_format: OpenAI's {"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}: the answer is made to match (constrained
        decoding, docs/structured-output.md). tools (an OpenAI tools array): the answer is then
        a message dict, {"role": "assistant", "content": text or None, "tool_calls": [...]}
        with the calls read from the model's syntax for them; tool_choice "auto" (it may
        call), "none" (no calls are read), "required" or {"type": "function", "function":
        {"name": N}} (it must call, one or, with parallel_tool_calls, up to 8). With tools the
        answer is read whole: no stream."""
        if tool_choice not in ("auto", "none", "required") and not (
                isinstance(tool_choice, dict) and
                isinstance(tool_choice.get("function"), dict) and
                isinstance(tool_choice["function"].get("name"), str)):
            raise Error('tool_choice must be "auto", "none", "required" or {"type": "function", '
                        '"function": {"name": ...}}, not %r' % (tool_choice,))
        if tools is not None and (not isinstance(tools, (list, tuple)) or not tools):
            raise Error("tools must be a non-empty list of OpenAI tools")
        reading = tools is not None and tool_choice != "none"
        if reading and stream:
            raise Error("stream=True with tools: the calls are read from the whole answer")
        names = [t.get("function", t).get("name") for t in tools or []]
        only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        if only is not None and only not in names:
            raise Error("tool_choice names %r, which is not in tools" % only)
        fmt = self._format(template, template_file)
        try:
            ids = self._render(fmt, messages, kwargs, tools)
            syntax = _tool_syntax(_c.byref(fmt))
        finally:
            _format_free(_c.byref(fmt))
        if reading and syntax in (_TOOLS_NONE, _TOOLS_UNKNOWN):
            raise Error("the chat template %s: give tools to a model whose template shows "
                        "them, or a template_file that does"
                        % ("shows no tools" if syntax == _TOOLS_NONE
                           else "writes tool calls in a form loom cannot read back"))
        grammar = None
        if reading and (tool_choice == "required" or only):
            if response_format and response_format.get("type") != "text":
                raise Error("response_format cannot go with a tool_choice that requires a call")
            grammar = _Grammar.of_tools(syntax, tools, only, parallel_tool_calls)
        elif response_format is not None:
            grammar = _Grammar.of_format(response_format)
        c = _Constraint(grammar=grammar.g if grammar else None, control_text=int(reading))
        s = self._sampling(*[sampling.pop(k, None) for k in
                             ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")],
                           sampling.pop("seed", 0), sampling.pop("ignore_eos", False))
        if sampling:
            raise Error("chat() got unknown arguments: %s" % ", ".join(sorted(sampling)))
        if stream:
            return self._stream_holding(grammar, ids, max_tokens, s, c)
        out = bytearray()
        self._run(ids, max_tokens, s, lambda _t, b: out.extend(b), c)
        if not reading:
            return _text(bytes(out))
        return _message(syntax, bytes(out), names)

    def _stream_holding(self, grammar, ids, max_tokens, s, c) -> Iterator[str]:
        yield from self._stream(ids, max_tokens, s, c)
        del grammar  # kept alive until the stream ends

    def embed(self, inputs: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]],
              pooling: str = "last", normalize: bool = True):
        """Embeddings: the final hidden states (after the final norm, before the head) of each
        input pooled into one vector: the last token's ("last", what decoder embedding models
        are trained with) or their mean ("mean"), scaled to length one unless normalize is
        False. An input is a text (tokenized with the model's special tokens, as tokenize) or
        token ids; one input gives one vector, a list of them one each: numpy arrays ([n_embd]
        or [n, n_embd]) when numpy is installed, else lists. The same numbers as `loom serve`'s
        /v1/embeddings."""
        if pooling not in _POOLING:
            raise Error("pooling %r is not one of %s" % (pooling, ", ".join(_POOLING)))
        one = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], int))
        batch = [inputs] if one else list(inputs)
        if not batch:
            raise Error("no inputs given")
        d, err = self.n_embd, _c.create_string_buffer(_ERR)
        rows = []
        for x in batch:
            ids = self._ids(x)
            arr = (_c.c_int32 * len(ids))(*ids)
            out = (_c.c_float * d)()
            if _embed(self._live(), arr, len(ids), _POOLING[pooling], int(normalize), out, err,
                      _ERR) != 0:
                raise Error(_text(err.value))
            rows.append(out)
        try:
            import numpy
            m = numpy.array([numpy.frombuffer(r, dtype=numpy.float32) for r in rows])
            return m[0] if one else m
        except ImportError:
            lists = [list(r) for r in rows]
            return lists[0] if one else lists

    def logits(self, ids: Sequence[int]):
        """Every position's logits for ids from position 0: a numpy array [len(ids), n_vocab]
        when numpy is installed, else a list of lists."""
        n, nv = len(ids), self.n_vocab
        if n == 0:
            raise Error("no token ids given")
        arr = (_c.c_int32 * n)(*[int(i) for i in ids])
        out = (_c.c_float * (n * nv))()
        err = _c.create_string_buffer(_ERR)
        if _eval_logits(self._live(), arr, n, out, err, _ERR) != 0:
            raise Error(_text(err.value))
        try:
            import numpy
            return numpy.frombuffer(out, dtype=numpy.float32).reshape(n, nv).copy()
        except ImportError:
            return [list(out[r * nv:(r + 1) * nv]) for r in range(n)]
