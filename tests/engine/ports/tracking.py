"""Experiment tracking, written as Accelerate's by_feature/tracking.py is: with ``--with_tracking``
the Accelerator logs to every installed tracker (``log_with="all"``) under ``--project_dir``; the
run is named after this file, the config is its hyperparameters, the main process logs the
epoch's accuracy and mean train loss with ``step=epoch``, and ``end_training`` closes the trackers."""
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
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def training_function(config, args):
    if args.with_tracking:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, log_with="all",
                                  project_dir=args.project_dir)
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(make_data(64, 1), shuffle=not args.no_shuffle, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(make_data(37, 2), batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        accelerator.init_trackers(run, config)
    logged = []
    for epoch in range(config["num_epochs"]):
        model.train()
        if args.with_tracking:
            total_loss = 0
        for x, y in train_dataloader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if args.with_tracking:
                total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct, total = 0, 0
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == references).sum().item()
            total += references.numel()
        eval_metric = {"accuracy": correct / total}
        accelerator.print(f"epoch {epoch}:", eval_metric)
        if args.with_tracking:
            values = {"accuracy": eval_metric["accuracy"], "train_loss": total_loss.item() / len(train_dataloader),
                      "epoch": epoch}
            accelerator.log(values, step=epoch)
            logged.append(values)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"logged": logged, "accuracy": eval_metric["accuracy"]}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--with_tracking", action="store_true", help="Log to every installed tracker.")
    parser.add_argument("--project_dir", type=str, default="logs", help="Where the trackers write.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
