"""Metrics over every process, written as Accelerate's by_feature/multi_process_metrics.py is:
``gather_for_metrics`` on an eval set of 37 samples, which no global batch divides, so the last
batch is uneven and the samples repeated to even out the ranks must not be counted."""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed

EVAL_SAMPLES = 37


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, :3].sum(1) > 0.3).long())


def f1_score(predictions, references):
    tp = ((predictions == 1) & (references == 1)).sum().item()
    fp = ((predictions == 1) & (references == 0)).sum().item()
    fn = ((predictions == 0) & (references == 1)).sum().item()
    return 2 * tp / max(1, 2 * tp + fp + fn)


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_data(64, 1), shuffle=not args.no_shuffle, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(make_data(EVAL_SAMPLES, 2), shuffle=False, batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
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
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # the batches the killed run had trained on (the restored loader is already there)
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, x, y in active_dataloader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
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
        all_ids, all_predictions, all_references = [], [], []
        for ids, x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            # on the last batch the duplicates that even out the processes are dropped
            ids, predictions, references = accelerator.gather_for_metrics((ids, predictions, y))
            all_ids.append(ids)
            all_predictions.append(predictions)
            all_references.append(references)
        predictions, references = torch.cat(all_predictions), torch.cat(all_references)
        eval_metric = {"accuracy": (predictions == references).float().mean().item(),
                       "f1": f1_score(predictions, references)}
        accelerator.print(f"epoch {epoch}:", eval_metric)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "accuracy": eval_metric["accuracy"], "f1": eval_metric["f1"],
                       "eval_total": len(references), "eval_ids": torch.cat(all_ids).tolist()}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) every this many batches.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
