"""What a run trained, written for other tools: its LoRA adapters as peft folders, or the whole run as a
transformers folder."""
from mmvl.export.adapters import adapter_tensors, export_adapters, export_run_adapters
from mmvl.export.hf import export_run_hf

__all__ = ["adapter_tensors", "export_adapters", "export_run_adapters", "export_run_hf"]
