"""`shoal info`: a model's config, layer roles and KV sizes, the memory plan of a KV budget,
and with `--gpus N` the per-GPU plan of N GPUs (`parallel/gpu_plan.py`)."""

from __future__ import annotations


def print_info(args) -> int:
    from shoal.config import resolve_model_config
    from shoal.runner.cache_memory import plan_memory

    cfg = resolve_model_config(args.model)
    positions = cfg.max_position_embeddings
    if args.max_model_len is None:
        args.max_model_len = min(positions, 65536)
    elif args.max_model_len > positions:
        raise ValueError(f"max_model_len: got {args.max_model_len}, but {cfg.name} has "
                         f"{positions} positions")
    print(f"model {args.model}: {cfg.name}, {cfg.num_layers} layers + {cfg.num_draft_layers} "
          f"draft, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    layout = print_roles(cfg)
    budget = int(args.kv_cache_memory_gb * 1e9)
    prefix = args.enable_prefix_caching
    snapshots = args.num_prefix_snapshots if prefix else 0
    plan = plan_memory(layout, budget, args.max_num_seqs, args.max_model_len, snapshots,
                       prefix_caching=prefix)
    print(f"memory plan for {args.kv_cache_memory_gb} GB: {plan.num_blocks} blocks of "
          f"{plan.block_size} tokens ({plan.max_context_tokens} context tokens), "
          f"{plan.num_slots} request slots" + (
              f", {snapshots} ring snapshots (prefix caching: every block the budget holds)"
              if prefix else ""))
    if args.gpus is not None:
        from shoal.parallel.gpu_plan import plan_gpus

        gpus = plan_gpus(cfg, args.gpus, args.gpu_memory_gb, max_num_seqs=args.max_num_seqs,
                         max_model_len=args.max_model_len, host_memory_gb=args.host_memory_gb,
                         prefix_caching=prefix, num_snapshots=snapshots)
        print("\n".join(gpus.lines()))
    return 0


def print_roles(cfg):
    """Print the layer table and the KV sizes; returns the cache layout."""
    from shoal.runner.cache_memory import CacheLayout

    print(f"decoder (tail-only prefill) layers {cfg.decoder_start}..{cfg.num_layers - 1}")
    print("layer ratio role      kv_src topk_src extras")
    for s in cfg.layers:
        extras = " ".join(x for x, on in (("engram", s.has_engram),
                                          ("candidate-source", s.is_candidate_source),
                                          ("candidates", s.uses_candidates),
                                          ("draft", s.is_draft)) if on)
        print(f"{s.layer_id:5d} {s.compress_ratio:5d} {s.role.name:9s} "
              f"{'-' if s.kv_source is None else s.kv_source:>6} "
              f"{'-' if s.topk_source is None else s.topk_source:>8} {extras}")
    layout = CacheLayout.from_model_config(cfg)
    print(f"KV bytes per context token: {layout.bytes_per_context_token():.0f}; per request "
          f"slot (SWA rings + compressor state): {layout.bytes_per_slot / 2**20:.2f} MiB")
    return layout
