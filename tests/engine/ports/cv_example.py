"""Image classification, written as Accelerate's examples/cv_example.py is: a tiny CNN (no batch
norm, no dropout) on generated 16x16 RGB images whose class is the brighter half, left or right."""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed


def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    images = torch.rand(n, 3, 16, 16, generator=g)
    images[:, :, :, 8:] += 0.35 * (2 * labels.float() - 1).view(-1, 1, 1, 1)
    return TensorDataset(torch.arange(n), images, labels)


def build_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 2))


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr, num_epochs, batch_size = config["lr"], config["num_epochs"], config["batch_size"]
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_images(64, 1), shuffle=not args.no_shuffle, batch_size=batch_size)
    eval_dataloader = DataLoader(make_images(36, 2), shuffle=False, batch_size=batch_size)
    model = build_model().to(accelerator.device)
    mean = torch.tensor([0.5, 0.5, 0.5])[None, :, None, None].to(accelerator.device)
    std = torch.tensor([0.29, 0.29, 0.29])[None, :, None, None].to(accelerator.device)
    optimizer = torch.optim.Adam(params=model.parameters(), lr=lr)
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
    orders = []
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # the batches the killed run had trained on (the restored loader is already there)
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, images, labels in active_dataloader:
            outputs = model((images - mean) / std)
            loss = torch.nn.functional.cross_entropy(outputs, labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append(accelerator.gather(ids).tolist())
            overall_step += 1
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
                if overall_step == args.stop_after:  # the run is killed right after this save
                    sys.exit(3)
        orders.append(seen)
        model.eval()
        accurate = num_elems = 0
        loss_sum = 0.0
        for ids, images, labels in eval_dataloader:
            with torch.no_grad():
                outputs = model((images - mean) / std)
            losses = torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
            predictions, references, losses = accelerator.gather_for_metrics(
                (outputs.argmax(dim=-1), labels, losses))
            accurate += (predictions == references).long().sum().item()
            num_elems += references.shape[0]
            loss_sum += losses.sum().item()
        eval_metric = accurate / num_elems
        accelerator.print(f"epoch {epoch}: {100 * eval_metric:.2f}")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "accuracy": eval_metric, "eval_total": num_elems,
                       "eval_loss": loss_sum / num_elems}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) every this many batches.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": 3, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
