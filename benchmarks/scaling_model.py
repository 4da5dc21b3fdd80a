"""Expected data-parallel speed-ups from a measured one-GPU update time, on paper.

    python benchmarks/scaling_model.py                       # the base preset's model, the issue's H200 aim
    python benchmarks/scaling_model.py --step-ms 41.2 --bucket-mb 50 --overlap 0.5

A weak-scaling model (the per-GPU batch stays the same, so N GPUs do N times the work
per update): update time = compute + the communication that compute cannot hide.
Collectives are rings, charged the way nccl-tests reports them: a collective of S bytes
takes factor x S / busbw + messages x hops x latency, where an all-reduce has factor
2(N-1)/N and 2(N-1) hops (a reduce-scatter then an all-gather), and a reduce-scatter,
all-gather, reduce or broadcast factor (N-1)/N and N-1 hops. busbw is the achievable bus
bandwidth: in a node NVLink's (``--nvlink-gbs``, not the line rate); across nodes every
byte of a ring also leaves each node through its NICs (``--nics-per-node`` x
``--nic-gbit`` x ``--nic-efficiency``), and the slower of the two bounds the ring.

- ddp: all-reduce of the fp32 gradients in ``bucket_cap_mb`` buckets (one message each),
  overlapped with backward only (``--overlap`` of it), never the last bucket.
- zero_torch (ZeRO-1: torch's ZeroRedundancyOptimizer over DDP): DDP's all-reduce, each
  rank steps 1/N of the optimizer, then the updated parameters are all-gathered (after the
  step: not hidden; modelled as one message).
- zero_fairscale (ZeRO-2: fairscale OSS + ShardedDDP): gradients reduced to their owner
  (a reduce per bucket, overlapped with backward), 1/N of the optimizer, parameters
  broadcast after the step (not hidden).
- fsdp (FULL_SHARD, bf16 parameters, fp32 reduction, ``--fsdp-units`` equal units, one
  message per unit and collective): parameters all-gathered for forward (hidden under
  forward except the first unit's) and again for backward, gradients reduce-scattered
  (both hidden under backward except the last unit's), 1/N of the optimizer.

It prints its assumptions, then each strategy's expected speed-up at 8, 16 and 64 GPUs
next to the claims of the seed guide (``/work/shared/reference/000_*.txt``: 8 GPUs with
DDP 6.1x, 16 GPUs with ZeRO 11.5x). A model, not a measurement: it ignores stragglers,
data loading and NCCL's tree and NVLink SHARP algorithms (faster than rings for
all-reduce); measure on the cluster before trusting a figure.
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
#: AdamW on fp32 state reads parameter, gradient and both moments (16 B) and writes parameter and
#: both moments (12 B) per parameter
OPTIMIZER_BYTES = 28
# Defaults, both from NCCL maintainers' answers on nccl-tests issues (approximate published figures):
#: H100/H200 NVLink 4 is 450 GB/s per direction on the wire; with ~20% protocol overhead NCCL gets
#: ~370 GB/s, the busbw of a ring all-reduce (NCCL_ALGO=RING) on 8 GPUs (NVIDIA/nccl-tests#212,
#: 2024-05-06; NVLink SHARP all-reduce reaches ~480 GB/s busbw, which this ring model leaves out)
NVLINK_BUSBW_GBS = 370.0
#: a 400 Gb/s (50 GB/s) NDR NIC gives 46-48 GB/s through NCCL (NVIDIA/nccl-tests#290, 2025-03-03): 47/50
NIC_EFFICIENCY = 0.94
COLLECTIVES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "reduce": 1, "broadcast": 1}


@dataclass
class Network:
    gpus_per_node: int = 8
    nvlink_gbs: float = NVLINK_BUSBW_GBS  # achievable bus bandwidth per GPU in a node, GB/s
    nics_per_node: int = 8  # an 8-GPU H100/H200 node: one 400 Gb/s NIC per GPU
    nic_gbit: float = 400.0  # line rate of one NIC, Gb/s
    nic_efficiency: float = NIC_EFFICIENCY  # share of the line rate NCCL reaches
    latency_us: float = 5.0  # per ring hop

    def busbw(self, gpus: int) -> float:
        """Bytes/s of bus bandwidth a ring over ``gpus`` GPUs reaches."""
        nvlink = self.nvlink_gbs * 1e9
        if gpus <= self.gpus_per_node:
            return nvlink
        return min(nvlink, self.nics_per_node * self.nic_gbit / 8 * 1e9 * self.nic_efficiency)

    def collective(self, kind: str, nbytes: float, gpus: int, messages: int = 1) -> float:
        """Seconds of ``messages`` ring ``kind`` collectives moving ``nbytes`` in all (the full tensor)."""
        if gpus == 1 or nbytes == 0:
            return 0.0
        passes = COLLECTIVES[kind]  # an all-reduce is a reduce-scatter then an all-gather
        factor, hops = passes * (gpus - 1) / gpus, passes * (gpus - 1)
        return factor * nbytes / self.busbw(gpus) + messages * hops * self.latency_us * 1e-6


@dataclass
class Model:
    step_s: float  # one GPU, one update: forward + backward + optimizer
    params: float
    grad_bytes_per_param: float = 4.0  # fp32 gradients (autocast keeps fp32 parameters)
    param_bytes_per_param: float = 4.0
    optimizer_s: float = 0.0
    backward_share: float = 2 / 3  # of forward + backward
    fsdp_units: int = 13  # the base preset: 12 transformer layers + the root (embeddings, head)

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
    bucket = bucket_mb * 2**20
    buckets = max(1, math.ceil(grads / bucket))
    if strategy in ("ddp", "zero_torch"):
        comm = net.collective("all_reduce", grads, gpus, buckets)
        exposed = max(net.collective("all_reduce", min(grads, bucket), gpus), comm - overlap * m.backward_s)
        if strategy == "ddp":
            return m.compute_s + exposed + m.optimizer_s
        return m.compute_s + exposed + m.optimizer_s / gpus + net.collective("all_gather", params, gpus)
    if strategy == "zero_fairscale":
        comm = net.collective("reduce", grads, gpus, buckets)
        exposed = max(net.collective("reduce", min(grads, bucket), gpus), comm - overlap * m.backward_s)
        return m.compute_s + exposed + m.optimizer_s / gpus + net.collective("broadcast", params, gpus)
    if strategy == "fsdp":
        units, low = m.fsdp_units, m.params * 2  # bf16 parameters gathered
        gather = net.collective("all_gather", low, gpus, units)
        scatter = net.collective("reduce_scatter", grads, gpus, units)
        forward = max(net.collective("all_gather", low / units, gpus), gather - overlap * m.forward_s)
        backward = max(net.collective("reduce_scatter", grads / units, gpus),
                       gather + scatter - overlap * m.backward_s)
        return m.compute_s + forward + backward + m.optimizer_s / gpus
    raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")


def base_model_params() -> int:
    """Parameters of step_speed.py's ``base`` model (BERT-base visual_bert, 3,129 answers), built on meta."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    from omegaconf import OmegaConf

    from step_speed_setup import PRESETS, model_options
    from mmvl.models import VisualBert

    with torch.device("meta"):
        model = VisualBert(OmegaConf.create({**model_options(PRESETS["base"]), "losses": []}))
    return sum(p.numel() for p in model.parameters())


def assumptions(args: argparse.Namespace, m: Model, net: Network) -> list[str]:
    """The model's inputs and rules, printed before its figures."""
    net_gbs = net.nics_per_node * net.nic_gbit / 8 * net.nic_efficiency
    return [
        f"one GPU: {1e3 * m.step_s:.1f} ms/update, of which optimizer {1e3 * m.optimizer_s:.2f} ms "
        f"({OPTIMIZER_BYTES if args.optimizer_ms is None else 'given'} B/param at {args.hbm_gbs:g} GB/s HBM), "
        f"backward {m.backward_share:.2f} of the rest; {m.params / 1e6:.1f}M parameters, "
        f"{m.params * m.grad_bytes_per_param / 2**20:.0f} MB fp32 gradients",
        f"in a node of {net.gpus_per_node} GPUs: NVLink busbw {net.nvlink_gbs:g} GB/s per GPU (achievable "
        f"ring all-reduce busbw, not the 450 GB/s line rate; a default)",
        f"between nodes: {net.nics_per_node} NICs x {net.nic_gbit:g} Gb/s x {net.nic_efficiency:g} "
        f"= {net_gbs:.0f} GB/s per node; a ring's busbw is the lower of the two",
        f"ring collective of S bytes on N GPUs: factor x S / busbw + messages x hops x {net.latency_us:g} us; "
        f"all-reduce factor 2(N-1)/N, 2(N-1) hops; reduce-scatter/all-gather/reduce/broadcast (N-1)/N, N-1 hops",
        f"ddp/zero: {args.bucket_mb:g} MB buckets, one message each, hidden under {args.overlap:g} of backward "
        f"(not the last bucket); fsdp: {m.fsdp_units} units, one message per unit per collective (all-gather "
        f"forward, all-gather backward, reduce-scatter), hidden under {args.overlap:g} of forward and backward",
    ]


def positive(value: str) -> float:
    """argparse type: a number above 0 (one clear line and exit 2 otherwise)."""
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return number


def main(argv: list[str] | None = None) -> list[tuple[str, int, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=positive, default=22.9,
                        help="measured one-GPU update time (default: 128 samples at 5,600 samples/s, the H200 aim "
                             "of issue 9 for the base preset)")
    parser.add_argument("--params", type=positive, default=None, help="parameters (default: the base preset's model)")
    parser.add_argument("--bucket-mb", type=positive, default=25.0, help="distributed.bucket_cap_mb")
    parser.add_argument("--overlap", type=float, default=0.8,
                        help="share of backward (fsdp: of forward and of backward) communication can run under")
    parser.add_argument("--optimizer-ms", type=float, default=None,
                        help=f"the optimizer step inside --step-ms (default: AdamW's {OPTIMIZER_BYTES} bytes read and "
                             "written per parameter at --hbm-gbs)")
    parser.add_argument("--hbm-gbs", type=positive, default=4800.0, help="GPU memory bandwidth, GB/s (H200: 4,800)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-gbs", type=positive, default=NVLINK_BUSBW_GBS,
                        help="achievable NVLink bus bandwidth per GPU, GB/s (default: ~370, NCCL's ring all-reduce "
                             "busbw on 8 H100s)")
    parser.add_argument("--nics-per-node", type=int, default=8, help="network cards per node (H200 node: 8)")
    parser.add_argument("--nic-gbit", type=positive, default=400.0, help="line rate of one NIC, Gb/s")
    parser.add_argument("--nic-efficiency", type=positive, default=NIC_EFFICIENCY,
                        help="share of the NIC line rate NCCL reaches (default: 47 of 50 GB/s)")
    parser.add_argument("--latency-us", type=float, default=5.0, help="latency per ring hop, microseconds")
    parser.add_argument("--fsdp-units", type=int, default=13,
                        help="FSDP units (the base preset: 12 layers + the root)")
    args = parser.parse_args(argv)
    if not 0 <= args.overlap <= 1:
        parser.error(f"--overlap must be between 0 and 1, got {args.overlap:g}")
    if min(args.gpus_per_node, args.nics_per_node, args.fsdp_units) < 1:
        parser.error("--gpus-per-node, --nics-per-node and --fsdp-units must be 1 or more")
    params = args.params or base_model_params()
    optimizer_ms = (args.optimizer_ms if args.optimizer_ms is not None
                    else params * OPTIMIZER_BYTES / (args.hbm_gbs * 1e9) * 1e3)
    if not 0 <= optimizer_ms < args.step_ms:
        parser.error(f"--optimizer-ms {optimizer_ms:g} must be at least 0 and below --step-ms {args.step_ms:g}")
    model = Model(step_s=args.step_ms / 1e3, params=params, optimizer_s=optimizer_ms / 1e3,
                  fsdp_units=args.fsdp_units)
    net = Network(args.gpus_per_node, args.nvlink_gbs, args.nics_per_node, args.nic_gbit, args.nic_efficiency,
                  args.latency_us)
    print("assumptions:")
    for line in assumptions(args, model, net):
        print(f"  {line}")
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
