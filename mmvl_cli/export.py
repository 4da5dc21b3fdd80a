"""usage: mmvl_export {adapters,hf} SAVE_DIR OUT [--checkpoint PATH.ckpt] [--best] [--adapters]

hf: writes an hf_vlm run as a transformers folder (the source folder's architecture with the run's
weights, LoRA merged; its processor with the chat template; generation_config.json ending at the
template's end of turn) that AutoModelForImageTextToText and AutoProcessor load, vLLM serves and
lmms-eval scores. --adapters (a LoRA run): the source weights as released, and the adapters in
OUT/adapters, unmerged. A vlm run on an hf_vision tower (projects/vlm/configs/llava/clip.yaml) is
written as LlavaForConditionalGeneration.

adapters: writes the LoRA adapters a run trained (model_config.<model>.lora) as a peft adapter folder:
adapter_config.json and adapter_model.safetensors, which
``peft.PeftModel.from_pretrained(base_lm, OUT)`` loads onto the base LM (for a VLM: the
transformers folder of model_config.vlm.language_model.path). With several adapted parts, one
folder each under OUT. The weights come from SAVE_DIR/checkpoints/last.ckpt (--checkpoint: another).

Example:
  mmvl_run config=projects/vlm/configs/easy_vqa_generative/stage2.yaml model_config.vlm.lora.r=8 \\
      env.save_dir=save/lora
  mmvl_export adapters save/lora adapters/
  mmvl_export hf save/hf_vlm exported/      # then AutoModelForImageTextToText.from_pretrained("exported")
"""
from __future__ import annotations

import argparse
import sys

from mmvl_cli.common import cli_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvl_export", description="Export what a run trained.")
    parser.add_argument("what", choices=["adapters", "hf"],
                        help="adapters: the LoRA adapters, as a peft folder; hf: the run as a transformers folder")
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="env.save_dir of the run")
    parser.add_argument("out", metavar="OUT", help="the folder to write (must not exist)")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint to read (default: SAVE_DIR/checkpoints/last.ckpt)")
    parser.add_argument("--best", action="store_true", help="hf: the best checkpoint instead of the last")
    parser.add_argument("--adapters", action="store_true",
                        help="hf, a LoRA run: the source weights as released and the adapters in OUT/adapters, unmerged")
    return parser


def _export(opts: list[str]) -> int:
    args = _parser().parse_args(opts)
    from mmvl.export import export_run_adapters, export_run_hf

    if args.what == "hf":
        print(f"wrote {export_run_hf(args.save_dir, args.out, args.checkpoint, args.best, args.adapters)}")
        return 0
    for folder in export_run_adapters(args.save_dir, args.out, checkpoint=args.checkpoint):
        print(f"wrote {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_export, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
