"""What a run trained, written for other tools: today its LoRA adapters as peft folders."""
from mmvl.export.adapters import adapter_tensors, export_adapters, export_run_adapters

__all__ = ["adapter_tensors", "export_adapters", "export_run_adapters"]
