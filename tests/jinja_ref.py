#!/usr/bin/env python3
"""tests/jinja_ref.py - a chat template rendered as transformers' apply_chat_template renders it
(its environment rebuilt on Debian's python3-jinja2: immutable sandbox, trim_blocks,
lstrip_blocks, loop controls, its tojson, raise_exception, strftime_now): the reference
`loom template` is compared with, byte for byte.

usage: jinja_ref.py TEMPLATE MESSAGES.json [--tools F] [--kwargs JSON] [--bos S] [--eos S]
                    [--no-generation-prompt]
Prints the prompt; on a template error prints "ERROR: message" to stderr and exits 3.
       jinja_ref.py --batch JOBS: each line of JOBS is an output path and then the arguments
above, each field ended by 0x1f; writes PATH.out, PATH.err and PATH.rc for each (one Python
start for all)."""
import argparse
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


class Generation(jinja2.ext.Extension):
    """transformers' {% generation %} block, rendered as its body"""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def render(argv):
    """(exit status, prompt, error) of one render"""
    ap = argparse.ArgumentParser()
    ap.add_argument("template")
    ap.add_argument("messages")
    ap.add_argument("--tools")
    ap.add_argument("--kwargs")
    ap.add_argument("--bos", default="")
    ap.add_argument("--eos", default="")
    ap.add_argument("--no-generation-prompt", action="store_true")
    a = ap.parse_args(argv)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    with open(a.template, encoding="utf-8") as f:
        source = f.read()
    with open(a.messages, encoding="utf-8") as f:
        messages = json.load(f)
    tools = None
    if a.tools:
        with open(a.tools, encoding="utf-8") as f:
            tools = json.load(f)
    variables = {"bos_token": a.bos, "eos_token": a.eos}
    variables.update(json.loads(a.kwargs) if a.kwargs else {})
    try:
        out = env.from_string(source).render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=not a.no_generation_prompt, **variables)
    except Exception as e:  # the template refused, or used what the sandbox forbids
        return 3, "", "ERROR: %s\n" % e
    return 0, out, ""


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--batch":
        with open(sys.argv[2], encoding="utf-8") as jobs:
            for line in jobs:
                job = line.rstrip("\n").split("\x1f")[:-1]
                rc, out, err = render(job[1:])
                for ext, text in (("out", out), ("err", err), ("rc", "%d\n" % rc)):
                    with open(job[0] + "." + ext, "w", encoding="utf-8") as f:
                        f.write(text)
        return
    rc, out, err = render(sys.argv[1:])
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(rc)


if __name__ == "__main__":
    main()
