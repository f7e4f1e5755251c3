"""Reliability III (issue 30), classes 3-5: every failure one line with a fix that works (Hydra's
own errors included), identity checks, signals and temporary files at start-up, numbers that do
not mislead. Each test asserts the exit code, one line without a traceback, that the folders around
the command did not change, and runs the fix the message suggests."""

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

import datasets  # noqa: F401 -- binds its log handler to the real stderr (see test_reliability_owned.py)

from tests.reliability_helpers import REPO, TINY, one_line, run, tree_hash

CORPUS = REPO / "dsa_train" / "assets" / "corpus" / "demo_corpus.jsonl"


# ------------------------------------------------------------------ Hydra's errors, in the project's format
def test_an_unknown_recipe_name_says_did_you_mean_and_the_suggestion_works(capsys):
    line = one_line(run(capsys, "--config-name", "v3.2_warmpu", "--cfg", "job"),
                    "--config-name v3.2_warmpu: no such recipe", "did you mean v3.2_warmup")
    suggestion = re.search(r"did you mean (\S+?)[ ?]", line).group(1)
    assert run(capsys, "--config-name", suggestion, "--cfg", "job").returncode == 0


def test_a_list_value_without_brackets_says_use_brackets_and_that_works(tmp_path, capsys):
    line = one_line(run(capsys, f"data.sources={CORPUS}", "--cfg", "job"), "data.sources is a list",
                    f"use data.sources=[{CORPUS}]")
    fixed = re.search(r"use (\S+)", line).group(1)
    done = run(capsys, fixed, "--cfg", "job")
    assert done.returncode == 0 and str(CORPUS) in done.stdout


def test_an_unquoted_non_ascii_path_says_how_to_quote_it_and_that_works(tmp_path, capsys):
    folder = tmp_path / "données"
    folder.mkdir()
    line = one_line(run(capsys, f"data.sources=[{folder}]", "--cfg", "job"), "ASCII", "quote the value")
    fixed = re.search(r'"([^"]+)"', line).group(1)  # the argument, without the shell's double quotes
    done = run(capsys, fixed, "--cfg", "job")
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(folder) in done.stdout


def test_a_recipe_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    broken = recipes / "mine.yaml"
    broken.write_text("defaults:\n  - base\n  - _self_\nrun_name: mine\nstages:\n  warm: {steps: 2\n    lr: [1\n")
    before = tree_hash(recipes)
    one_line(run(capsys, "--config-dir", str(recipes), "--config-name", "mine", "--cfg", "job"),
             f"{broken}:7: YAML syntax error", f"fix line 7 of {broken}")
    assert tree_hash(recipes) == before
    broken.write_text("defaults:\n  - demo\n  - _self_\nrun_name: mine\n")  # fixed as it says
    assert run(capsys, "--config-dir", str(recipes), "--config-name", "mine", "--cfg", "job").returncode == 0


def test_a_value_of_the_wrong_type_is_one_line(capsys):
    one_line(run(capsys, "stages.sparse.steps=abc", "--cfg", "job"), "stages.sparse.steps=abc", "Integer")


def test_the_validator_never_divides_before_checking(tmp_path, capsys):
    """data.micro_batch_size=0 was a ZeroDivisionError; nothing is written (not even the run dir)."""
    one_line(run(capsys, f"run_dir={tmp_path / 'run'}", *TINY, "data.micro_batch_size=0"),
             "data.micro_batch_size: must be >= 1")
    assert not (tmp_path / "run").exists()
    from dsa_train.config import load_recipe
    from dsa_train.config.validate import ConfigError, check_global_batches, collect_problems

    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_recipe("demo", [*TINY, "data.micro_batch_size=0"])
    cfg = load_recipe("demo", TINY)
    cfg.data.micro_batch_size = 0
    with collect_problems():  # the launcher's check: skipped rather than divided by zero
        check_global_batches(cfg, 2)


# ------------------------------------------------------------------ every --out checked before work
def test_eval_out_naming_a_file_is_refused_before_the_evaluation(tmp_path, capsys):
    target = tmp_path / "results.json"
    target.write_text("{}\n")
    before = tree_hash(tmp_path)
    one_line(run(capsys, "eval", str(tmp_path / "no-model-needed"), "--out", str(target)),
             f"--out {target}", "is a file, not a directory", "nothing was evaluated")
    assert tree_hash(tmp_path) == before


def test_eval_of_a_directory_without_a_model_names_what_it_takes(tmp_path, capsys):
    # a run directory with neither export/ nor a checkpoint: eval reads training checkpoints itself,
    # so the fix is what to pass (no export command: there is nothing to export either)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    line = one_line(run(capsys, "eval", str(run_dir), "--out", str(tmp_path / "e")), "checkpoints/step_N")
    assert str(run_dir) in line and "Hugging Face directory" in line and "dsa-train export" not in line


@pytest.mark.integration
# ------------------------------------------------------------------ signals and temporary files at start-up
def test_sigterm_during_start_up_is_one_line_and_leaves_no_temporary_folder(tmp_path, capsys, monkeypatch):
    """SIGTERM while the data cache is being built (before any step): exit 75 with one line, the
    cache's temporary folder removed on the way out, no run directory; the same command again works."""
    import dsa_train.data.prepare as prepare

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:40]) + "\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSA_TRAIN_CACHE", str(cache))
    real = prepare.iter_texts

    def interrupted(*args, **kwargs):
        for texts in real(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or Slurm would, mid-build
            yield texts

    monkeypatch.setattr(prepare, "iter_texts", interrupted)
    handler_before = signal.getsignal(signal.SIGTERM)
    argv = [f"run_dir={tmp_path / 'run'}", *TINY, f"data.sources=[{corpus}]", "~stages.sparse",
            "stages.warmup.steps=1"]
    one_line(run(capsys, *argv), "stopped by SIGTERM outside the training loop", "run the same command again",
             code=75)
    leftovers = [p.name for p in (cache / "packed").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [] and not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the start-up handler is gone with the command
    monkeypatch.setattr(prepare, "iter_texts", real)
    done = run(capsys, *argv)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_stale_or_truncated_data_cache_is_rebuilt_not_reported(tmp_path, caplog):
    """The cache is the project's own: a `.tmp-<pid>` of a killed build is removed at the next start,
    a truncated entry is built again (it used to point at `prepare-data --overwrite`)."""
    from dsa_train.data import PackedDataset, load_tokenizer

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    tokenizer = load_tokenizer(None)
    first = PackedDataset.from_sources([str(corpus)], tokenizer, 64, cache_dir=tmp_path / "cache")
    rows = [first[i]["input_ids"].tolist() for i in range(len(first))]
    entry = first.path
    stale = entry.parent / f".{entry.name}.tmp-999999999"
    stale.mkdir()
    tokens = entry / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        again = PackedDataset.from_sources([str(corpus)], tokenizer, 64, cache_dir=tmp_path / "cache")
    assert not stale.exists() and "truncated: building it again" in caplog.text
    assert [again[i]["input_ids"].tolist() for i in range(len(again))] == rows


def test_a_truncated_prepared_dataset_gives_a_prepare_command_that_works(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    out = tmp_path / "prepared"
    assert run(capsys, "prepare-data", "--source", str(corpus), "--out", str(out), "--seq-len", "64").returncode == 0
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:100])
    from dsa_train.data import DataSourceError, PackedDataset

    with pytest.raises(DataSourceError) as err:
        PackedDataset(out)
    line = str(err.value)
    command = line[line.index("`dsa-train ") + 1:].split("`")[0]
    import shlex

    assert run(capsys, *shlex.split(command)[1:]).returncode == 0
    assert len(PackedDataset(out)) > 0


# ------------------------------------------------------------------ identity: the data tokenizer against the checkpoint's
def test_a_data_tokenizer_with_the_same_size_but_other_ids_is_refused(tmp_path, capsys):
    from dsa_train.config import compose_recipe, to_train_config
    from dsa_train.config.validate import ConfigError

    ckpt = tmp_path / "tiny"
    assert run(capsys, "make-tiny-checkpoint", str(ckpt)).returncode == 0
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "the", "and"  # two ordinary tokens of the bundled vocabulary trade ids: same size, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    before = tree_hash(ckpt)
    args = [f"run_dir={tmp_path / 'run'}", *TINY, f"model.pretrained={ckpt}", "profile=smoke"]
    line = one_line(run(capsys, *args), "is not the tokenizer of model.pretrained",
                    "the same vocabulary size (4096) but other ids", f"data.tokenizer={ckpt}",
                    "data.allow_tokenizer_mismatch=true")
    assert tree_hash(ckpt) == before and not (tmp_path / "run").exists()
    # both fixes it names pass the start-up checks; the override is recorded in the recipe
    for fix in (f"data.tokenizer={ckpt}", "data.allow_tokenizer_mismatch=true"):
        assert fix in line
        cfg = to_train_config(compose_recipe("demo", [*args[:-1], fix]), check_environment=True)
    assert cfg.data.allow_tokenizer_mismatch is True
    with pytest.raises(ConfigError, match="other ids"):
        to_train_config(compose_recipe("demo", args[:-1]), check_environment=True)


# ------------------------------------------------------------------ numbers that do not mislead
def _metrics_file(run_dir: Path, step_times: list[float], tokens: int, flops_per_token: float, peak: float) -> None:
    records = [{"run": {"stages": {"sparse": {"attention": "sparse", "trainable": "all", "steps": len(step_times)}}}}]
    for i, t in enumerate(step_times, 1):
        records.append({"step": i, "metrics": {
            "perf/step_time_s": t, "perf/tokens_per_s": tokens / t,
            "perf/tflops_per_gpu": tokens * flops_per_token / t / 1e12, "perf/mfu": tokens * flops_per_token / t / peak,
            "train/loss": 1.0, "progress/stage": 0, "progress/global_step": i, "progress/tokens": tokens * i}})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_throughput_is_tokens_over_time_not_a_mean_of_rates(tmp_path, capsys):
    """Steps of 5 s (start-up, left out), 1 s, 3 s and 0.5 s of 1000 tokens: 3000 tokens in 4.5 s
    is 666.7 tokens/s; the mean of the rates (1000, 333, 2000) would read 1111."""
    run_dir = tmp_path / "run"
    _metrics_file(run_dir, [5.0, 1.0, 3.0, 0.5], 1000, 6e9, 1e15)
    from dsa_train.logging.report import load_run, stage_throughput

    data = load_run(run_dir)
    got = stage_throughput([data.steps[s] for s in sorted(data.steps)])
    assert got["tokens_per_s"] == pytest.approx(3000 / 4.5)
    assert got["tflops_per_gpu"] == pytest.approx(3000 * 6e9 / 4.5 / 1e12)
    assert got["mfu"] == pytest.approx(3000 * 6e9 / (4.5 * 1e15))
    done = run(capsys, "report", str(run_dir), "--no-plots")
    assert done.returncode == 0
    assert "666.7" in done.stdout and "1111" not in done.stdout
    assert "0.40%" in done.stdout  # MFU = 1.8e13 FLOPs / (4.5 s * 1e15)


def test_eval_marks_the_rows_a_run_trained_on_at_any_length(tmp_path, capsys):
    """`dsa-train eval RUN --seq-len 128` on a run trained at 64: a row of 128 tokens overlaps the
    training data when any of its tokens lies in a trained 64-token window; the table says so."""
    from dsa_train.data import PackedDataset, ShardedEpochSampler, load_tokenizer
    from dsa_train.eval.overlap import TrainedSpans, overlapping_rows, training_of
    from dsa_train.eval.report import print_tables

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:30]) + "\n")
    tok = load_tokenizer(None)
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    data = {"sources": [str(corpus)], "seq_len": 64, "micro_batch_size": 2, "seed": 7, "cache_dir": str(tmp_path / "c")}

    def trained_for(tokens_seen):
        (step / "trainer_state.json").write_text(json.dumps(
            {"recipe": {"data": data, "eval": {"enabled": False}}, "tokens_seen": tokens_seen}))
        training = training_of(tmp_path / "run" / "export")  # the model: the run's export
        return training, TrainedSpans(training, tok)

    training, spans = trained_for(4 * 64)  # two steps of two rows
    at64 = PackedDataset.from_sources([str(corpus)], tok, 64, cache_dir=tmp_path / "c")
    visited = set(ShardedEpochSampler(len(at64), 2, 7).epoch_permutation(0)[:4].tolist())
    at128 = PackedDataset.from_sources([str(corpus)], tok, 128, cache_dir=tmp_path / "c")
    rows = list(range(len(at128)))
    expected = [r for r in rows if any(t * 64 <= r * 128 + 128 and r * 128 <= t * 64 + 64 for t in visited)]
    got = overlapping_rows(training, spans, [str(corpus)], rows, 128)
    assert got == expected and 0 < len(got) < len(rows)
    assert overlapping_rows(training, spans, ["bundled"], rows, 128) == []  # other texts
    assert overlapping_rows(None, None, [str(corpus)], rows, 128) is None  # not a run: unknown
    training, spans = trained_for(10 * len(at64) * 64)  # ten epochs: every row
    assert overlapping_rows(training, spans, [str(corpus)], rows, 128) == rows
    doc = {"models": [{"model": "run", "topk": 16, "lengths": [{"seq_len": 128, "rows": [0, 1], "rows_overlapping_training": [1],
                                                                "layers": [], "modes": {"dense": {"loss": 1.0, "perplexity": 2.7, "buckets": []}}}]}]}
    from rich.console import Console

    console = Console(width=300, record=True)
    print_tables(doc, console)
    assert "1 of the 2 sequences overlap the run's training data (rows [1]): not held out" in console.export_text()


def test_a_mistyped_key_inside_a_recipe_file_names_it_with_a_suggestion(tmp_path, capsys):
    """A recipe of the user's (--config-dir) over a shipped one: its unknown key is one line with
    the closest known key, not Hydra's paragraph."""
    (tmp_path / "mine.yaml").write_text("defaults:\n  - demo\n  - _self_\noptim:\n  weight_decya: 0.0\n")
    one_line(run(capsys, "--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job"),
             "recipe mine: optim.weight_decya: no such key (did you mean optim.weight_decay?)")
    (tmp_path / "mine.yaml").write_text("defaults:\n  - demo\n  - _self_\noptim:\n  weight_decay: 0.0\n")
    assert run(capsys, "--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job").returncode == 0


@pytest.mark.integration
def test_a_nan_stop_gives_fixes_that_work(tmp_path, capsys, monkeypatch):
    """fault_tolerance.nonfinite=stop at a NaN step: one line, exit 2; the fixes it names work:
    resuming with nonfinite=skip (a resume applies it), and the export its lr fix starts from."""
    from dsa_train import faults

    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "step=3,kind=nan")
    args = [f"run_dir={run_dir}", *TINY]
    line = one_line(run(capsys, *args, "fault_tolerance.nonfinite=stop"), "non-finite", "at global step 3",
                    "fault_tolerance.nonfinite=skip", "dsa-train export")
    assert "Lower the stage's lr" not in line  # a resume refuses an lr change of the stage in progress
    export = re.search(r"`dsa-train export (\S+) (\S+)`", line)
    assert run(capsys, "export", export.group(1), export.group(2)).returncode == 0
    assert Path(export.group(2), "config.json").is_file()
    done = run(capsys, *args, "fault_tolerance.nonfinite=skip")
    assert done.returncode == 0, done.stderr[-3000:]
