"""Recipes compose against the structured schema; bad keys, types and values fail by name."""

import pytest
from hydra.errors import ConfigCompositionException

from dsa_train.config import (
    Attention,
    ConfigError,
    Trainable,
    compose_recipe,
    load_recipe,
    recipes_dir,
)

V32_REQUIRED = ["model.pretrained=/ckpt/terminus", "data.sources=[/data/long.parquet]"]


@pytest.mark.parametrize(
    "recipe, overrides",
    [("demo", []), ("small_32k", []), ("v3.2_warmup", V32_REQUIRED), ("v3.2_sparse", ["data.sources=[x.parquet]"])],
)
def test_recipes_compose_and_validate(recipe, overrides):
    cfg = load_recipe(recipe, overrides)
    assert cfg.stages
    assert "${now" not in str(compose_recipe(recipe, overrides).run_dir)


def test_demo_chains_the_two_report_stages():
    cfg = load_recipe("demo")
    assert list(cfg.stages) == ["pretrain", "warmup", "sparse"]
    warmup, sparse = cfg.stages["warmup"], cfg.stages["sparse"]
    assert (warmup.attention, warmup.trainable, warmup.lm_loss_coef) == (Attention.dense, Trainable.indexer, 0.0)
    assert (sparse.attention, sparse.trainable) == (Attention.sparse, Trainable.all)
    assert sparse.lm_loss_coef > 0 and sparse.indexer_loss_coef > 0
    assert cfg.model.pretrained is None and cfg.data.sources == ["bundled"]
    assert cfg.run_dir == "runs/demo"


def test_v32_recipes_carry_the_report_numbers():
    warmup = load_recipe("v3.2_warmup", V32_REQUIRED)
    sparse = load_recipe("v3.2_sparse", ["data.sources=[x.parquet]"])
    w, s = warmup.stages["warmup"], sparse.stages["sparse"]
    assert (w.lr, w.steps, w.global_batch_size, w.trainable) == (1e-3, 1000, 16, Trainable.indexer)
    assert (s.lr, s.steps, s.global_batch_size, s.topk, s.trainable) == (7.3e-6, 15000, 480, 2048, Trainable.all)
    assert warmup.data.seq_len == sparse.data.seq_len == 131072
    # 2.1B and 943.7B tokens
    assert w.steps * w.global_batch_size * warmup.data.seq_len == 2_097_152_000
    assert s.steps * s.global_batch_size * sparse.data.seq_len == 943_718_400_000
    # the sparse stage starts from the warm-up's export, tokenizer from the checkpoint
    assert sparse.model.pretrained == "runs/v3.2_warmup/export"
    assert sparse.data.tokenizer == sparse.model.pretrained


def test_v32_warmup_requires_the_checkpoint_path():
    with pytest.raises(ConfigError, match="model.pretrained has no value"):
        load_recipe("v3.2_warmup", ["data.sources=[x.parquet]"])
    with pytest.raises(ConfigError, match="data.sources"):
        load_recipe("v3.2_warmup", ["model.pretrained=/ckpt"])


def test_unknown_key_on_the_command_line_names_it():
    with pytest.raises(ConfigCompositionException) as err:
        compose_recipe("demo", ["stages.warmup.stpes=3"])
    assert "stpes" in str(err.value.__cause__ or err.value)


@pytest.mark.parametrize(
    "override, key",
    [("stages.sparse.steps=many", "stages.sparse.steps"),
     ("stages.sparse.attention=sprase", "stages.sparse.attention"),
     ("data.seq_len=1.5", "data.seq_len"),
     ("logging.wandb_mode=sometimes", "logging.wandb_mode")],
)
def test_wrong_type_on_the_command_line_names_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_recipe("demo", [override])
    assert key in str(err.value.__cause__ or err.value)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def compose_from(tmp_path, name, overrides=()):
    from hydra import compose, initialize_config_dir
    from dsa_train.config import register_configs

    register_configs()
    overrides = [f"hydra.searchpath=[file://{recipes_dir()}]", *overrides]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        return compose(config_name=name, overrides=overrides)


def test_unknown_key_in_a_recipe_yaml_names_it(tmp_path):
    write(tmp_path / "typo.yaml", "defaults:\n  - demo\n  - _self_\nstages:\n  warmup:\n    lerning_rate: 1e-3\n")
    with pytest.raises(ConfigCompositionException) as err:
        compose_from(tmp_path, "typo")
    assert "lerning_rate" in str(err.value.__cause__ or err.value)


def test_unknown_key_in_a_group_yaml_names_it(tmp_path):
    write(tmp_path / "typo.yaml", "defaults:\n  - demo\n  - override model: typo\n  - _self_\n")
    write(tmp_path / "model" / "typo.yaml", "pretrained: null\ndtpye: float32\n")
    with pytest.raises(ConfigCompositionException) as err:
        compose_from(tmp_path, "typo")
    assert "dtpye" in str(err.value.__cause__ or err.value)


def test_wrong_type_in_a_yaml_names_the_key(tmp_path):
    write(tmp_path / "bad.yaml", "defaults:\n  - demo\n  - _self_\ndata:\n  micro_batch_size: four\n")
    with pytest.raises(ConfigCompositionException) as err:
        compose_from(tmp_path, "bad")
    assert "data.micro_batch_size" in str(err.value.__cause__ or err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [(["stages.sparse.global_batch_size=6"], "stages.sparse.global_batch_size"),
     (["stages.warmup.indexer_loss_coef=0"], "stages.warmup.indexer_loss_coef"),
     (["stages.warmup.topk_recall_queries=8"], "stages.warmup.topk_recall_queries"),
     (["stages.sparse.lm_loss_coef=0", "stages.sparse.indexer_loss_coef=0"], "stages.sparse.lm_loss_coef"),
     (["model.pretrained=/ckpt", "+model.arch.hidden_size=64"], "model.arch"),
     (["data.sources=[]"], "data.sources")],
)
def test_semantic_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_recipe("demo", overrides)


def test_the_recipe_data_section_is_what_the_data_loader_takes():
    from dsa_train.data import BUNDLED_SOURCE, DataConfig

    cfg = load_recipe("demo", ["data.seq_len=64"])
    assert type(cfg.data) is DataConfig and cfg.data.seq_len == 64
    assert DataConfig().sources == [BUNDLED_SOURCE]


def test_small_32k_model_is_a_valid_one_gpu_model():
    import torch

    from dsa_train.model import DSAForCausalLM, tiny_config

    cfg = load_recipe("small_32k")
    model_cfg = tiny_config(vocab_size=4096, **cfg.model.arch)
    model_cfg.validate()
    assert model_cfg.max_position_embeddings >= cfg.data.seq_len == 32768
    assert (model_cfg.kv_lora_rank, model_cfg.qk_rope_head_dim) == (512, 64)  # the 576/512 MQA latent
    assert cfg.stages["sparse"].topk < cfg.data.seq_len
    with torch.device("meta"):
        n_params = sum(p.numel() for p in DSAForCausalLM(model_cfg).parameters())
    assert 0.5e9 < n_params < 1.5e9
