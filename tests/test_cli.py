"""CLI behaviour through typer's CliRunner, and bad input end to end."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from mlxcel_dist.cli import app

from reference_cases import FIXTURES, FP32_REL_TOL, compare
from testproc import run_cmd

runner = CliRunner()
GQA = FIXTURES / "gemma3" / "gqa_fp32"
TINY = Path(__file__).resolve().parent.parent / "models" / "gemma3-tiny"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def ids_file(tmp_path):
    ids = np.load(GQA / "reference.npz")["ids"]
    p = tmp_path / "ids.npy"
    np.save(p, ids)
    return p


@pytest.mark.parametrize("extra", [[], ["--decode-from", "5"], ["--prefill-step", "7", "--decode-from", "40"]])
def test_logits_command_matches_reference(tmp_path, ids_file, extra):
    out = tmp_path / "out.npy"
    r = run("logits", GQA, "--tokens-file", ids_file, "--out", out, *extra)
    assert r.exit_code == 0, r.output
    res = compare(np.load(out), np.load(GQA / "reference.npz")["logits"], FP32_REL_TOL)
    assert res["ok"], res


def test_info_lists_layer_kinds():
    r = run("info", GQA)
    assert r.exit_code == 0, r.output
    assert "sliding (window 16)" in r.output and "full" in r.output
    assert "parameters" in r.output


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(GQA, d)
    return d


def _edit_weights(d, fn):
    w = load_file(str(d / "model.safetensors"))
    save_file(fn(w), str(d / "model.safetensors"))


BAD = {
    "missing path": (lambda d: Path("/no/such/model"), "no such model directory"),
    "config not json": (lambda d: (d / "config.json").write_text("{not json") and d, "not valid JSON"),
    "unsupported model_type": (
        lambda d: (d / "config.json").write_text(json.dumps({"model_type": "bert"})) and d,
        "unsupported model_type 'bert' (supported: ",
    ),
    "missing tensor": (
        lambda d: _edit_weights(d, lambda w: {k: v for k, v in w.items() if "layers.3.mlp.up_proj" not in k}) or d,
        "missing tensors: model.layers.3.mlp.up_proj.weight",
    ),
    "unexpected tensor": (
        lambda d: _edit_weights(d, lambda w: {**w, "model.extra.weight": np.zeros(3, np.float32)}) or d,
        "unexpected tensors: model.extra.weight",
    ),
    "wrong shape": (
        lambda d: _edit_weights(
            d, lambda w: {**w, "model.norm.weight": np.zeros(65, np.float32)}
        ) or d,
        "'model.norm.weight' has shape [65], expected [64]",
    ),
    "truncated safetensors": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:50000]) and d,
        "truncated",
    ),
    "no weights": (lambda d: (d / "model.safetensors").unlink() or d, "no .safetensors weight files"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_is_one_clear_line(case, ckpt, ids_file, tmp_path):
    make, message = BAD[case]
    model = make(ckpt)
    r = run("logits", model, "--tokens-file", ids_file, "--out", tmp_path / "o.npy")
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    assert r.output.strip().count("\n") == 0, r.output


def test_token_outside_vocab(tmp_path):
    p = tmp_path / "ids.npy"
    np.save(p, np.array([1, 2, 256], np.int32))
    r = run("logits", GQA, "--tokens-file", p, "--out", tmp_path / "o.npy")
    assert r.exit_code == 2 and f"{p}: token id 256 is outside the vocabulary [0, 256)" in r.output
    long = tmp_path / "long.npy"
    np.save(long, np.ones(600, np.int32))  # the embedded model's context is 512
    r = run("logits", TINY, "--tokens-file", long, "--out", tmp_path / "o.npy", "--np", "2")
    assert r.exit_code == 2 and f"{long}: 600 tokens, more than the model's context of 512" in r.output


def test_output_folder_is_checked_before_any_work(ids_file, tmp_path):
    r = run("logits", GQA, "--tokens-file", ids_file, "--out", tmp_path / "none" / "o.npy", "--np", "2")
    assert r.exit_code == 2 and "no such directory" in r.output and r.output.count("\n") == 1, r.output


def test_empty_directory_names_the_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    for cmd in (["generate"], ["generate", "--np", "2"], ["bench", "--np", "2"]):
        r = run(cmd[0], tmp_path / "empty", *cmd[1:])
        assert r.exit_code == 2 and "no config.json" in r.output and "tokenizer" not in r.output, (cmd, r.output)


def test_too_small_tensor_for_a_rank_names_the_expected_shape(ckpt, ids_file, tmp_path):
    # k_proj with 16 rows instead of 32: rank 1's slice [16, 32) is past its end.
    _edit_weights(ckpt, lambda w: {**w, "model.layers.0.self_attn.k_proj.weight":
                                   w["model.layers.0.self_attn.k_proj.weight"][:16]})
    r = run("logits", ckpt, "--tokens-file", ids_file, "--out", tmp_path / "o.npy", "--np", "2")
    assert r.exit_code == 2, r.output
    assert "'model.layers.0.self_attn.k_proj.weight' has shape [16, 64], expected [32, 64]" in r.output, r.output


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "convert-q4"])
def test_info_counts_logical_parameters(tmp_path, quantized):
    src = TINY
    if quantized:
        from mlxcel_dist.checkpoint.convert import convert_checkpoint

        src = convert_checkpoint(TINY, tmp_path / "q4", quantize=True)["out"]
    r = run("info", src)
    assert r.exit_code == 0 and "parameters  854,400 (" in r.output, r.output
    assert "context     512 tokens" in r.output
    assert "  rank 0   854,400 parameters, " in r.output, r.output  # np 1: the whole model


def _info_ranks(*args):
    import re

    r = run("info", *args)
    assert r.exit_code == 0, r.output
    return [tuple(int(x.replace(",", "")) for x in m) for m in
            re.findall(r"^  rank \d+ +([\d,]+) parameters, ([\d,]+) bytes", r.output, re.M)]


def test_info_per_rank_is_plans_sharding():
    # np 1: every parameter once (float32: 4 bytes each); np 3 on 4 heads: a
    # larger first share, each rank under the whole, replicated tensors on all.
    (p1, b1), = _info_ranks(TINY)
    assert (p1, b1) == (854_400, 4 * 854_400)
    three = _info_ranks(TINY, "--np", "3")
    assert len(three) == 3 and three[0][0] > three[1][0] == three[2][0]
    assert all(p < p1 and b == 4 * p for p, b in three) and sum(p for p, _ in three) > p1
    r = run("info", TINY, "--np", "5")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "5 ranks cannot split" in r.output, r.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tokens-file", "/no/ids.npy"], "no such tokens file"),
        (["--np", "0"], "--np must be >= 1"),
        (["--decode-from", "0"], "--decode-from must be in"),
        (["--prefill-step", "0"], "--prefill-step must be >= 1"),
        (["--dtype", "float8"], "unknown dtype 'float8'"),
    ],
)
def test_bad_options(args, message, ids_file, tmp_path):
    base = {"--tokens-file": str(ids_file)}
    argv = ["logits", str(GQA), "--out", str(tmp_path / "o.npy")]
    if "--tokens-file" not in args:
        argv += ["--tokens-file", base["--tokens-file"]]
    r = run(*argv, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_prefill_step_help_names_the_engine_default():
    # the help text spells the default out (cli.py must not import mlx for --help)
    from mlxcel_dist.engine.guard import DEFAULT_PREFILL_STEP

    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "300"})
    assert r.exit_code == 0
    assert f"(default: {DEFAULT_PREFILL_STEP} when generating; logits: one pass)" in " ".join(r.output.split())


def test_console_script_error_has_no_traceback(tmp_path):
    exe = Path(sys.executable).parent / "mlxcel-dist"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlxcel_dist.cli"]
    p = run_cmd(cmd + ["info", str(tmp_path / "missing")], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("error: ") and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0


@pytest.mark.parametrize(
    "fixture,np_,message",
    [
        ("gqa_fp32", 9, "9 ranks cannot split 8 attention heads (2 KV heads)"),
        ("mqa_fp32", 8, "8 ranks cannot split 4 attention heads (1 KV heads)"),
    ],
)
def test_rank_count_the_heads_cannot_take(fixture, np_, message, ids_file, tmp_path):
    # Refused before any rank is launched: one line, exit 2.
    r = run("logits", FIXTURES / "gemma3" / fixture, "--tokens-file", ids_file, "--out", tmp_path / "o.npy",
            "--np", np_)
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.strip().count("\n") == 0


@pytest.mark.parametrize("doc", ["README.md", "docs/models.md"])
def test_readme_model_table_is_the_registry(doc):
    # The "Supported models" tables (the README's short one, docs/models.md's
    # full one) name exactly the registered model_types: a new family file
    # without its row (or a stale row) fails.
    import re

    from mlxcel_dist.models import supported

    readme = (Path(__file__).parent.parent / doc).read_text()
    section = re.split(r"\n##+ ", readme.split("## Supported models", 1)[1], maxsplit=1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `") and "`model_type`" not in line]
    listed = [t for line in rows for t in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])]
    assert sorted(listed) == supported()


def test_nccl_without_cuda_is_one_line(tmp_path):
    import mlx.core as mx

    if mx.distributed.is_available("nccl"):
        pytest.skip("this mlx has NCCL")
    r = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "generate", "--np", "2", "--backend", "nccl"], timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "backend nccl" in r.stderr, r.stderr


def test_model_option_spelling_is_accepted_by_every_model_command():
    # mlx-lm spells MODEL as --model; both spellings name the same checkpoint
    for cmd in ("generate", "info", "bench", "serve", "logit-match"):
        assert "--model" in run(cmd, "--help").output, cmd
    r = run("serve", str(TINY), "--model", str(GQA))
    assert r.exit_code == 2 and "MODEL" in r.output and "differ" in r.output, r.output


@pytest.mark.parametrize(
    "weights,message",
    [("1,2", "--rank-weights gives 2 weights for 3 ranks"), ("1,0,1", "--rank-weights must be positive"),
     ("a,b,c", "--rank-weights must be comma-separated positive numbers")],
)
def test_bad_rank_weights_are_refused_before_launch(weights, message, ids_file, tmp_path):
    r = run("logits", FIXTURES / "gemma3" / "gqa_fp32", "--tokens-file", ids_file, "--out", tmp_path / "o.npy",
            "--np", 3, "--rank-weights", weights)
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.strip().count("\n") == 0


def test_hostfile_weights_reach_the_ranks_argv(tmp_path, ids_file, monkeypatch):
    # The ranks never read the hostfile: its per-host weights ride in their argv.
    import mlxcel_dist.cluster.launcher as launcher

    seen = {}

    def fake_launch(argv, np_, backend, hostfile=None, **kw):
        seen["argv"] = argv
        return 0

    monkeypatch.setattr(launcher, "launch", fake_launch)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1 weight=3\n127.0.0.1 slots=2\n")
    r = run("logits", FIXTURES / "gemma3" / "gqa_fp32", "--tokens-file", ids_file, "--out", tmp_path / "o.npy",
            "--np", 3, "--hostfile", hosts)
    assert r.exit_code == 0, r.output
    assert "--rank-weights=3,1,1" in seen["argv"]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_refuses_a_bad_header_timeout_before_loading(value):
    r = run("serve", TINY, "--port", "0", "--header-timeout", value)
    assert r.exit_code == 2 and "--header-timeout must be in (0, 86400] seconds" in r.output, r.output
    assert "--header-timeout" in runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "300"}).output


@pytest.mark.parametrize(
    "case,split,message",
    [("qwen3_moe/gqa_fp32", "rows", "--moe-split must be one of intermediate, experts, got 'rows'"),
     ("gemma3/gqa_fp32", "experts", "--moe-split experts: gemma3_text has no stacked routed experts"),
     ("glm4_moe/mqa_bf16", "experts", "4 ranks cannot split the routed experts (3)")],
)
def test_bad_moe_split_is_refused_before_launch(case, split, message, ids_file, tmp_path):
    r = run("logits", FIXTURES / case, "--tokens-file", ids_file, "--out", tmp_path / "o.npy", "--np", 4,
            "--moe-split", split)
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.strip().count("\n") == 0


def test_moe_split_reaches_the_ranks_argv(tmp_path, ids_file, monkeypatch):
    import mlxcel_dist.cluster.launcher as launcher

    seen = {}
    monkeypatch.setattr(launcher, "launch", lambda argv, *a, **kw: seen.setdefault("argv", argv) and 0)
    r = run("logits", FIXTURES / "qwen3_moe" / "gqa_fp32", "--tokens-file", ids_file, "--out", tmp_path / "o.npy",
            "--np", 2, "--moe-split", "experts")
    assert r.exit_code == 0, r.output
    assert "--moe-split=experts" in seen["argv"]
    r = run("plan", FIXTURES / "qwen3_moe" / "gqa_fp32", "--np", 2, "--moe-split", "experts")
    assert "routed experts: whole experts per rank (--moe-split experts): rank 0 [0, 4), rank 1 [4, 8)" in r.output


# --help at 80 columns ----------------------------------------------------------------
def _commands():
    import typer

    group = typer.main.get_command(app)
    return group, [None, *group.commands]


@pytest.mark.parametrize("name", _commands()[1], ids=lambda n: n or "root")
def test_help_fits_80_columns_with_whole_option_names(name):
    # Every spelling of every option appears whole in the help, no line is
    # wider than 80 columns, and an on/off flag shows no value after its names.
    import re

    group, _ = _commands()
    cmd = group if name is None else group.commands[name]
    r = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in r.output
    rows = [re.split(r"\s{2,}", line.strip())[0] for line in lines if line.startswith("  -")]
    names = {n for row in rows for n in re.findall(r"(?<![\w-])--?[\w-]+", row)}
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        spellings = [*p.opts, *p.secondary_opts]
        assert set(spellings) <= names, (spellings, rows)
        if p.is_flag:
            row = next(row for row in rows if spellings[0] in re.findall(r"--?[\w-]+", row))
            assert re.fullmatch(r"--?[\w-]+((, | / )--?[\w-]+)*", row), row


def test_a_value_after_an_on_off_flag_is_one_error_line(monkeypatch, capsys):
    # click would take the word for MODEL ("no such model directory")
    import mlxcel_dist.cli as cli

    for argv, want in [(["generate", "--verbose", "False"], "--verbose is an on/off flag: give it alone"),
                       (["generate", "--chat", "true"], "give --chat or --ignore-chat-template alone"),
                       (["bench", "--json", "0"], "--json is an on/off flag")]:
        monkeypatch.setattr(sys, "argv", ["mlxcel-dist", *argv])
        with pytest.raises(SystemExit) as e:
            cli.main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and want in err and err.count("\n") == 1, err


def test_chat_template_file_is_read(tmp_path):
    # '{', '}' or a newline make the value a template; anything else names a file (vLLM's rule)
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }}")
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    n = len(Tokenizer(TINY, chat_template=f.read_text()).prompt_ids("The sea"))
    r = run("generate", "--chat-template", f, "-n", "0", "-v")
    assert r.exit_code == 0 and f"prompt {n} tokens (chat template: --chat-template)" in r.output, r.output
    r = run("generate", "--chat-template", tmp_path, "-n", "0")
    assert r.exit_code == 2 and "a directory" in r.output, r.output


def test_no_arguments_print_the_help(monkeypatch, capsys):
    import mlxcel_dist.cli as cli

    monkeypatch.setattr(sys, "argv", ["mlxcel-dist"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out.startswith("Usage: ") and "generate" in out.out and out.err == ""


@pytest.mark.parametrize("name", ["logits", "generate", "modes", "logit-match", "serve", "bench"])
def test_the_ranks_argv_recreates_the_grouped_options(name):
    # Launch and load options are declared once (cli.LaunchOptions, LoadOptions)
    # and spread into each command: the argv each rank re-runs parses back to
    # the same values, none lost or defaulted.
    import typer

    from mlxcel_dist.commands.launch import argv_from_ctx

    cmd = typer.main.get_command(app).commands[name]
    given = {"logits": ["M", "--tokens-file", "t.npy", "--out", "o.npy"],
             "modes": ["M", "--tokens", "1,2", "--out", "o.npz"]}
    argv = [*given.get(name, []), "--np", "3", "--pp", "3", "--backend", "ring", "--hostfile", "h",
            "--rank-weights", "2,1,1", "--moe-split", "experts", "--stall-timeout", "7.5", "--dtype", "float32",
            "--max-kv-size", "64", "--kv-bits", "4", "--kv-group-size", "32", "--adapter-path", "a",
            "--no-fetch", "--shard-cache", "/c"]
    ctx = cmd.make_context(name, argv)
    again = cmd.make_context(name, argv_from_ctx(ctx)[1:])
    assert again.params == ctx.params and ctx.params["np_"] == 3 and ctx.params["kv_group_size"] == 32
    assert ctx.params["fetch"] is False and ctx.params["shard_cache"] == "/c"


def test_help_loads_no_mlx_and_no_command_body():
    # Each command's body (mlxcel_dist/commands/<name>.py) is imported when the
    # command runs, not for --help: the help stays as quick as it was.
    code = ("import sys, typer; from typer.testing import CliRunner; from mlxcel_dist.cli import app; "
            "names = list(typer.main.get_command(app).commands); "
            "codes = [CliRunner().invoke(app, [n, '--help']).exit_code for n in names]; "
            "shared = ('mlxcel_dist.commands', 'mlxcel_dist.commands.common', 'mlxcel_dist.commands.launch'); "
            "print(len(names), set(codes), sorted(m for m in sys.modules if m.split('.')[0] == 'mlx' "
            "or m.startswith('mlxcel_dist.commands') and m not in shared))")
    p = run_cmd([sys.executable, "-c", code], timeout=60, cwd=TINY.parent.parent)
    assert p.returncode == 0 and p.stdout.split(None, 1)[1].strip() == "{0} []", (p.stdout, p.stderr)
    assert int(p.stdout.split()[0]) >= 9
