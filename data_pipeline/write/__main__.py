"""Write a raw image collection as globally pre-shuffled WebDataset shards with a Parquet manifest.

python -m data_pipeline.write --source tfds:DIR --vtab cifar100 --split train --out /shards/vtab/cifar100/train
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from data_pipeline import manifest
from data_pipeline.cli import fail, interrupted, local_path, output_folder
from data_pipeline.paths import is_remote
from data_pipeline.write.dedup import load_exclusion
from data_pipeline.write.readers import Source, open_source
from data_pipeline.write.splits import label_space
from data_pipeline.write.tfds import TFDS_PREFIX, TfdsSource, describe, is_tfds_folder, open_tfds_source, tfds_path
from data_pipeline.write.writer import WriteConfig, write_dataset


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data_pipeline.write",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--source",
        required=True,
        help="class-per-folder tree, folder of per-class .tar, .parquet, or tfds:DIR (a TensorFlow Datasets folder)",
    )
    p.add_argument("--out", required=True, help="split folder to write (shards + manifest)")
    p.add_argument("--kind", default="auto", choices=["auto", "folder", "imagenet21k", "parquet", "tfds"])
    p.add_argument("--class-names", default=None, help="file of 'id name' lines (or one name per line)")
    p.add_argument(
        "--image-column",
        default=None,
        help="image column (parquet; default image) or feature (tfds; default its supervised image, else image)",
    )
    p.add_argument("--label-column", default=None, help="label column (parquet) or ClassLabel feature (tfds)")
    p.add_argument("--name", default=None, help="dataset name (default: the source folder's, or the TFDS/VTAB name)")
    p.add_argument(
        "--split",
        default="train",
        help="split name recorded in dataset.json; for tfds: the TFDS split to read, or with --vtab the VTAB split\n"
        "(train = VTAB-1k's 1000 images train800+val200, test, train800, val200, train800val200, val, trainval)",
    )
    p.add_argument("--tfds-split", default=None, help="tfds: records to read, in TFDS syntax (train[:800]+test[:50%%])")
    p.add_argument("--vtab", default=None, metavar="TASK", help="tfds: a VTAB-1k task's splits, labels (docs/vtab.md)")
    p.add_argument("--samples-per-shard", type=int, default=WriteConfig.samples_per_shard)
    p.add_argument("--max-short-side", type=int, default=WriteConfig.max_short_side)
    p.add_argument("--min-size", type=int, default=WriteConfig.min_size)
    p.add_argument("--seed", type=int, default=WriteConfig.seed)
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--keep-exact-duplicates",
        action="store_true",
        help="keep byte-identical images (always on for tfds: a TFDS split is its records, duplicates included)",
    )
    p.add_argument("--near-duplicate-distance", type=int, default=WriteConfig.near_duplicate_distance)
    p.add_argument(
        "--exclude-like",
        action="append",
        default=[],
        help="evaluation shard folder, samples.parquet or image folder whose images must not be written",
    )
    return p


def _check_not_empty(args: argparse.Namespace) -> None:
    """ValueError for an empty path: ``Path("")`` is the current directory, read or written without a word."""
    given = [("--source", args.source), ("--out", args.out), ("--class-names", args.class_names)]
    for option, value in given + [("--exclude-like", path) for path in args.exclude_like]:
        if value is not None and not value.strip():
            raise ValueError(f"{option} is empty; give a path (`.` for the current folder)")


def _open_source(args: argparse.Namespace) -> tuple[Source, str, dict]:
    if args.class_names is not None and not Path(args.class_names).is_file():
        raise ValueError(f"--class-names {args.class_names} is not a file; give a file of 'id name' lines")
    if is_remote(args.source.removeprefix(TFDS_PREFIX)):
        raise ValueError(
            f"--source {args.source}: object storage is not a --source; copy it to a local or shared folder first "
            "(e.g. `gcloud storage cp -r` or `aws s3 sync`) and give that folder"
        )
    folder = tfds_path(args.source)
    if folder is None and (args.kind == "tfds" or args.kind == "auto" and is_tfds_folder(args.source)):
        folder = args.source
    if folder is not None:
        tfds = open_tfds_source(
            folder,
            split=args.split,
            tfds_split=args.tfds_split,
            vtab=args.vtab,
            image_feature=args.image_column,
            label_feature=args.label_column,
            class_names_file=args.class_names,
        )
        return tfds, args.vtab or tfds.tfds_name.replace("/", "_"), {"tfds": describe(tfds)}
    if args.vtab is not None or args.tfds_split is not None:
        raise ValueError("--vtab and --tfds-split select records of a TFDS folder; give --source tfds:DIR")
    source = open_source(
        args.source,
        kind=args.kind,
        class_names_file=args.class_names,
        image_column=args.image_column or "image",
        label_column=args.label_column or "label",
        label_space=label_space(args.out, args.split),
    )
    return source, Path(os.path.abspath(args.source)).name, {}  # `.` and `..` name the folder they mean


def _check_not_inside(out: Path, source: str) -> None:
    """ValueError when ``out`` is ``source`` or inside it: the next run would read the shards as a class."""
    root = Path(source).expanduser().resolve()
    if root.is_dir() and (out.resolve() == root or root in out.resolve().parents):
        raise ValueError(
            f"--out {out} is the --source folder {source} or inside it, so the next run would read the shards as a "
            "class; choose an --out outside the source"
        )


def _kept(out: Path) -> str:
    """What an interrupted write leaves: its finished shards, which a re-run keeps (`writer._check_folder`)."""
    done = sum(1 for _ in out.glob(manifest.SHARD_GLOB)) if out.is_dir() else 0
    if not done:
        return "no shard was finished; the same command starts over"
    return f"the {done} finished shards in {out} are kept; the same command goes on from them"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    fresh = not os.path.lexists(args.out)  # a refused run removes the --out it created, if still empty
    try:
        _check_not_empty(args)
        source, name, extra_meta = _open_source(args)
        as_is = ("samples_per_shard", "max_short_side", "min_size", "seed", "processes", "near_duplicate_distance")
        config = WriteConfig(
            name=args.name or name,
            split=args.split,
            keep_exact_duplicates=args.keep_exact_duplicates or isinstance(source, TfdsSource),
            **{k: getattr(args, k) for k in as_is},
        )
        config.validate()
        exclusions = [load_exclusion(path, args.near_duplicate_distance) for path in args.exclude_like]
        for more in exclusions[1:]:
            exclusions[0].merge(more)
        exclude = exclusions[0] if exclusions else None
        _check_not_inside(local_path(args.out, "--out"), tfds_path(args.source) or args.source)
        output_folder(args.out, "--out")  # after the inputs are checked
        report = write_dataset(args.out, config, source=source, exclude=exclude, extra_meta=extra_meta)
    except ValueError as err:
        if fresh and os.path.isdir(args.out) and not os.listdir(args.out):
            os.rmdir(args.out)
        return fail(parser.prog, err)
    except KeyboardInterrupt:
        return interrupted(parser.prog, _kept(Path(args.out)))
    print(report.summary())
    if getattr(source, "class_ids", ()):  # `splits.label_space`
        print(f"labels: the {len(source.class_ids)} classes of the split folders beside {args.out}, by class id")
    return 0


if __name__ == "__main__":
    sys.exit(main())
