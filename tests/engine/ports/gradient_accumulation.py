"""Gradient accumulation, written as Accelerate's by_feature/gradient_accumulation.py is:
``Accelerator(gradient_accumulation_steps=N)`` and ``with accelerator.accumulate(model):``. With
12 batches an epoch and N=5 the epoch's last, partial group steps too (batches 5, 10 and 12)."""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, 0] - x[:, 1] > 0).long())


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_data(96, 1), shuffle=not args.no_shuffle, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(make_data(32, 2), shuffle=False, batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(params=model.parameters(), lr=config["lr"], momentum=0.9)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
        resume_step = int(training_difference.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        overall_step = resume_step
        resume_step -= starting_epoch * len(train_dataloader)
    orders, sums, optimizer_steps = [], [], 0
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # the batches the killed run had trained on (the restored loader is already there)
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, x, y in active_dataloader:
            # the optimizer steps, and gradients are synchronized, only on each N-th batch
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            optimizer_steps += int(accelerator.sync_gradients)
            seen.append(accelerator.gather(ids).tolist())
            sums.append(sum(p.detach().double().sum() for p in model.parameters()).item())  # the trajectory
            overall_step += 1
            # at an update only: the gradients accumulated in between are not part of the state
            if accelerator.sync_gradients and args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
                if overall_step == args.stop_after:  # the run is killed right after this save
                    sys.exit(3)
        orders.append(seen)
        model.eval()
        correct = total = 0
        for ids, x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "sums": sums, "accuracy": correct / total, "eval_total": total,
                       "optimizer_steps": optimizer_steps}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) at each update after a batch this number divides.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 0.05, "num_epochs": 3, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
