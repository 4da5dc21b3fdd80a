"""usage: mmvl_export adapters SAVE_DIR OUT [--checkpoint PATH.ckpt]

Writes the LoRA adapters a run trained (model_config.<model>.lora) as a peft adapter folder:
adapter_config.json and adapter_model.safetensors, which
``peft.PeftModel.from_pretrained(base_lm, OUT)`` loads onto the base LM (for a VLM: the
transformers folder of model_config.vlm.language_model.path). With several adapted parts, one
folder each under OUT. The weights come from SAVE_DIR/checkpoints/last.ckpt (--checkpoint: another).

Example:
  mmvl_run config=projects/vlm/configs/easy_vqa_generative/stage2.yaml model_config.vlm.lora.r=8 \\
      env.save_dir=save/lora
  mmvl_export adapters save/lora adapters/
"""
from __future__ import annotations

import argparse
import sys

from mmvl_cli.common import cli_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvl_export", description="Export what a run trained.")
    parser.add_argument("what", choices=["adapters"], help="adapters: the LoRA adapters, as a peft folder")
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="env.save_dir of the run")
    parser.add_argument("out", metavar="OUT", help="the folder to write (must not exist)")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint to read (default: SAVE_DIR/checkpoints/last.ckpt)")
    return parser


def _export(opts: list[str]) -> int:
    args = _parser().parse_args(opts)
    from pathlib import Path

    from omegaconf import OmegaConf

    from mmvl import registry
    from mmvl.checkpoint import load_checkpoint
    from mmvl.errors import UserError
    from mmvl.models.modules.lora import export_adapters

    save = Path(args.save_dir)
    if not (save / "config.yaml").is_file():
        raise UserError(f"mmvl_export: {str(save)!r} has no config.yaml; give the env.save_dir of an mmvl run.")
    config = OmegaConf.load(save / "config.yaml")
    model = str(config.model)
    checkpoint = Path(args.checkpoint) if args.checkpoint else save / "checkpoints" / "last.ckpt"
    state = load_checkpoint(checkpoint)["model"]
    model_cfg = config.model_config[model]
    base = (model_cfg.get("language_model") or {}).get("path")
    for folder in export_adapters(model, registry.MODELS.get(model).PARTS, model_cfg.get("lora"), state, args.out,
                                  base_path=str(base) if base else None):
        print(f"wrote {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_export, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
