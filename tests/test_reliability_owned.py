"""Reliability III (issue 30), class 1: nothing a user owns is deleted or rewritten by a command
that does not own it. Every test asserts the exit code, one line without a traceback, and that the
folders around the command (sources, run directory) hash the same before and after."""

import json
import os
import shutil
from pathlib import Path

import pytest

# `datasets` binds its log handler to sys.stderr when first imported: import it here, not inside a
# test whose captured stderr is closed afterwards (later tests would print "--- Logging error ---")
import datasets  # noqa: F401,E402

from tests.reliability_helpers import TINY, one_line, run, suggested_command, tree_hash

CORPUS = Path(__file__).resolve().parents[1] / "dsa_train" / "assets" / "corpus" / "demo_corpus.jsonl"


@pytest.fixture
def corpus(tmp_path):
    """A user's folder: a small source corpus and a subfolder of their own."""
    src = tmp_path / "corpus"
    (src / "notes").mkdir(parents=True)
    lines = CORPUS.read_text().splitlines()[:12]
    (src / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (src / "notes" / "readme.txt").write_text("mine\n")
    return src


# ------------------------------------------------------------------ prepare-data
@pytest.mark.parametrize("overwrite", [False, True])
def test_prepare_data_never_replaces_the_folder_holding_its_source(corpus, capsys, overwrite):
    before = tree_hash(corpus)
    done = run(capsys, "prepare-data", "--source", str(corpus / "docs.jsonl"), "--out", str(corpus), "--seq-len", "64",
               *(["--overwrite"] if overwrite else []))
    line = one_line(done, f"--out {corpus} holds the source", "nothing was written or deleted", "--out ")
    assert tree_hash(corpus) == before
    # the --out it suggests works
    out = Path(line.rsplit("--out ", 1)[1].split()[0])
    assert not out.exists()
    done = run(capsys, "prepare-data", "--source", str(corpus / "docs.jsonl"), "--out", str(out), "--seq-len", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "index.json").is_file() and tree_hash(corpus) == before


def test_prepare_data_never_replaces_a_folder_it_did_not_write(corpus, tmp_path, capsys):
    """A non-empty folder that is not a prepared dataset: refused with or without --overwrite; an
    empty folder is used; its own dataset is replaced with --overwrite only."""
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    before = tree_hash(mine, corpus)
    for extra in ([], ["--overwrite"]):
        done = run(capsys, "prepare-data", "--source", str(corpus / "docs.jsonl"), "--out", str(mine), "--seq-len", "64",
                   *extra)
        one_line(done, f"--out {mine} is a folder that prepare-data did not write", "thesis.tex",
                 "with or without --overwrite")
        assert tree_hash(mine, corpus) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["prepare-data", "--source", str(corpus / "docs.jsonl"), "--out", str(empty), "--seq-len", "64"]
    assert run(capsys, *args).returncode == 0
    prepared = tree_hash(empty)
    one_line(run(capsys, *args), "already holds a prepared dataset", "pass --overwrite")
    assert tree_hash(empty) == prepared
    assert run(capsys, *args, "--overwrite", "--no-bos").returncode == 0
    assert json.loads((empty / "index.json").read_text())["add_bos"] is False
    # a file of the user's beside prepare-data's own: not prepare-data's folder any more
    (empty / "my_notes.txt").write_text("x\n")
    before = tree_hash(empty)
    one_line(run(capsys, *args, "--overwrite"), "did not write", "my_notes.txt")
    assert tree_hash(empty) == before


@pytest.mark.integration
def test_prepare_data_removes_its_temporary_folder_and_a_stale_one(corpus, tmp_path, capsys, monkeypatch):
    """A failure half-way (a source that is not JSON lines) leaves no `.OUT.tmp-<pid>`; the
    temporary folder of a killed run (its pid gone) is removed at the next start."""
    stale = tmp_path / ".out.tmp-999999999"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    done = run(capsys, "prepare-data", "--source", str(bad), "--out", str(tmp_path / "out"), "--seq-len", "64")
    one_line(done, f"{bad}:2")
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "corpus"]


# ------------------------------------------------------------------ a refused run changes nothing
def _fake_previous_run(run_dir: Path) -> None:
    """What an earlier run left: Hydra's files, the log, metrics."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("stages:\n  sparse:\n    topk: 64\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("- stages.sparse.topk=64\n")
    (run_dir / "train.log").write_text("the earlier run's log\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")


@pytest.mark.integration
def test_a_run_refused_for_a_locked_run_dir_changes_nothing_there(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _fake_previous_run(run_dir)
    lock = run_dir / ".dsa-train.lock"
    lock.write_text(json.dumps({"host": "another-host", "pid": 1, "started": "earlier", "job": None}))
    before = tree_hash(run_dir)
    done = run(capsys, f"run_dir={run_dir}", *TINY, "stages.sparse.topk=16")
    one_line(done, "is in use by another run", "another-host")
    assert tree_hash(run_dir) == before


def test_an_output_folder_under_a_file_is_one_line_before_any_work(tmp_path, capsys):
    """run_dir, checkpoint.dir or the W&B folder passing through a regular file (no permission
    bits of root bypass that; a read-only mount: tests/test_reliability_disk.py)."""
    parent = tmp_path / "blocked"
    parent.write_text("a file of the user's\n")
    before = tree_hash(tmp_path)
    one_line(run(capsys, f"run_dir={parent / 'run'}", *TINY), f"run_dir: {parent / 'run'} cannot be a folder",
             f"{parent} is a file")
    one_line(run(capsys, f"run_dir={tmp_path / 'run'}", *TINY, "logging.wandb_mode=offline",
                 f"logging.wandb_dir={parent / 'wandb'}"), "logging.wandb_dir", f"{parent} is a file")
    assert tree_hash(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """A finished tiny run through the command line (sparse top-k 16), kept for the module."""
    from dsa_train.cli import main

    run_dir = tmp_path_factory.mktemp("owned") / "run"
    try:
        code = main([f"run_dir={run_dir}", *TINY])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 0
    yield run_dir
    shutil.rmtree(run_dir.parent, ignore_errors=True)


@pytest.fixture
def trained(trained_once, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_once, run_dir)
    return run_dir


@pytest.mark.integration
def test_the_run_writes_hydra_files_and_log_once_it_goes_ahead(trained):
    saved = (trained / ".hydra" / "config.yaml").read_text()
    assert "topk: 16" in saved and "stages.sparse.topk=16" in (trained / ".hydra" / "overrides.yaml").read_text()
    assert "hydra.output_subdir" not in (trained / ".hydra" / "overrides.yaml").read_text()
    assert "stage sparse" in (trained / "train.log").read_text()


@pytest.mark.integration
def test_a_run_refused_for_a_recipe_change_changes_nothing_and_its_fix_works(trained, capsys, tmp_path):
    before = tree_hash(trained)
    done = run(capsys, f"run_dir={trained}", *TINY, "stages.sparse.topk=8")
    line = one_line(done, "stages.sparse.topk: 16 (checkpoint) -> 8", "dsa-train export")
    assert tree_hash(trained) == before  # .hydra/, train.log, metrics.jsonl, checkpoints: untouched
    # the fix it gives: export the weights, then a new run from them
    argv = suggested_command(line)
    assert run(capsys, *argv).returncode == 0
    pretrained = line.rsplit("model.pretrained=", 1)[1].split()[0].rstrip(")")
    assert Path(pretrained, "config.json").is_file()
    done = run(capsys, f"run_dir={tmp_path / 'new'}", *TINY, "stages.sparse.topk=8", f"model.pretrained={pretrained}",
               "~stages.warmup")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.integration
def test_export_takes_the_trained_recipe_from_the_checkpoint_not_hydra(trained, capsys, tmp_path):
    """`.hydra/` describes the last command run in the folder; the export's index_topk is the
    top-k the checkpoint trained with (its trainer_state.json), whatever `.hydra/` says."""
    config = trained / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("topk: 16", "topk: 4"))
    assert run(capsys, "export", str(trained), str(tmp_path / "exported")).returncode == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["index_topk"] == 16


@pytest.mark.integration
def test_export_never_writes_into_a_folder_of_the_users(trained, capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{\"mine\": true}\n")
    before = tree_hash(mine, trained)
    one_line(run(capsys, "export", str(trained), str(mine)), f"OUT {mine} is a folder that is not a model directory",
             "config.json", "nothing was written")
    one_line(run(capsys, "make-tiny-checkpoint", str(mine)), f"OUT {mine} is a folder that is not a model directory")
    one_line(run(capsys, "export", str(trained), str(trained)), f"OUT {trained} is the source", "nothing was written")
    assert tree_hash(mine, trained) == before
    # an earlier export is replaced
    out = tmp_path / "exported"
    assert run(capsys, "export", str(trained), str(out)).returncode == 0
    assert run(capsys, "export", str(trained), str(out)).returncode == 0


@pytest.mark.integration
def test_a_finished_run_without_its_export_says_how_to_write_it_and_that_works(trained, capsys):
    """A rerun of a finished run whose end-of-run export is missing (stopped during it, or
    checkpoint.export=false) gives the export command; once run, the message points at the export."""
    done = run(capsys, f"run_dir={trained}", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if "already finished" in x)
    assert "is missing" in line
    assert run(capsys, *suggested_command(line)).returncode == 0
    done = run(capsys, f"run_dir={trained}", *TINY)
    assert f"model.pretrained={trained / 'export'}" in done.stdout and (trained / "export" / "config.json").is_file()


@pytest.mark.integration
def test_starting_from_the_export_of_a_run_that_has_not_exported_says_what_to_run(trained, capsys, tmp_path):
    """The sparse recipe started before the warm-up (model.pretrained = the warm-up's export): 'run
    that recipe first'; a run with checkpoints but no export: the export command, which works."""
    missing = tmp_path / "runs" / "v3.2_warmup-smoke" / "export"
    one_line(run(capsys, f"run_dir={tmp_path / 'a'}", *TINY, f"model.pretrained={missing}"),
             f"{missing} does not exist yet", "run that recipe first", "--config-name v3.2_warmup")
    assert not (tmp_path / "a").exists()
    before = tree_hash(trained)
    line = one_line(run(capsys, f"run_dir={tmp_path / 'b'}", *TINY, f"model.pretrained={trained / 'export'}"),
                    "has not finished (or did not export)", f"`dsa-train export {trained} {trained / 'export'}`")
    assert tree_hash(trained) == before
    assert run(capsys, *suggested_command(line)).returncode == 0
    from dsa_train.config import compose_recipe, to_train_config

    to_train_config(compose_recipe("demo", [f"run_dir={tmp_path / 'b'}", *TINY, f"model.pretrained={trained / 'export'}"]),
                    check_environment=True)
