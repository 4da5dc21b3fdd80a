"""Expected data-parallel speed-ups from a measured one-GPU update time, on paper.

    python benchmarks/scaling_model.py                       # the base preset's model, the issue's H200 aim
    python benchmarks/scaling_model.py --step-ms 41.2 --bucket-mb 50 --overlap 0.5

A weak-scaling model (the per-GPU batch stays the same, so N GPUs do N times the work
per update): update time = compute + the communication that backward (or forward)
cannot hide. Communication is a ring: an all-reduce moves 2(N-1)/N of the bytes
through every link, a reduce-scatter or all-gather (N-1)/N, plus one latency per ring
hop and bucket. Within a node the link is NVLink; across nodes every byte of a ring
also crosses each node's network link (``--net-gbit`` per node, shared by its GPUs),
so the slower of the two bounds a multi-node ring.

- ddp: all-reduce of the gradients in ``bucket_cap_mb`` buckets, overlapped with the
  backward pass except the last bucket (``--overlap``: the share of backward the
  all-reduce can run under).
- zero_torch (ZeRO-1: torch's ZeroRedundancyOptimizer over DDP): DDP's all-reduce, each
  rank steps 1/N of the optimizer, then the updated parameters are all-gathered
  (after the step: not hidden).
- zero_fairscale (ZeRO-2: fairscale OSS + ShardedDDP): gradients reduced to their owner
  only (half of an all-reduce's traffic), 1/N of the optimizer, parameters broadcast
  after the step.
- fsdp (FULL_SHARD, bf16 parameters, fp32 reduction): parameters all-gathered for forward
  and again for backward, gradients reduce-scattered; all three prefetched under compute
  (``--overlap`` of it), 1/N of the optimizer.

It prints each strategy's expected speed-up at 8, 16 and 64 GPUs next to the claims of
the seed guide (``/work/shared/reference/000_*.txt``: 8 GPUs with DDP 6.1x, 16 GPUs with
ZeRO 11.5x). A model, not a measurement: it ignores stragglers, data loading and
NCCL's choice of tree algorithms; measure on the cluster before trusting a figure.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = {("ddp", 8): 6.1, ("zero_torch", 16): 11.5, ("zero_fairscale", 16): 11.5}
STRATEGIES = ("ddp", "zero_torch", "zero_fairscale", "fsdp")
GPU_COUNTS = (8, 16, 64)


@dataclass
class Network:
    gpus_per_node: int = 8
    nvlink_gbs: float = 450.0  # GB/s one way per GPU (NVLink 4: 900 GB/s both ways)
    net_gbit: float = 400.0  # Gb/s per node between nodes
    latency_us: float = 5.0  # per ring hop

    def bandwidth(self, gpus: int) -> float:
        """Bytes/s a ring over ``gpus`` GPUs moves per link."""
        if gpus <= self.gpus_per_node:
            return self.nvlink_gbs * 1e9
        return min(self.nvlink_gbs * 1e9, self.net_gbit / 8 * 1e9)

    def ring(self, nbytes: float, gpus: int, factor: float, messages: int = 1) -> float:
        """Seconds of a ring collective moving ``factor`` x ``nbytes`` per link in ``messages`` pieces."""
        if gpus == 1:
            return 0.0
        return factor * nbytes / self.bandwidth(gpus) + messages * (gpus - 1) * self.latency_us * 1e-6


@dataclass
class Model:
    step_s: float  # one GPU, one update: forward + backward + optimizer
    params: float
    grad_bytes_per_param: float = 4.0  # fp32 gradients (autocast keeps fp32 parameters)
    param_bytes_per_param: float = 4.0
    optimizer_s: float = 0.0
    backward_share: float = 2 / 3  # of forward + backward

    @property
    def compute_s(self) -> float:
        return self.step_s - self.optimizer_s

    @property
    def backward_s(self) -> float:
        return self.compute_s * self.backward_share

    @property
    def forward_s(self) -> float:
        return self.compute_s - self.backward_s


def update_time(strategy: str, gpus: int, m: Model, net: Network, bucket_mb: float, overlap: float) -> float:
    """Modelled seconds per update on ``gpus`` GPUs."""
    grads, params = m.params * m.grad_bytes_per_param, m.params * m.param_bytes_per_param
    n = (gpus - 1) / gpus
    buckets = max(1, math.ceil(grads / (bucket_mb * 2**20)))
    last_bucket = net.ring(min(grads, bucket_mb * 2**20), gpus, 2 * n)
    if strategy in ("ddp", "zero_torch"):
        comm = net.ring(grads, gpus, 2 * n, buckets)
        exposed = max(last_bucket, comm - overlap * m.backward_s)
        if strategy == "ddp":
            return m.compute_s + exposed + m.optimizer_s
        gather = net.ring(params, gpus, n)
        return m.compute_s + exposed + m.optimizer_s / gpus + gather
    if strategy == "zero_fairscale":
        comm = net.ring(grads, gpus, n, buckets)
        exposed = max(last_bucket / 2, comm - overlap * m.backward_s)
        return m.compute_s + exposed + m.optimizer_s / gpus + net.ring(params, gpus, n)
    if strategy == "fsdp":
        low = m.params * 2  # bf16 parameters gathered
        forward = max(0.0, net.ring(low, gpus, n) - overlap * m.forward_s)
        backward = max(0.0, net.ring(low, gpus, n) + net.ring(grads, gpus, n) - overlap * m.backward_s)
        return m.compute_s + forward + backward + m.optimizer_s / gpus
    raise ValueError(strategy)


def base_model_params() -> int:
    """Parameters of step_speed.py's ``base`` model (BERT-base visual_bert, 3,129 answers), built on meta."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    from omegaconf import OmegaConf

    from step_speed import PRESETS, model_options
    from mmvl.models import VisualBert

    with torch.device("meta"):
        model = VisualBert(OmegaConf.create({**model_options(PRESETS["base"]), "losses": []}))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> list[tuple[str, int, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=22.9,
                        help="measured one-GPU update time (default: 128 samples at 5,600 samples/s, the H200 aim "
                             "of issue 9 for the base preset)")
    parser.add_argument("--params", type=float, default=None, help="parameters (default: the base preset's model)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="distributed.bucket_cap_mb")
    parser.add_argument("--overlap", type=float, default=0.8,
                        help="share of backward (fsdp: also forward) that communication can run under")
    parser.add_argument("--optimizer-ms", type=float, default=None,
                        help="the optimizer step inside --step-ms (default: 16 bytes read+written per parameter "
                             "at --hbm-gbs)")
    parser.add_argument("--hbm-gbs", type=float, default=4800.0, help="GPU memory bandwidth, GB/s (H200: 4,800)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbs", type=float, default=450.0, help="NVLink GB/s one way per GPU")
    parser.add_argument("--net-gbit", type=float, default=400.0, help="network Gb/s per node")
    parser.add_argument("--latency-us", type=float, default=5.0, help="latency per ring hop, microseconds")
    args = parser.parse_args(argv)
    params = args.params or base_model_params()
    optimizer_ms = args.optimizer_ms if args.optimizer_ms is not None else params * 32 / (args.hbm_gbs * 1e9) * 1e3
    model = Model(step_s=args.step_ms / 1e3, params=params, optimizer_s=optimizer_ms / 1e3)
    net = Network(args.gpus_per_node, args.nvlink_gbs, args.net_gbit, args.latency_us)
    print(f"one GPU: {args.step_ms:.1f} ms/update ({optimizer_ms:.2f} ms optimizer), {params / 1e6:.1f}M parameters "
          f"({params * 4 / 2**20:.0f} MB fp32 gradients), buckets of {args.bucket_mb:g} MB, overlap {args.overlap:g}; "
          f"NVLink {args.nvlink_gbs:g} GB/s, {args.net_gbit:g} Gb/s per node of {args.gpus_per_node} GPUs")
    print(f"{'strategy':15s} {'GPUs':>4s} {'ms/update':>10s} {'speed-up':>9s} {'efficiency':>10s}   seed guide")
    rows = []
    for strategy in STRATEGIES:
        for gpus in GPU_COUNTS:
            seconds = update_time(strategy, gpus, model, net, args.bucket_mb, args.overlap)
            speedup = gpus * model.step_s / seconds
            claim = GUIDE.get((strategy, gpus))
            print(f"{strategy:15s} {gpus:4d} {1e3 * seconds:10.2f} {speedup:8.1f}x {100 * speedup / gpus:9.0f}%   "
                  + (f"claims {claim}x" if claim else ""))
            rows.append((strategy, gpus, speedup))
    return rows


if __name__ == "__main__":
    main()
