"""Automatic batch size, written as Accelerate's by_feature/memory.py is: the inner training loop
under ``@find_executable_batch_size`` shrinks its batch size (by 0.9) after each out-of-memory error.
The device's memory is simulated: a batch above ``--max_device_batch`` raises CUDA's error."""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(torch.arange(n), x, (x[:, 2] * x[:, 3] > 0).long())


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    tried = []

    @find_executable_batch_size(starting_batch_size=args.batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator  # the accelerator is reused between tries
        accelerator.free_memory()  # what the failed try prepared is released
        tried.append(batch_size)
        set_seed(config["seed"])
        train_dataloader = DataLoader(make_data(100, 1), shuffle=not args.no_shuffle, batch_size=batch_size)
        eval_dataloader = DataLoader(make_data(40, 2), shuffle=False, batch_size=batch_size)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
        model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader)
        overall_step, starting_epoch = 0, 0
        # the folder, step_<n>_batch_<size>, holds the state of the try at that batch size; a larger
        # try trains afresh (and runs out of memory again) until the search reaches it
        training_difference = os.path.basename(args.resume_from_checkpoint or "step_0_batch_0")
        resume_step, saved_batch_size = (int(v) for v in training_difference[5:].split("_batch_"))
        if args.resume_from_checkpoint and saved_batch_size == batch_size:
            accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
            accelerator.load_state(args.resume_from_checkpoint)
            starting_epoch = resume_step // len(train_dataloader)
            overall_step = resume_step
            resume_step -= starting_epoch * len(train_dataloader)
        orders = []
        for epoch in range(starting_epoch, config["num_epochs"]):
            model.train()
            seen = []
            if saved_batch_size == batch_size and epoch == starting_epoch:
                # the batches the killed run had trained on (the restored loader is already there)
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            else:
                active_dataloader = train_dataloader
            for ids, x, y in active_dataloader:
                if x.shape[0] > args.max_device_batch:
                    raise RuntimeError("CUDA out of memory.")
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                seen.append(accelerator.gather(ids).tolist())
                overall_step += 1
                if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}_batch_{batch_size}"))
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
            accelerator.print(f"epoch {epoch} at batch size {batch_size}: accuracy {correct / total:.3f}")
        return model, orders, correct / total, total

    model, orders, accuracy, total = inner_training_loop()
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "accuracy": accuracy, "eval_total": total, "tried": tried}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=20, help="The batch size the search starts at.")
    parser.add_argument("--max_device_batch", type=int, default=10, help="Largest batch that fits (simulated).")
    parser.add_argument("--no_shuffle", action="store_true", help="Train in dataset order (to compare runs).")
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) every this many batches.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n>_batch_<size> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42}
    training_function(config, args)


if __name__ == "__main__":
    main()
