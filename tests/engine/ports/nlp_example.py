"""Text classification with a small BERT, written as Accelerate's examples/nlp_example.py is
(a tiny randomly initialised BertForSequenceClassification on generated token sequences)."""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 60, (n, 12), generator=g)
    labels = (input_ids[:, 0] >= 32).long()
    return TensorDataset(torch.arange(n), input_ids, torch.ones_like(input_ids), labels)


def get_dataloaders(accelerator, batch_size):
    with accelerator.main_process_first():  # where the examples tokenize with datasets.map
        train, evaluation = make_data(128, 1), make_data(40, 2)
    return (DataLoader(train, shuffle=True, batch_size=batch_size),
            DataLoader(evaluation, shuffle=False, batch_size=8))


def training_function(args):
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    set_seed(42)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, args.batch_size)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=args.dropout,
                        attention_probs_dropout_prob=args.dropout, num_labels=2)
    model = BertForSequenceClassification(config).to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=args.lr)
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
    orders, sums, accuracy = [], [], 0.0
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        seen = []
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # the batches the killed run had trained on (the restored loader is already there)
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for ids, input_ids, mask, labels in active_dataloader:
            outputs = model(input_ids=input_ids, attention_mask=mask, labels=labels)
            accelerator.backward(outputs.loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append(accelerator.gather(ids).tolist())
            sums.append(sum(p.detach().double().sum() for p in model.parameters()).item())  # the trajectory
            overall_step += 1
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
                if overall_step == args.stop_after:  # the run is killed right after this save
                    sys.exit(3)
        orders.append(seen)
        model.eval()
        correct = total = 0
        for ids, input_ids, mask, labels in eval_dataloader:
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=mask).logits
            predictions, references = accelerator.gather_for_metrics((logits.argmax(-1), labels))
            correct += (predictions == references).sum().item()
            total += len(references)
        accuracy = correct / total
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f} on {total}")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump({"orders": orders, "sums": sums, "accuracy": accuracy, "eval_total": total,
                       "distributed": str(accelerator.distributed_type != DistributedType.NO)}, f)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0, help="BERT's hidden and attention dropout.")
    parser.add_argument("--checkpointing_steps", type=int, default=None,
                        help="Save the state (save_state) every this many batches.")
    parser.add_argument("--resume_from_checkpoint", default=None, help="A step_<n> folder to resume from.")
    parser.add_argument("--stop_after", type=int, default=-1, help="Exit right after the save at this step.")
    parser.add_argument("--output_dir", required=True)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
