"""``mmvl_shards``: write WebDataset shards of image-text pairs from an image folder and a captions file.

  mmvl_shards --images DIR --captions pairs.jsonl|pairs.tsv --out DIR [--prefix train] [--samples-per-shard 10000]

pairs.jsonl holds {"image": "<path under DIR>", "caption": "..."} a line; pairs.tsv <path>\\t<caption>.
Train from them with dataset image_text_shards (splits.train.shards: "train-{000000..000009}.tar").
``python -m mmvl_cli.shards`` works too.
"""
from __future__ import annotations

import argparse
import sys

from mmvl_cli.common import cli_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvl_shards", description="Write image-text WebDataset shards.")
    parser.add_argument("--images", required=True, help="the folder the captions file's image paths are under")
    parser.add_argument("--captions", required=True, help="a .jsonl ({image, caption}) or .tsv (path<TAB>caption)")
    parser.add_argument("--out", required=True, help="the folder to write <prefix>-NNNNNN.tar into")
    parser.add_argument("--prefix", default="train", help="shard name prefix (e.g. train, val)")
    parser.add_argument("--samples-per-shard", type=int, default=10000, help="samples in each shard")
    return parser


def _run(opts: list[str]) -> int:
    args = _parser().parse_args(opts)
    from mmvl.data.shard_writer import write_shards

    paths = write_shards(args.images, args.captions, args.out, prefix=args.prefix,
                         samples_per_shard=args.samples_per_shard)
    last = f"{len(paths) - 1:06d}"
    print(f"wrote {len(paths)} shards: {paths[0].parent}/{args.prefix}-{{000000..{last}}}.tar")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_run, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
