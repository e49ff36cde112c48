"""Copy-engine NVLink bandwidth of this host: the ceiling the intranode kernels are compared with.

One process drives every visible GPU (peer access enabled, so ``Tensor.copy_`` between devices is a copy-engine
peer copy): ``pair`` has GPU ``i`` copy ``--bytes`` into GPU ``j``, alone, for every ordered pair; ``all_to_all`` has
every GPU copy ``--bytes / (G - 1)`` to each peer at once (an EP all-to-all), reported per GPU as bytes sent / wall
time. Every copy runs on a stream of its own made current on both its devices (torch orders a cross-device copy
against the current streams of both, which would serialise copies into one GPU). Each measurement: ``--warmups``
untimed rounds, then ``--repeats`` timed rounds, host wall clock between synchronisations of every GPU (>= 256 MB
per GPU per round, so launch costs are < 0.1 %); best and median round; remote bytes only::

    python benchmarks/bench_nvlink.py --json out/nvlink.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch


def _sync_all(devices: list[int]) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


def _timed_rounds(devices: list[int], launch, warmups: int, repeats: int) -> list[float]:
    """Wall seconds of each timed round of ``launch()`` (which enqueues one round on every device)."""
    for _ in range(warmups):
        launch()
    _sync_all(devices)
    times = []
    for _ in range(repeats):
        _sync_all(devices)
        start = time.perf_counter()
        launch()
        _sync_all(devices)
        times.append(time.perf_counter() - start)
    return times


def _summary(num_bytes: float, times: list[float]) -> dict:
    return {"bytes": num_bytes, "best_gbps": num_bytes / min(times) / 1e9,
            "median_gbps": num_bytes / statistics.median(times) / 1e9, "times_s": times}


def _copy(src: torch.Tensor, dst: torch.Tensor, streams: tuple) -> None:
    """Enqueue one peer copy with its own (source, destination) stream pair current."""
    with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
        dst.copy_(src, non_blocking=True)


def enable_peer_access(devices: list[int]) -> None:
    for i in devices:
        for j in devices:
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                raise RuntimeError(f"GPU {i} cannot access GPU {j} as a peer: no NVLink/P2P path to measure")


def measure_pairs(devices: list[int], num_bytes: int, warmups: int, repeats: int) -> list[dict]:
    rows = []
    for i in devices:
        src = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{i}")
        for j in devices:
            if i == j:
                continue
            dst = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{j}")
            streams = (torch.cuda.Stream(device=i), torch.cuda.Stream(device=j))

            def launch(src=src, dst=dst, streams=streams):
                _copy(src, dst, streams)

            rows.append({"src": i, "dst": j, **_summary(num_bytes, _timed_rounds(devices, launch, warmups, repeats))})
            del dst
        del src
    return rows


def measure_all_to_all(devices: list[int], num_bytes: int, warmups: int, repeats: int) -> dict:
    peers = len(devices) - 1
    per_peer = num_bytes // peers // 16 * 16
    copies = []
    for i in devices:
        src = torch.empty(per_peer * peers, dtype=torch.uint8, device=f"cuda:{i}")
        for k, j in enumerate(d for d in devices if d != i):
            dst = torch.empty(per_peer, dtype=torch.uint8, device=f"cuda:{j}")
            copies.append((src[k * per_peer:(k + 1) * per_peer], dst,
                           (torch.cuda.Stream(device=i), torch.cuda.Stream(device=j))))

    def launch():
        for src_part, dst, streams in copies:
            _copy(src_part, dst, streams)

    times = _timed_rounds(devices, launch, warmups, repeats)
    return {"gpus": len(devices), "bytes_per_peer": per_peer, **_summary(per_peer * peers, times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=1 << 30, help="bytes each GPU sends per round (default 1 GiB)")
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args()
    if args.bytes < 256 << 20:
        raise ValueError(f"--bytes must be >= 256 MiB so launch costs stay negligible, got {args.bytes}")
    devices = list(range(torch.cuda.device_count()))
    if len(devices) < 2:
        raise SystemExit(f"bench_nvlink needs at least 2 GPUs, this host has {len(devices)}")
    enable_peer_access(devices)

    pairs = measure_pairs(devices, args.bytes, args.warmups, args.repeats)
    all_to_all = measure_all_to_all(devices, args.bytes, args.warmups, args.repeats)
    for row in pairs:
        print(f"pair {row['src']} -> {row['dst']}: best {row['best_gbps']:.1f} GB/s, median {row['median_gbps']:.1f}")
    print(f"all-to-all over {all_to_all['gpus']} GPUs, per GPU out: best {all_to_all['best_gbps']:.1f} GB/s, "
          f"median {all_to_all['median_gbps']:.1f}")
    if args.json:
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(0), "gpus": len(devices), "pairs": pairs,
                  "all_to_all": all_to_all}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
