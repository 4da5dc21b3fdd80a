"""Checkpointing with a mid-epoch resume, written as Accelerate's by_feature/checkpointing.py is:
``save_state`` every ``--checkpointing_steps``, ``--resume_from_checkpoint`` + ``skip_first_batches``."""
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
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, :4].sum(1) > 0).long())


def training_function(args):
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    set_seed(42)
    train_dataloader = DataLoader(make_data(96, 1), shuffle=True, batch_size=args.batch_size)
    eval_dataloader = DataLoader(make_data(30, 2), shuffle=False, batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-2)
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
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, x, y in active_dataloader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            overall_step += 1
            seen.append(accelerator.gather(ids).tolist())
            if overall_step % args.checkpointing_steps == 0:
                output_dir = os.path.join(args.output_dir, f"step_{overall_step}")
                accelerator.save_state(output_dir)
                if overall_step == args.stop_after:  # the run is killed right after this save
                    sys.exit(3)
        orders.append(seen)
        model.eval()
        correct = total = 0
        for ids, x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == references).sum().item()
            total += len(references)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total}")
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "accuracy": correct / total, "eval_total": total}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--stop_after", type=int, default=-1)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--output_dir", required=True)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
