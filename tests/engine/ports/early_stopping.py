"""Early stopping through triggers, written as Accelerate's by_feature/early_stopping.py is: the
main process raises ``accelerator.set_trigger()`` once the batch's loss (over all processes) is
below a threshold, and every process leaves the loop on ``accelerator.check_trigger()``."""
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
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, 0] > 0).long())


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_data(64, 1), shuffle=not args.no_shuffle, batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
        resume_step = int(training_difference.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        overall_step = resume_step
        resume_step -= starting_epoch * len(train_dataloader)
    orders, stopped_at = [], None
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # the batches the killed run had trained on (the restored loader is already there)
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, x, y in active_dataloader:
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
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
                if overall_step == args.stop_after:  # the run is killed right after this save
                    sys.exit(3)
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
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) every this many batches.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 20, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
