"""cycle_bench.py --world-size N: a sync cycle of the actor as N FSDP2 ranks against one rank, and what each rank holds.

Both actors are Ray actors of a fresh local cluster (gloo between the CPU ranks), so both pay the same dispatch:
the driver calls the worker group's update once per trigger, with cycle_bench's synthetic batches (WS_BATCH:
enough sequences that every rank computes). Per world size: the median cycle over --repeats rounds after a
warm-up (decoupled-auto, parameter_sync_step WS_PS; under FSDP2 auto reads slot 0 with swap; then the same
ranks with score-ahead: every later mini-batch scored at trigger 0, gathered from the ranks and split again,
no snapshot), and per rank the snapshot bytes (one slot of its shards), the host bytes its snapshot pool holds,
and the resident memory of its process. Targets: the ranks' snapshot bytes add up to the model's and each holds
1/N of them (within one row per tensor of dim-0 padding).
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import ray
import torch

MB = 1e6
WS_PS = 4
WS_BATCH = (16, 4, 8, 8)  # per trigger: 16 sequences (8 per rank at world size 2), in groups of 4, 8+8 tokens


def rank_memory(rank) -> dict:
    """What one rank holds: its snapshot slot, its pool's host bytes, its shard of the model, its process RSS."""
    from dppo.workers.actor.fsdp import local_tensor

    pool = rank.pool
    pool.synchronize()
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "rank": rank.rank,
        "snapshot_bytes": pool.nbytes,
        "pool_host_bytes": pool.host_bytes,
        "model_bytes": sum(local_tensor(p).nbytes for p in rank.model.parameters()),
        "rss_bytes": rss_kb * 1024,
    }


def run_world_size(bench, size: str, world_size: int, repeats: int, out_dir: str) -> dict:
    """Median cycle and per-rank memory of the actor at world_size ranks (Ray actors)."""
    from dppo.trainer.ppo import PPOTrainer

    cfg = bench.trainer_config(
        size,
        WS_PS,
        {**bench.MODES["decoupled-auto"], "ray.enabled": True, "trainer.n_gpus_per_node": world_size},
        "cpu",
        out_dir,
        WS_BATCH,
    )
    trainer = PPOTrainer(cfg, rollout=bench._NoRollout())
    try:
        batches = bench.synthetic_batches(trainer.source.vocab_size, WS_BATCH, WS_PS, torch.device("cpu"))
        clock = bench.Clock(False)
        bench.run_cycle(trainer, WS_PS, batches, clock)  # warm-up: arenas, the swap scratch
        cycles = [bench.run_cycle(trainer, WS_PS, batches, clock) for _ in range(repeats)]
        memory = trainer.actor_group.execute(rank_memory)
        reconfigure(
            trainer,
            bench.trainer_config(
                size,
                WS_PS,
                {**bench.MODES["score-ahead"], "ray.enabled": True, "trainer.n_gpus_per_node": world_size},
                "cpu",
                out_dir,
                WS_BATCH,
            ),
        )
        bench.run_cycle(trainer, WS_PS, batches, clock)
        ahead = [bench.run_cycle(trainer, WS_PS, batches, clock) for _ in range(repeats)]
        model_bytes = sum(t.nbytes for t in ray.get(trainer.actor_group.rollout_weights()[0]).values())
    finally:
        trainer.close()
    return {
        "world_size": world_size,
        "size": size,
        "cycle_s": statistics.median(cycles),
        "cycles_s": cycles,
        "ahead_cycle_s": statistics.median(ahead),
        "ahead_cycles_s": ahead,
        "ranks": memory,
        "model_bytes": model_bytes,
    }


def reconfigure(trainer, cfg) -> None:
    """cfg's algorithm settings for the driver and every rank, over the same weights and optimizer."""
    from dppo.config.pi_old import choose_pi_old
    from dppo.trainer.worker_group import actor_settings

    trainer.cfg, trainer.pi_old_choice = cfg, choose_pi_old(cfg)
    trainer.actor_group.reconfigure(actor_settings(cfg), trainer.pi_old_choice)


def run(bench, size: str, world_size: int, repeats: int) -> dict:
    """World size 1 and world_size, one after the other on one local Ray cluster."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank_memory runs on the ranks
    ray.init(address="local", num_cpus=max(2, world_size), include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            rows = [run_world_size(bench, size, n, repeats, out_dir) for n in (1, world_size)]
    finally:
        ray.shutdown()
    return {"batch": WS_BATCH, "ps": WS_PS, "rows": rows}


def report(result: dict) -> list[tuple[str, bool]]:
    """Prints the table; (line, passed) per target."""
    one, many = result["rows"]
    print(
        f"\nworld sizes ({many['size']}, decoupled-auto; ahead s: score-ahead, ps={result['ps']}, per trigger {result['batch'][0]} sequences "
        f"of {result['batch'][2]}+{result['batch'][3]} tokens; FSDP2 over gloo at world size > 1):"
    )
    head = (
        f"{'world size':>10} {'cycle s':>8} {'vs 1':>6} {'ahead s':>8} {'rank':>4} {'snapshot MB':>11} "
        f"{'pool host MB':>12} {'RSS MB':>7}"
    )
    print(head)
    print("-" * len(head))
    for row in (one, many):
        for rank in row["ranks"]:
            print(
                f"{row['world_size']:>10} {row['cycle_s']:>8.3f} {row['cycle_s'] / one['cycle_s']:>6.2f} "
                f"{row['ahead_cycle_s']:>8.3f} {rank['rank']:>4} {rank['snapshot_bytes'] / MB:>11.1f} {rank['pool_host_bytes'] / MB:>12.1f} "
                f"{rank['rss_bytes'] / MB:>7.0f}"
            )
    n, model = many["world_size"], many["model_bytes"]
    shards = [r["snapshot_bytes"] for r in many["ranks"]]
    even = sum(shards) == model and max(shards) - min(shards) <= 0.01 * model
    return [
        (
            f"snapshot bytes per rank at world size {n}: {', '.join(f'{s / MB:.1f}' for s in shards)} MB, together "
            f"{sum(shards) / MB:.1f} MB = the model's {model / MB:.1f} MB, each {max(shards) / model:.3f} of it "
            f"(target 1/{n})",
            even,
        )
    ]
