"""Early stopping through triggers, written as Accelerate's by_feature/early_stopping.py is: the
main process raises ``accelerator.set_trigger()`` once the batch's loss (over all processes) is
below a threshold, and every process leaves the loop on ``accelerator.check_trigger()``."""
import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, 0] > 0).long())


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_data(64, 1), shuffle=not args.no_shuffle, batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    orders, overall_step, stopped_at = [], 0, None
    for epoch in range(config["num_epochs"]):
        model.train()
        seen = []
        for ids, x, y in train_dataloader:
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            accelerator.backward(losses.mean())
            optimizer.step()
            optimizer.zero_grad()
            overall_step += 1
            seen.append(accelerator.gather(ids).tolist())
            batch_loss = accelerator.gather(losses.detach()).mean().item()
            if accelerator.is_main_process and batch_loss < args.loss_threshold:
                accelerator.set_trigger()  # only this process knows; check_trigger tells every process
            if accelerator.check_trigger():
                stopped_at = overall_step
                break
        orders.append(seen)
        if stopped_at is not None:
            accelerator.print(f"stopped at step {stopped_at} (epoch {epoch}), loss {batch_loss:.4f}")
            break
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "stopped_at": stopped_at, "loss": batch_loss}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--loss_threshold", type=float, default=0.25)
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 20, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
