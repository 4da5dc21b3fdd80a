"""A plain PyTorch training loop ported to the mmvl Engine.

Run on one process:            python examples/engine_loop.py
Run on two processes:          torchrun --nproc_per_node=2 examples/engine_loop.py
The lines marked `# mmvl` are the only changes from the plain loop. Under torchrun the
Engine joins the process group itself (NCCL on GPUs, one GPU per process; gloo on CPUs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mmvl.engine import Engine  # mmvl


def main(updates: int = 50) -> float:
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x[:, :8].sum(1) > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                         shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    engine = Engine(precision="bf16", gradient_accumulation=2)                   # mmvl
    model, optimizer, loader = engine.prepare(model, optimizer, loader)          # mmvl
    step = 0
    while step < updates:
        for xb, yb in loader:                      # batches arrive on engine.device
            with engine.accumulate(model):                                       # mmvl
                with engine.autocast():                                          # mmvl
                    loss = F.cross_entropy(model(xb).float(), yb)
                engine.backward(loss)                                            # mmvl
                engine.clip_grad_norm_(model, 1.0)                               # mmvl
                optimizer.step()
                optimizer.zero_grad()
            step += int(engine.sync_gradients)
            if step >= updates:
                break
    with torch.no_grad():
        x, y = engine.to_device((x, y))                                          # mmvl
        acc = (engine.unwrap_model(model)(x).argmax(1) == y).float().mean().item()
    if engine.is_main_process:                                                   # mmvl
        print(f"train accuracy after {updates} updates: {acc:.3f}")
    engine.wait_for_everyone()                                                   # mmvl
    return acc


if __name__ == "__main__":
    main()
