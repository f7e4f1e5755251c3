"""Bytes the expert-parallel MoE dispatch sends per training step and rank in the 671B layouts
(docs/distributed.md, "Expert parallel"), before and after the dispatcher's per-rank
de-duplication, from the routing statistics of the model's own `Router` and the dispatcher's own
pairing rule (`dsa_train.parallel.expert.destination_pairs`).

    python benchmarks/moe_dispatch_bytes.py [--seed 0] [--tokens N]

For each 671B recipe: one micro-batch's tokens on one rank (seq_len x micro_batch / CP) are routed
by a 671B router (256 experts, 8 groups, top-4 groups, top-8; random weights, std
`initializer_range`, zero correction bias: near-uniform loads, what aux-loss-free balancing aims
at) on unit-variance hidden states. Per MoE layer and micro-batch:
  before: one row per (token, expert) slot: tokens [slots, h] and expert ids [slots] int64 out, the
          outputs [slots, h] back; backward: both [slots, h] again (reverse all-to-alls);
  after:  one row per (token, EP rank it meets): tokens [pairs, h] and routing weights
          [pairs, E/EP] fp32 out, summed outputs [pairs, h] back; backward: [pairs, h] twice and
          the weights' gradient [pairs, E/EP] fp32; plus the counts [EP, 1 + E/EP] int64 once.
Rows a rank sends to itself are counted (NCCL copies them too); the share that leaves the rank is
1 - 1/EP of each for tokens that start on a uniformly random rank. Also printed: rows that leave
the node (8 GPUs), and distinct destination nodes per token -- what a two-hop (per-node)
dispatch, not built, would send over the network. One JSON line per recipe.
"""

from __future__ import annotations

import argparse
import json

import torch

from dsa_train.config.recipes import compose_recipe
from dsa_train.model.config import DSAConfig
from dsa_train.model.moe import Router
from dsa_train.parallel.expert import destination_pairs

RECIPES = ("v3.2_warmup", "v3.2_sparse")


def routing_stats(config: DSAConfig, n_tokens: int, ep: int, gpus_per_node: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * config.initializer_range)
        ids, _ = router(torch.randn(n_tokens, config.hidden_size, generator=g))
    per_rank = config.n_routed_experts // ep
    dest = ids // per_rank  # [N, k] EP rank of each slot
    _, pairs_per_rank = destination_pairs(dest, ep)
    nodes = dest // gpus_per_node
    node_pairs = sum(len(set(row)) for row in nodes.tolist())
    slots, pairs = ids.numel(), int(pairs_per_rank.sum())
    # a token starting on a uniformly random rank: a slot / pair stays on its node w.p. 1/nodes
    ep_nodes = max(ep // gpus_per_node, 1)
    return {"tokens": n_tokens, "slots_per_token": slots / n_tokens, "pairs_per_token": pairs / n_tokens,
            "nodes_per_token": node_pairs / n_tokens, "ep_nodes": ep_nodes, "experts_per_rank": per_rank}


def step_bytes(stats: dict, h: int, elem: int, ep: int, per_rank: int, layers: int, micro_batches: int) -> dict:
    n = stats["tokens"]
    slots, pairs = stats["slots_per_token"] * n, stats["pairs_per_token"] * n
    row = h * elem
    before = {"forward": slots * (row + 8) + slots * row + ep * 8, "backward": 2 * slots * row}
    after = {"forward": pairs * (row + 4 * per_rank) + pairs * row + ep * (1 + per_rank) * 8,
             "backward": 2 * pairs * row + pairs * 4 * per_rank}
    scale = layers * micro_batches / 1e9
    out = {}
    for name, d in (("before", before), ("after", after)):
        out[name] = {"forward_GB": d["forward"] * scale, "recompute_forward_GB": d["forward"] * scale,
                     "backward_GB": d["backward"] * scale}
        out[name]["step_GB"] = sum(out[name].values())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=0, help="tokens routed (default: one micro-batch on one rank)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = DSAConfig()  # the 671B shapes
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace + config.num_nextn_predict_layers
    for recipe in RECIPES:
        cfg = compose_recipe(recipe, ["model.pretrained=null"])
        par, stage = cfg.parallel, next(iter(cfg.stages.values()))
        cp, ep, dp = int(par.context_parallel), int(par.expert_parallel), int(par.data_parallel)
        tokens = int(cfg.data.seq_len) * int(cfg.data.micro_batch_size) // cp
        micro_batches = int(stage.global_batch_size) // (int(cfg.data.micro_batch_size) * dp)
        stats = routing_stats(config, args.tokens or tokens, ep, int(cfg.cluster.gpus_per_node), args.seed)
        per_rank = config.n_routed_experts // ep
        result = {"recipe": recipe, "cp": cp, "ep": ep, "dp": dp, "tokens_per_rank_micro_batch": tokens,
                  "micro_batches_per_step": micro_batches, "moe_layers": moe_layers, "recompute": str(par.recompute),
                  **stats, **step_bytes({**stats, "tokens": tokens}, config.hidden_size, 2, ep, per_rank, moe_layers,
                                        micro_batches)}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
