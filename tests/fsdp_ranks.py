"""Process entry points for tests that run FSDP2 ranks over gloo with torch.multiprocessing (spawn imports them by
module name, so they live in a module of tests/, which is on sys.path)."""

from __future__ import annotations

import torch

from dppo.models import build_model, response_log_probs


def token_rows(vocab_size: int, rows: int = 6, length: int = 9, seed: int = 123) -> torch.Tensor:
    """(rows, length) random token ids in [1, vocab_size): held-out sequences to score."""
    return torch.randint(1, vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def train_and_save_shards(rank: int, cfg, vocab_size: int, port: int, actor_dir: str, full_path: str) -> None:
    """One of two ranks: the policy sharded with FSDP2 (dppo.workers.actor.fsdp.parallelize), two AdamW steps on its own
    rows, its shards into actor_dir (DCP); rank 0 also saves the whole weights gathered as the rollout's are."""
    import torch.distributed as dist

    from dppo.workers.actor.fsdp import full_state_dict, parallelize
    from dppo.workers.actor.sharded_state import save_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = build_model(cfg.model, vocab_size, seed=cfg.trainer.seed)
        parallelize(model, "cpu", 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = token_rows(vocab_size, rows=4, seed=rank)
        for _ in range(2):
            optimizer.zero_grad()
            (-response_log_probs(model, ids, 4, 1.0, 4).mean()).backward()
            optimizer.step()
        save_sharded(actor_dir, model, optimizer)
        state = full_state_dict(model, cpu_offload=True)
        if rank == 0:
            torch.save(state, full_path)
    finally:
        dist.destroy_process_group()
