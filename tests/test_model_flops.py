"""FLOPs per token count the indexer (MFU is not under-reported) and follow the stage."""

import torch

import dsa_train
from dsa_train.config import Attention, StageConfig, Trainable
from dsa_train.model import flops
from dsa_train.stage import Stage


def test_matmul_params_match_the_model():
    cfg = dsa_train.tiny_config(n_routed_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=0,
                                num_nextn_predict_layers=0)
    model = dsa_train.DSAForCausalLM(cfg)
    counted = sum(sum(flops.layer_linear_params(cfg, i).values()) for i in range(cfg.num_hidden_layers))
    # with every expert active, the active matmul params are all Linear weights of the layers
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.startswith("model.layers."))
    router = sum(m.gate.weight.numel() for m in model.main_moe_modules())
    assert counted == linear + router


def test_indexer_flops_are_counted_and_stage_dependent():
    cfg = dsa_train.tiny_config()
    bigger = dsa_train.tiny_config(index_n_heads=cfg.index_n_heads * 4)
    T = 1024
    assert flops.flops_per_token(bigger, T, "sparse") > flops.flops_per_token(cfg, T, "sparse")
    warmup = Stage.of("warmup", StageConfig(attention=Attention.dense, trainable=Trainable.indexer)).flops_per_token(cfg, T)
    full = Stage.of("full", StageConfig(attention=Attention.dense, trainable=Trainable.all)).flops_per_token(cfg, T)
    assert 0 < warmup < full
    # sparse attention cost stops growing with T beyond k; dense keeps growing
    a = flops.attention_flops_per_token(cfg, 4096, "sparse", topk=64)["main"]
    b = flops.attention_flops_per_token(cfg, 8192, "sparse", topk=64)["main"]
    assert abs(b - a) / a < 0.02
    assert flops.attention_flops_per_token(cfg, 8192, "dense")["main"] > 1.9 * flops.attention_flops_per_token(cfg, 4096, "dense")["main"]
