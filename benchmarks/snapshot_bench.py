"""How fast do SnapshotPool.save/restore move a model's weights, against per-parameter baselines and the copy ceiling?

For each layout (a ~1 GiB transformer-shaped model in ~300 tensors, plus a few sizes), in one run:

- ceiling:   one large copy of the same number of bytes into a preallocated buffer (on a GPU: into pinned
             host memory and back, i.e. the copy-engine bandwidth)
- baseline1: the reference trainer's scheme: per-parameter `.detach().to("cpu", copy=True)` save,
             `.to(device)` + `copy_` restore
- baseline2: per-parameter preallocated (pinned on a GPU) `copy_(non_blocking=True)` + synchronize
- dppo:      SnapshotPool.save(0) until the copy is complete, and restore(0); also how long save()
             blocks its caller and a full swapped() round trip

Warm-up first, then the median of --repeats runs, the methods timed round-robin so that load from other
processes falls on all of them alike; CPU timed with perf_counter, GPU with CUDA events.
Prints a table (GB/s, ratios to the ceiling and to baseline1) and writes JSON (--out).
Targets (issue 2): dppo >= 0.8x ceiling and >= 2x baseline1 on the CPU; >= 0.9x the pinned ceiling on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from dppo.snapshot import SnapshotPool

GiB = 1 << 30
MiB = 1 << 20


# ---- layouts -----------------------------------------------------------------------------------------
def transformer_shapes(hidden: int, inter: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-like decoder: 9 tensors a layer, untied embedding and head."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (hidden,),
            p + "q.weight": (hidden, hidden),
            p + "k.weight": (hidden, hidden),
            p + "v.weight": (hidden, hidden),
            p + "o.weight": (hidden, hidden),
            p + "mlp_norm.weight": (hidden,),
            p + "gate.weight": (inter, hidden),
            p + "up.weight": (inter, hidden),
            p + "down.weight": (hidden, inter),
        }
    shapes |= {"norm.weight": (hidden,), "head.weight": (vocab, hidden)}
    return shapes


LAYOUTS: dict[str, Callable[[], dict[str, tuple[int, ...]]]] = {
    # bf16: 33 layers x 9 tensors + 3 = 300 tensors, 0.96 GiB
    "transformer-1g": lambda: transformer_shapes(hidden=1024, inter=3072, layers=33, vocab=32000),
    # bf16: 4.3 GiB in 255 tensors (GPU runs)
    "transformer-4g": lambda: transformer_shapes(hidden=2560, inter=6912, layers=28, vocab=32000),
    "one-256m": lambda: {"w": (128 * MiB,)},
    "one-16m": lambda: {"w": (8 * MiB,)},
    "small-4096x16k": lambda: {f"t{i}": (8192,) for i in range(4096)},
}


def make_tensors(shapes: dict[str, tuple[int, ...]], device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        n: torch.empty(s, dtype=torch.bfloat16, device=device).uniform_(-1, 1, generator=gen) for n, s in shapes.items()
    }


# ---- timing ------------------------------------------------------------------------------------------
def timed(fn: Callable[[], None], cuda: bool) -> float:
    """Seconds that fn() takes: CUDA events around it on a GPU, the host clock on the CPU."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- methods: each returns {op: fn} to time -----------------------------------------------------------
def ceiling_ops(tensors, device) -> dict[str, Callable[[], None]]:
    """One copy of all the bytes between two preallocated flat buffers.

    CPU: the faster of one libc memcpy and one torch copy_ (torch's is slower at some sizes), chosen per
    op in the warm-up; GPU: one pinned device-to-host / host-to-device copy (the copy-engine bandwidth).
    """
    total = sum(t.numel() for t in tensors.values())
    src = torch.empty(total, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    host = torch.empty(total, dtype=torch.bfloat16, pin_memory=device.type == "cuda").fill_(0.5)
    ops = {
        "save": lambda: host.copy_(src, non_blocking=True),
        "restore": lambda: src.copy_(host, non_blocking=True),
    }
    if device.type == "cpu":
        nbytes = total * 2
        memcpy = {
            "save": lambda: ctypes.memmove(host.data_ptr(), src.data_ptr(), nbytes),
            "restore": lambda: ctypes.memmove(src.data_ptr(), host.data_ptr(), nbytes),
        }
        for op in ops:
            fast = min((ops[op], memcpy[op]), key=lambda fn: min(timed(fn, False) for _ in range(3)))
            ops[op] = fast
    return ops


def baseline1_ops(tensors, device) -> dict[str, Callable[[], None]]:
    """The reference scheme: fresh pageable copies per parameter, `.to(device)` + `copy_` back."""
    saved: dict[str, torch.Tensor] = {}

    def save() -> None:
        saved.clear()
        for n, p in tensors.items():
            saved[n] = p.detach().to("cpu", copy=True)
        sync(device)

    def restore() -> None:
        for n, p in tensors.items():
            p.copy_(saved[n].to(device))
        sync(device)

    save()
    return {"save": save, "restore": restore}


def baseline2_ops(tensors, device) -> dict[str, Callable[[], None]]:
    """Per-parameter preallocated (pinned on a GPU) buffers, copy_(non_blocking=True) + synchronize."""
    pin = device.type == "cuda"
    saved = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for n, p in tensors.items()}

    def save() -> None:
        for n, p in tensors.items():
            saved[n].copy_(p, non_blocking=True)
        sync(device)

    def restore() -> None:
        for n, p in tensors.items():
            p.copy_(saved[n], non_blocking=True)
        sync(device)

    return {"save": save, "restore": restore}


def dppo_ops(tensors, device, pool: SnapshotPool, call_s: list[float]) -> dict[str, Callable[[], None]]:
    def save() -> None:
        t0 = time.perf_counter()
        pool.save(0)
        call_s.append(time.perf_counter() - t0)  # how long save() blocks its caller
        if device.type == "cuda":
            pool.fence()  # the end event waits for the copy on the GPU
        else:
            pool.synchronize()

    def swap() -> None:
        with pool.swapped(0):
            pass

    pool.reserve(1)  # arena allocation (and pinning) stays out of the steady state
    pool.save(0)
    with pool.swapped(0):  # and so does the swap scratch
        pass
    return {"save": save, "restore": lambda: pool.restore(0), "swap": swap}


# ---- driver ------------------------------------------------------------------------------------------
def run_layout(name: str, device: torch.device, warmup: int, repeats: int) -> dict:
    """Times every method's ops round-robin (a repeat of each in turn), so that load from other
    processes on a shared machine falls on all methods alike."""
    tensors = make_tensors(LAYOUTS[name](), device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    expected = {n: t.clone() for n, t in list(tensors.items())[:3]}
    pool = SnapshotPool(tensors)
    call_s: list[float] = []
    methods = {
        "ceiling": ceiling_ops(tensors, device),
        "baseline1": baseline1_ops(tensors, device),
        "baseline2": baseline2_ops(tensors, device),
        "dppo": dppo_ops(tensors, device, pool, call_s),
    }
    times: dict[str, dict[str, list[float]]] = {m: {op: [] for op in ops} for m, ops in methods.items()}
    for rep in range(warmup + repeats):
        for method, ops in methods.items():
            for op, fn in ops.items():
                t = timed(fn, device.type == "cuda")
                if rep >= warmup:
                    times[method][op].append(t)
    times["dppo"]["save_call"] = call_s[warmup:]
    for t in tensors.values():  # the snapshot really round-trips
        t.add_(1)
    pool.restore(0)
    sync(device)
    stats = pool.stats()
    info = {
        "verified": all(torch.equal(tensors[n], e) for n, e in expected.items()),
        "host_bytes": pool.host_bytes,
        "nbytes": pool.nbytes,
        "arena_allocs": stats["arena_allocs"],
        "arena_alloc_seconds": stats["arena_alloc_seconds"],
    }
    del methods, pool, tensors
    return {"layout": name, "tensors": len(LAYOUTS[name]()), "bytes": nbytes, "times_s": times, "dppo": info}


def rows(result: dict) -> list[dict]:
    out = []
    nbytes = result["bytes"]
    med = {m: {op: statistics.median(ts) for op, ts in ops.items()} for m, ops in result["times_s"].items()}
    for method, ops in med.items():
        for op, s in ops.items():
            moved = 3 * nbytes if op == "swap" else nbytes  # swapped(): out + in on enter, back on exit
            row = {
                "layout": result["layout"],
                "op": op,
                "method": method,
                "median_ms": s * 1e3,
                "gbps": moved / s / 1e9 if op != "save_call" else None,
            }
            if op in ("save", "restore"):
                row["x_ceiling"] = med["ceiling"][op] / s
                row["x_baseline1"] = med["baseline1"][op] / s
            out.append(row)
    return out


def print_table(all_rows: list[dict]) -> None:
    head = f"{'layout':<16} {'op':<9} {'method':<10} {'median ms':>10} {'GB/s':>7} {'x ceiling':>9} {'x base1':>8}"
    print(head)
    print("-" * len(head))
    for r in all_rows:
        gbps = f"{r['gbps']:.2f}" if r["gbps"] is not None else "-"
        xc = f"{r['x_ceiling']:.2f}" if "x_ceiling" in r else "-"
        xb = f"{r['x_baseline1']:.2f}" if "x_baseline1" in r else "-"
        print(f"{r['layout']:<16} {r['op']:<9} {r['method']:<10} {r['median_ms']:>10.2f} {gbps:>7} {xc:>9} {xb:>8}")


def targets(all_rows: list[dict], cuda: bool) -> list[str]:
    lines = []
    for r in all_rows:
        if r["method"] != "dppo" or r["op"] not in ("save", "restore"):
            continue
        if cuda:
            ok = r["x_ceiling"] >= 0.9
            lines.append(
                f"{r['layout']} {r['op']}: {r['x_ceiling']:.2f}x pinned ceiling (target >= 0.9): "
                f"{'met' if ok else 'NOT met'}"
            )
        else:
            ok = r["x_ceiling"] >= 0.8 and r["x_baseline1"] >= 2.0
            lines.append(
                f"{r['layout']} {r['op']}: {r['x_ceiling']:.2f}x ceiling (>= 0.8), {r['x_baseline1']:.2f}x "
                f"baseline1 (>= 2): {'met' if ok else 'NOT met'}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), help="default: by device")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the 1 GiB layout only, 3 repeats")
    parser.add_argument("--out", type=Path, default=Path("bench_out/snapshot_bench.json"))
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.layouts:
        layouts = args.layouts
    elif args.quick:
        layouts = ["transformer-1g"]
    elif device.type == "cuda":
        layouts = ["transformer-4g", "transformer-1g", "one-256m", "small-4096x16k"]
    else:
        layouts = ["transformer-1g", "one-256m", "one-16m", "small-4096x16k"]
    repeats = 3 if args.quick else args.repeats

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": os.getloadavg(),
        "repeats": repeats,
        "warmup": args.warmup,
    }
    results = []
    for name in layouts:
        t0 = time.perf_counter()
        results.append(run_layout(name, device, args.warmup, repeats))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    meta["loadavg_after"] = os.getloadavg()
    all_rows = [r for res in results for r in rows(res)]
    print(
        f"\nsnapshot_bench on {meta['device']} ({meta['cpus']} CPUs, torch {meta['torch']}), "
        f"median of {repeats} after {args.warmup} warm-up; load avg {meta['loadavg_before'][0]:.2f} -> "
        f"{meta['loadavg_after'][0]:.2f}"
    )
    print_table(all_rows)
    goals = targets(all_rows, device.type == "cuda")
    print("\n" + "\n".join(goals))
    print("verified round trips:", all(r["dppo"]["verified"] for r in results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results, "rows": all_rows, "targets": goals}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["dppo"]["verified"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
