#!/usr/bin/env python3
"""tests/webui_browser.py URL KEY SCREENSHOT: drives loom serve's chat page in headless Chromium
through ChromeDriver's WebDriver API (the standard library only), as a user would: gives the API
key it asks for, sends messages, stops one, and checks what the page shows against what the API
answers on its own. Prints ok:/FAIL: lines; exits 1 on a failure, 77 when Chromium cannot run."""
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

URL, KEY, SHOT = sys.argv[1:4]
WAIT_S = 90  # a sanitizer build generates slowly
fails = 0


def ok(what):
    print("ok: " + what, flush=True)


def fail(what):
    global fails
    fails += 1
    print("FAIL: " + what, file=sys.stderr, flush=True)


def http(method, url, body=None, headers=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def api_chat(messages, **fields):
    """The answer the API gives for a conversation, not streamed: what the page should show."""
    body = dict(model="m", messages=messages, **fields)
    out = json.loads(http("POST", URL + "/v1/chat/completions", body,
                          {"Authorization": "Bearer " + KEY}))
    return out["choices"][0]["message"]["content"]


def metric(name):
    for line in http("GET", URL + "/metrics").splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    return None


class Browser:
    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

    def __init__(self, driver, profile):
        self.driver = driver
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": shutil.which("chromium") or "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                         "--window-size=1100,900", "--user-data-dir=" + profile]}}}}
        self.session = json.loads(http("POST", driver + "/session", caps))["value"]["sessionId"]

    def call(self, method, path, body=None):
        try:
            return json.loads(http(method, "%s/session/%s%s" % (self.driver, self.session, path),
                                   body))["value"]
        except urllib.error.HTTPError as e:  # WebDriver's error, with its message
            raise RuntimeError("%s %s: %s" % (method, path, e.read().decode()[:300])) from None

    def find(self, css):
        e = self.call("POST", "/element", {"using": "css selector", "value": css})
        if self.ELEMENT not in e:
            raise RuntimeError("no element %s: %r" % (css, e))
        return e[self.ELEMENT]

    def type(self, css, text, clear=True):
        e = self.find(css)
        if clear:
            self.call("POST", "/element/%s/clear" % e, {})
        self.call("POST", "/element/%s/value" % e, {"text": text})

    def click(self, css):
        self.call("POST", "/element/%s/click" % self.find(css), {})

    def js(self, script, *args):
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait(self, script, what, timeout=WAIT_S):
        end = time.time() + timeout
        while time.time() < end:
            v = self.js(script)
            if v:
                return v
            time.sleep(0.02)
        raise TimeoutError("waited %d s for %s" % (timeout, what))

    def close(self):
        try:
            http("DELETE", "%s/session/%s" % (self.driver, self.session))
        except Exception:
            pass


LAST = "const ms = document.querySelectorAll('.msg.assistant'); const m = ms[ms.length - 1];"


def answer(b, prompt, enter=False):
    """Sends prompt from the composer; returns the finished assistant message's facts."""
    n = b.js("return document.querySelectorAll('.msg.assistant').length")
    b.type("#prompt", prompt + ("\ue007" if enter else ""))
    if not enter:
        b.click("#send")
    b.wait("return document.querySelectorAll('.msg.assistant').length > %d" % n, "the answer")
    b.wait(LAST + "return m.dataset.done === '1'", "the answer's end")
    return b.js(LAST + "return {raw: m.answer || '', chunks: Number(m.dataset.chunks),"
                " text: m.querySelector('.body').textContent, stopped: m.dataset.stopped || ''}")


def main():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        print("SKIP: chromium and chromedriver are not installed "
              "(apt-get install chromium chromium-driver)")
        return 77
    with socket.socket() as s:  # a free loopback port for the driver
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    profile = tempfile.mkdtemp(prefix="loom-chromium.")
    log = open(os.path.join(profile, "chromedriver.log"), "w")
    driver = subprocess.Popen([chromedriver, "--port=%d" % port], stdout=log, stderr=log)
    b = None
    try:
        base = "http://127.0.0.1:%d" % port
        for _ in range(100):
            try:
                if json.loads(http("GET", base + "/status"))["value"]["ready"]:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        try:
            b = Browser(base, profile)
        except Exception as e:  # no display, no sandbox, a broken install: cannot run here
            log.flush()
            print("SKIP: Chromium does not start here: %s; %s" % (e, open(log.name).read()[-500:]))
            return 77
        run(b)
    except Exception as e:
        fail("the browser session broke off: %r" % e)
    finally:
        if b:
            b.close()
        driver.terminate()
        driver.wait(10)
        shutil.rmtree(profile, ignore_errors=True)
    return 1 if fails else 0


def run(b):
    b.call("POST", "/url", {"url": URL + "/"})
    # ---- the key: the page asks for it, then shows the model and backend
    b.wait("return !document.getElementById('key-dialog').hidden", "the API key dialog")
    ok("the page asks for the API key the server wants")
    b.type("#key-input", KEY)
    b.click("#key-save")
    name = b.wait("const t = document.getElementById('model-name').textContent;"
                  "return t !== '?' && t", "the model's name")
    backend = b.js("return document.getElementById('backend-name').textContent")
    models = json.loads(http("GET", URL + "/v1/models", headers={"Authorization": "Bearer " + KEY}))
    (ok if name == "m" and backend == models["data"][0]["backend"] else fail)(
        "the page shows the model (%s) and its backend (%s)" % (name, backend))

    # ---- a greedy conversation of two turns, streamed: the API's own answers, piece by piece
    # (400 tokens: a small model writes 24 faster than one network read)
    b.click("#settings > summary")  # open the settings, as a user would
    b.type("#temperature", "0")
    b.type("#max_tokens", "400")
    first = answer(b, "Hello")
    want = api_chat([{"role": "user", "content": "Hello"}], temperature=0, top_p=0.95,
                    max_tokens=400)
    (ok if first["raw"] == want and want else fail)(
        "the first answer is the API's (greedy, %d characters)" % len(want))
    (ok if first["chunks"] >= 2 else fail)(
        "it arrived streamed, in %d pieces" % first["chunks"])
    second = answer(b, "Tell me more", enter=True)
    want2 = api_chat([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": want},
                      {"role": "user", "content": "Tell me more"}], temperature=0, top_p=0.95,
                     max_tokens=400)
    (ok if second["raw"] == want2 and want2 else fail)(
        "Enter sends; the second turn carries the first (the API's answer to all three messages)")

    # ---- a settings mistake is named, and nothing is sent
    b.type("#extra", "{not json")
    n = b.js("return document.querySelectorAll('.msg').length")
    b.type("#prompt", "again")
    b.click("#send")
    status = b.wait("return document.getElementById('status').textContent", "an error")
    (ok if "more request fields" in status and
     b.js("return document.querySelectorAll('.msg').length") == n else fail)(
        "bad JSON in the settings is named (%s), nothing sent" % status)

    # ---- Stop: the stream ends at once and the server frees the request
    b.click("#new-chat")
    b.type("#extra", '{"ignore_eos": true}')
    b.type("#max_tokens", "1500")
    gone = metric("loom_client_disconnects_total") or 0
    b.type("#prompt", "Count")
    b.click("#send")
    b.wait(LAST + "return m && Number(m.dataset.chunks) >= 2", "the long answer's start")
    b.click("#stop")
    b.wait(LAST + "return m.dataset.done === '1'", "the stopped answer's end")
    stopped = b.js(LAST + "return m.dataset.stopped")
    end = time.time() + 20
    while time.time() < end and metric("loom_client_disconnects_total") <= gone:
        time.sleep(0.1)
    freed = metric("loom_client_disconnects_total") > gone
    (ok if stopped == "1" and freed else fail)(
        "Stop ends the stream (stopped=%s) and the server sees the client go (%s)"
        % (stopped, freed))

    # ---- model output is text: markup in it stays text, Markdown becomes elements
    hostile = ('<script>window.pwned=1</script><img src=x onerror="window.pwned=2"> '
               '**bold** and `code`')
    b.click("#new-chat")
    b.type("#max_tokens", "300")
    b.type("#extra", json.dumps({"response_format": {"type": "json_schema", "json_schema": {
        "name": "hostile", "schema": {"enum": [hostile]}}}}))
    got = answer(b, "Say it")
    time.sleep(0.3)  # an injected handler would have run by now
    facts = b.js("const box = document.getElementById('messages');"
                 "return {pwned: window.pwned === undefined ? null : window.pwned,"
                 " scripts: box.querySelectorAll('script, img, iframe, object').length,"
                 " strong: [...box.querySelectorAll('strong')].map(e => e.textContent),"
                 " code: [...box.querySelectorAll('code')].map(e => e.textContent)}")
    (ok if json.loads(got["raw"]) == hostile and "<script>" in got["text"] else fail)(
        "a model's <script> and <img onerror> are shown as text: %r" % got["text"][:80])
    (ok if facts["pwned"] is None and facts["scripts"] == 0 else fail)(
        "nothing the model wrote ran or became an element (%r)" % facts)
    (ok if facts["strong"] == ["bold"] and facts["code"] == ["code"] else fail)(
        "its Markdown is rendered: **bold** and `code` as elements (%r)" % facts)

    png = base64.b64decode(b.call("GET", "/screenshot"))
    with open(SHOT, "wb") as f:
        f.write(png)
    (ok if png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000 else fail)(
        "a screenshot of the page is kept: %s (%d bytes)" % (SHOT, len(png)))


if __name__ == "__main__":
    sys.exit(main())
