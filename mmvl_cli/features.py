"""``mmvl_features``: build and inspect region/grid feature LMDBs.

  mmvl_features convert --npy-dir DIR --out X.lmdb [--fp16] [--allow-pickle] [--map-size 64G] [--overwrite]
  mmvl_features convert --mmf-lmdb OLD.lmdb --out X.lmdb --allow-pickle [--fp16]
  mmvl_features extract --images DIR --out X.lmdb --backbone resnet18|resnet50 [--weights local.pth]
                        [--image-size 224] [--batch-size 16] [--fp16] [--overwrite]
  mmvl_features info X.lmdb|DIR [--id ID ...] [--check] [--max-features N] [--allow-pickle]

--allow-pickle reads MMF's pickled _info.npy files / LMDB values; unpickling runs
code, so use it only for trusted sources. ``python -m mmvl_cli.features`` works too.
"""
from __future__ import annotations

import argparse
import sys

from mmvl_cli.common import cli_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvl_features", description="Build and inspect feature LMDBs.")
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="MMF .npy folder or pickled LMDB -> mmvl feature LMDB")
    src = conv.add_mutually_exclusive_group(required=True)
    src.add_argument("--npy-dir", help="folder of <id>.npy features (+ <id>_info.npy)")
    src.add_argument("--mmf-lmdb", help="an MMF LMDB with one pickled dict per value (needs --allow-pickle)")
    conv.add_argument("--out", required=True, help="the LMDB to write")
    conv.add_argument("--fp16", action="store_true", help="store features as float16 (half the size)")
    conv.add_argument("--allow-pickle", action="store_true", help="unpickle MMF side files (trusted sources only)")
    conv.add_argument("--map-size", help="initial LMDB map size, e.g. 64G (grows on demand)")
    conv.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")

    ext = sub.add_parser("extract", help="grid features of a torchvision ResNet over an image folder")
    ext.add_argument("--images", required=True, help="folder of images (searched recursively)")
    ext.add_argument("--out", required=True, help="the LMDB to write")
    ext.add_argument("--backbone", default="resnet50", help="resnet18 or resnet50")
    ext.add_argument("--weights", help="local state-dict file (default: random init)")
    ext.add_argument("--image-size", type=int, default=224, help="square input size in pixels")
    ext.add_argument("--batch-size", type=int, default=16, help="images per forward pass")
    ext.add_argument("--fp16", action="store_true", help="store features as float16")
    ext.add_argument("--map-size", help="initial LMDB map size, e.g. 8G (grows on demand)")
    ext.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ext.add_argument("--quiet", action="store_true", help="no progress bar")

    info = sub.add_parser("info", help="summarise a feature store; decode ids; --check every value")
    info.add_argument("path", help="a feature LMDB or a folder of <id>.npy files")
    info.add_argument("--id", action="append", default=[], help="decode this id (repeatable)")
    info.add_argument("--check", action="store_true", help="decode every value, failing on the first bad one")
    info.add_argument("--max-features", type=int, default=None, help="pad/truncate as a dataset would")
    info.add_argument("--allow-pickle", action="store_true", help="read pickled MMF values (trusted only)")
    return parser


def _describe(sample: dict) -> str:
    f = sample["features"]
    return (f"features {tuple(f.shape)} {str(f.dtype).replace('torch.', '')}, boxes {tuple(sample['boxes'].shape)}, "
            f"num_boxes {sample['num_boxes']}, image {sample['image_width']}x{sample['image_height']}")


def _run(opts: list[str]) -> int:
    args = _parser().parse_args(opts)
    from mmvl.data.features.convert import parse_size

    if args.command == "convert":
        from mmvl.data.features.convert import convert_mmf_lmdb, convert_npy_dir

        fn, src = (convert_npy_dir, args.npy_dir) if args.npy_dir else (convert_mmf_lmdb, args.mmf_lmdb)
        path, count = fn(src, args.out, fp16=args.fp16, allow_pickle=args.allow_pickle,
                         map_size=parse_size(args.map_size) if args.map_size else None,
                         overwrite=args.overwrite, progress=not args.quiet)
        print(f"wrote {count} feature records to {path}")
    elif args.command == "extract":
        from mmvl.data.features.extract import extract_grid_features

        path, count = extract_grid_features(
            args.images, args.out, backbone=args.backbone, weights=args.weights, image_size=args.image_size,
            batch_size=args.batch_size, fp16=args.fp16,
            map_size=parse_size(args.map_size) if args.map_size else None,
            overwrite=args.overwrite, progress=not args.quiet)
        print(f"wrote grid features of {count} images to {path}")
    else:
        from mmvl.data.features.processor import open_features

        reader = open_features(args.path, args.max_features, args.allow_pickle)
        ids = reader.ids()
        print(f"{reader.__class__.__name__} {args.path}: {len(ids)} ids")
        if ids and not args.id:
            print(f"  {ids[0]}: {_describe(reader[ids[0]])}")
        for sample_id in args.id:
            print(f"  {sample_id}: {_describe(reader[sample_id])}")
        if args.check:
            for sample_id in ids:
                reader[sample_id]
            print(f"  all {len(ids)} values decode")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_run, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
