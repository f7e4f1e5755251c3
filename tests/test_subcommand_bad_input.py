"""Bad input to `dsa-train plan` and `dsa-train launch`: one line naming the problem and a fix, no
traceback, nothing written or started. Before, these subcommands composed the recipe without the
training command's checks: an unknown recipe, an override Hydra cannot parse or an unknown option
was a Hydra traceback, `plan` skipped the recipe's value checks (data.seq_len=-5 crashed inside
the plan) and took any --world / --rank / --mfu / --peak-tflops (--peak-tflops 0: ZeroDivisionError;
--rank past the world: StopIteration)."""

from __future__ import annotations

import json
import shutil

import pytest

from dsa_train.cli import main


def _one_line(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as err:  # argparse's own errors
        code = err.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["plan", "--config-name", "demoo"], "--config-name demoo: no such recipe"),
    (["plan", "--config-name"], "--config-name needs a recipe name"),
    (["plan", "data.seq_len=-5"], "data.seq_len: must be >= 2, got -5"),
    (["plan", "data.seq_len=abc"], "data.seq_len=abc"),
    (["plan", "stages.sparse.stpes=3"], "did you mean stages.sparse.steps?"),
    (["plan", "stages.sparse.topk=0"], "stages.sparse.topk: must be >= 1"),
    (["plan", "cluster.nodes=0"], "cluster.nodes: must be >= 1, got 0"),
    (["plan", "--nodes", "2"], "unrecognized arguments: --nodes"),
    (["plan", "-cd=mine", "--config-name", "x"], "-cd: dsa-train plan reads the recipes in"),
    (["plan", "--world", "0"], "--world 0: must be >= 1"),
    (["plan", "--world", "-3"], "--world -3: must be >= 1"),
    (["plan", "--world", "2", "--rank", "5", "parallel.data_parallel=-1"], "--rank 5: the layout has 2 ranks"),
    # the layout's fix names the plan's option, not a launch (a plan launches nothing)
    (["plan", "--world", "3"], "set parallel.data_parallel=3 (or -1 to infer it), or pass --world 1"),
    (["plan", "--world", "3", "parallel.context_parallel=2", "parallel.data_parallel=-1"],
     "pass --world a multiple of 2 or lower tensor/context parallel"),
    (["plan", "--peak-tflops", "0"], "--peak-tflops 0.0: must be > 0"),
    (["plan", "--mfu", "2"], "--mfu 2.0: must be in (0, 1]"),
    (["plan", "--usable", "3"], "--usable 3.0: must be in (0, 1]"),
    (["plan", "--gpu-gb", "-1"], "--gpu-gb -1.0: must be > 0"),
    (["plan", "--hbm-tbps", "0"], "--hbm-tbps 0.0: must be > 0"),
    (["plan", "run_name=${nope}"], "run_name: Interpolation key 'nope' not found"),
])
def test_plan_refuses_in_one_line(capsys, argv, expected):
    assert expected in _one_line(capsys, argv)


def test_plan_of_a_671b_recipe_needs_no_data_or_checkpoint(capsys):
    """The values are checked as for training, but not the recipe's ??? data sources and
    checkpoint path: a plan reads neither."""
    assert main(["plan", "--json", "--config-name", "v3.2_warmup"]) == 0
    assert '"fits": true' in capsys.readouterr().out


def test_plan_headroom_line_follows_usable(capsys):
    assert main(["plan", "--usable", "0.8"]) == 0
    assert "with 20% headroom" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["launch", "slurm", "--dry-run", "--nodes", "0"], "unrecognized arguments: --nodes"),
    (["launch", "slurm", "--dry-run", "--config-name", "nope"], "--config-name nope: no such recipe"),
    (["launch", "slurm", "--dry-run", "data.seq_len=abc"], "data.seq_len=abc"),
    (["launch", "slurm", "--dry-run", "cluster.nodes=0"], "cluster.nodes: must be >= 1, got 0"),
    (["launch", "slurm", "--dry-run", "cluster.procs_per_node=0"], "cluster.procs_per_node: must be >= 1 or null"),
    (["launch", "torchrun", "--nproc-per-node", "2", "--bogus"], "unrecognized arguments: --bogus"),
    # training's --config-dir (docs/recipes.md): not 'recipe keys are key=value', but where recipes are read
    (["launch", "slurm", "--dry-run", "--config-dir", "mine", "--config-name", "x"], "--config-dir: dsa-train launch slurm reads the recipes in"),
    (["launch", "torchrun", "--nproc-per-node", "0"], "--nproc-per-node 0: must be >= 1"),
    (["launch", "torchrun", "--nproc-per-node", "1", "--master-port", "70000"], "--master-port 70000"),
    (["launch", "torchrun", "--nproc-per-node", "2", "--config-name", "nope"], "--config-name nope: no such recipe"),
    (["launch", "torchrun", "--nproc-per-node", "2", "stages.sparse.stpes=1"], "did you mean stages.sparse.steps?"),
    # an interpolation that does not resolve (before: a traceback; the launcher's check once caught it)
    (["launch", "torchrun", "--nproc-per-node", "1", "run_name=${nope}"], "run_name: Interpolation key 'nope' not found"),
    (["launch", "slurm", "--dry-run", "run_name=${nope}"], "run_name: Interpolation key 'nope' not found"),
    # a launcher that does not exist: one line (before: the whole usage text on stderr)
    (["launch", "torchrunn", "--nproc-per-node", "2"], "torchrunn: no such launcher (did you mean torchrun?)"),
    (["launch", "mpirun"], "mpirun: no such launcher — use `dsa-train launch torchrun ...`"),
])
def test_launch_refuses_in_one_line_and_starts_nothing(capsys, monkeypatch, tmp_path, argv, expected):
    import dsa_train.launch.launcher as launcher

    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: started.append(a) or 0)
    assert expected in _one_line(capsys, argv)
    assert not started and not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, expected", [
    (["gpu-check", "--device", "cpu", "--small", "--budget-s", "-5"], "--budget-s -5: must be > 0"),
    (["prepare-data", "--source", "bundled", "--out", "OUT", "--seq-len", "1"], "--seq-len must be >= 2, got 1"),
])
def test_other_subcommands_refuse_values_that_would_do_nothing(capsys, monkeypatch, tmp_path, argv, expected):
    """Before: gpu-check with a negative budget skipped every check and wrote reports; prepare-data
    wrote one-token rows, which no training run can read (data.seq_len >= 2)."""
    monkeypatch.chdir(tmp_path)
    assert expected in _one_line(capsys, [a if a != "OUT" else str(tmp_path / "out") for a in argv])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("case, expected, wrong", [
    ("missing source", "Fix the path in --source", "data.sources"),
    ("text field", "set --text-field to the field holding the document text", "data.text_field"),
    ("tokenizer", "or leave --tokenizer out for the bundled demo tokenizer", "null"),
    ("prepared source", "is a prepare-data output (already tokenized)", "JSONDecodeError"),
])
def test_prepare_data_errors_name_its_flags(capsys, monkeypatch, tmp_path, case, expected, wrong):
    """prepare-data takes the data settings as flags: its errors name them (before: "Fix the path in
    data.sources", "set data.text_field", "or null for the bundled demo tokenizer", keys it has no
    place for), and a prepare-data output given as a source is named as one (before: its index.json
    was read as a JSON document: a JSONDecodeError)."""
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"content": "a document"}\n')
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "index.json").write_text('{\n  "format": "dsa_train.pretokenized"\n}')
    argv = {"missing source": ["--source", str(tmp_path / "nope.jsonl")],
            "text field": ["--source", str(docs)],
            "tokenizer": ["--source", str(docs), "--text-field", "content", "--tokenizer", str(tmp_path / "nope")],
            "prepared source": ["--source", str(prepared)]}[case]
    line = _one_line(capsys, ["prepare-data", *argv, "--out", str(tmp_path / "out"), "--seq-len", "16"])
    assert expected in line and wrong not in line, line
    assert not (tmp_path / "out").exists()


def _real_checkpoint(directory, model_type: str, hidden: int, layers: int):
    """A downloaded checkpoint's directory, shrunk: its config.json, an index and one shard."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(
        {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers}))
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (directory / "model-00001-of-00163.safetensors").write_bytes(b"weights")
    return directory


def _contents(directory) -> list[tuple[str, bytes]]:
    return sorted((p.name, p.read_bytes()) for p in directory.iterdir())


def test_export_and_make_tiny_checkpoint_never_replace_a_model_they_did_not_write(capsys, tmp_path):
    """OUT given as a real checkpoint (swapped arguments, a typo): `export` replaced the shards of any
    model directory and `make-tiny-checkpoint` wrote a tiny random model over it; then a config saying
    `deepseek_v32` was taken for an earlier export, so a downloaded DeepSeek-V3.2-Exp given as OUT was
    still replaced. Now only a directory holding the command's own marker (written_by_dsa_train.json)
    is replaced, whatever its config.json says."""
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    tiny = tmp_path / "tiny"
    make_tiny_checkpoint(tiny)
    terminus = _real_checkpoint(tmp_path / "DeepSeek-V3.1-Terminus", "deepseek_v3", 7168, 61)
    v32 = _real_checkpoint(tmp_path / "DeepSeek-V3.2-Exp", "deepseek_v32", 7168, 61)
    for real, model_type in ((terminus, "deepseek_v3"), (v32, "deepseek_v32")):
        before = _contents(real)
        line = _one_line(capsys, ["export", str(tiny), str(real)])
        assert f"OUT {real} holds a model this command did not write ({model_type}, hidden 7168, 61 layers; " \
               "no written_by_dsa_train.json); it is never replaced; nothing was written — pass a new folder" in line
        line = _one_line(capsys, ["make-tiny-checkpoint", str(real)])
        assert f"holds a model this command did not write ({model_type}, hidden 7168, 61 layers" in line
        assert _contents(real) == before  # byte-identical, nothing added
        assert not list(tmp_path.glob(f".{real.name}.partial*"))
    # what each command wrote itself is replaced; the other command's output is not
    assert main(["make-tiny-checkpoint", str(tiny)]) == 0
    exported = tmp_path / "exported"
    assert main(["export", str(tiny), str(exported)]) == 0 and main(["export", str(tiny), str(exported)]) == 0
    line = _one_line(capsys, ["make-tiny-checkpoint", str(exported)])
    assert "holds a model this command did not write (a dsa_train export, says its written_by_dsa_train.json)" in line
    line = _one_line(capsys, ["export", str(exported), str(tiny)])
    assert "holds a model this command did not write (a dsa_train tiny-checkpoint" in line


def test_export_writes_its_marker_and_an_output_without_one_is_refused_with_a_fix_that_works(capsys, tmp_path):
    """The marker names the tool, its version, the command and the source; an output of a dsa_train
    from before the marker (the same directory without it) is refused, and the fix given works."""
    import dsa_train
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    tiny, exported = tmp_path / "tiny", tmp_path / "exported"
    make_tiny_checkpoint(tiny, seed=3)
    marker = json.loads((tiny / "written_by_dsa_train.json").read_text())
    assert marker == {"tool": "dsa_train", "version": dsa_train.__version__, "kind": "tiny-checkpoint",
                      "written_by": "dsa-train make-tiny-checkpoint", "made_from": "random weights, seed 3"}
    assert main(["export", str(tiny), str(exported)]) == 0
    marker = json.loads((exported / "written_by_dsa_train.json").read_text())
    assert (marker["kind"], marker["written_by"], marker["made_from"]) == ("export", "dsa-train export", str(tiny.resolve()))

    (exported / "written_by_dsa_train.json").unlink()  # as an older dsa_train left it
    before = _contents(exported)
    line = _one_line(capsys, ["export", str(tiny), str(exported)])
    assert "an output of an older dsa_train has no written_by_dsa_train.json either" in line
    assert _contents(exported) == before
    fix = line.split("`")[1]
    assert fix == f"rm -r {exported}"
    shutil.rmtree(exported)  # what `rm -r` does
    assert main(["export", str(tiny), str(exported)]) == 0 and (exported / "written_by_dsa_train.json").is_file()


def test_an_export_replacing_an_earlier_one_leaves_none_of_its_tokenizer_files(tmp_path):
    """An export over an earlier export of another model: the earlier shards went, but its tokenizer
    files stayed beside the new weights when the new source had none (a model with the wrong tokenizer)."""
    from dsa_train.checkpoint.export import TOKENIZER_FILES
    from dsa_train.checkpoint.tiny import make_tiny_checkpoint

    with_tokenizer, without = tmp_path / "with_tokenizer", tmp_path / "without"
    make_tiny_checkpoint(with_tokenizer, seed=1)
    make_tiny_checkpoint(without, seed=2)
    for name in TOKENIZER_FILES:
        (without / name).unlink(missing_ok=True)
    out = tmp_path / "exported"
    assert main(["export", str(with_tokenizer), str(out)]) == 0 and (out / "tokenizer.json").is_file()
    assert main(["export", str(without), str(out)]) == 0
    assert not [name for name in TOKENIZER_FILES if (out / name).exists()]
    assert json.loads((out / "written_by_dsa_train.json").read_text())["made_from"] == str(without.resolve())


def test_slurm_warns_of_node_local_paths_but_not_of_the_bundled_corpus_or_a_hub_dataset(tmp_path):
    """`data.sources=[bundled]` (the demo's) and a hub name were warned of as node-local paths when the
    job started under /tmp: neither is a path of the job (the corpus is in the installed package)."""
    from dsa_train.config import load_recipe
    from dsa_train.launch.launcher import node_local_paths

    (tmp_path / "docs.jsonl").write_text('{"text": "x"}\n')
    cfg = load_recipe("demo", ["data.sources=[bundled,HuggingFaceFW/fineweb-edu,docs.jsonl]", "run_dir=/shared/runs/d"])
    warned = node_local_paths(cfg, tmp_path)
    assert [w.split("=")[0] for w in warned] == ["data.sources[2]"], warned
    assert "docs.jsonl is on a node-local path" in warned[0]


def test_the_data_errors_keep_the_recipe_keys_outside_prepare_data(tmp_path):
    """Under training (no subcommand naming its flags) the same errors name the recipe keys."""
    from dsa_train.data.sources import DataSourceError, resolve_source
    from dsa_train.data.tokenizer import TokenizerNotFound, resolve_tokenizer_json

    with pytest.raises(DataSourceError, match="Fix the path in data.sources"):
        resolve_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TokenizerNotFound, match="leave data.tokenizer null"):
        resolve_tokenizer_json(str(tmp_path / "nope"))


@pytest.mark.parametrize("recipe", ["v3.2_sparse", "v3.2_warmup"])
def test_plan_of_a_one_process_profile_plans_one_rank(capsys, recipe):
    """`profile=smoke` runs the recipe in one process: its plan is of one rank. The plan applies the
    profile (`to_train_config`), which sets every parallel size to 1; with the cluster group's world
    (1024 ranks) that layout was refused ('parallel.data_parallel=1 but world size 1024 ...')."""
    import json

    assert main(["plan", "--json", "--config-name", recipe, "profile=smoke"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["world"] == 1 and plan["layout"]["dp"] == 1


@pytest.mark.parametrize("args, recipe, overrides", [
    (["--config-name", "demo", "parallel=zero2"], "demo", ["parallel=zero2"]),
    (["--config-name=demo", "~stages.pretrain", "optim.betas=[-0.9,0.99]"], "demo",
     ["~stages.pretrain", "optim.betas=[-0.9,0.99]"]),
    (["-cn", "demo", "stages.sparse.lr=2e-4", "run_name='a b'", "--max-restarts", "0"], "demo",
     ["stages.sparse.lr=2e-4", "run_name='a b'"]),
    (["recipe=demo", "+logging.wandb.tags=[x]"], "demo", ["+logging.wandb.tags=[x]"]),
    (["-cn=demo", "data.seq_len=64"], "demo", ["data.seq_len=64"]),  # Hydra's -cn=X (refused as an unknown option)
])
def test_launch_torchrun_passes_every_valid_override_through(monkeypatch, tmp_path, args, recipe, overrides):
    """The other side of the one-line refusals: Hydra group choices, +key / ~key, values that start
    with '-' inside an override and quoted values reach the workers' command line as given."""
    import dsa_train.launch.launcher as launcher

    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda cmd, env: started.append(cmd) or 0)
    monkeypatch.setattr(launcher, "check_recipe", lambda *a: None)  # the recipe's own checks: tested above
    assert main(["launch", "torchrun", "--nproc-per-node", "2", *args]) == 0
    (cmd,) = started
    assert cmd[cmd.index(launcher.TRAIN_MODULE) + 1:] == ["--config-name", recipe, *overrides]
