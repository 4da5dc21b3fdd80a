"""A script for ``mmvl_launch`` tests: each process writes what its Engine saw to <out>/rank_<r>.json."""
import json
import os
import sys

from mmvl.engine import Accelerator

accelerator = Accelerator(cpu=True)  # no mixed_precision or accumulation of its own: the launch's apply
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank_{accelerator.process_index}.json"), "w") as f:
    json.dump({"num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
               "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
               "argv": sys.argv[2:]}, f)
accelerator.end_training()
