"""The weights command line: convert an official .npz, describe any weights vitscale reads, export them.

    python -m pretrain.weights convert IN.npz OUT_DIR [--image-size N]    # npz → model.safetensors + model.json
    python -m pretrain.weights info PATH [--image-size N]                 # config, params, GMACs
    python -m pretrain.weights export SOURCE OUT [--format hf|npz] [--image-size N] [--mlflow-run ID]

Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from data_pipeline.cli import fail, interrupted, local_path
from pretrain.checkpoint.run_folder import CONFIG_FILE, WEIGHTS_FILE
from pretrain.model.flops import describe
from pretrain.model.vit import VisionTransformer
from pretrain.weights import source as weights_source
from pretrain.weights.export import (
    FORMATS,
    HF_FILES,
    NPZ_NAME,
    check_folder_out,
    check_npz_out,
    checkpoint_step,
    class_names,
    export,
    new_folder,
)
from pretrain.weights.formats import load_model, load_npz, save_pretrained
from pretrain.weights.hf import NPZ_ALREADY, check_convertible
from tracking.models import log_hf_model, loggable_run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pretrain.weights", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="official .npz → model.safetensors + model.json")
    convert.add_argument("npz", help="an official .npz (a path, or s3:// / gs://)")
    convert.add_argument("out_dir")
    convert.add_argument("--image-size", type=int, help="resize position embeddings to this input side")
    info = sub.add_parser("info", help="print the architecture, size and compute of any weights vitscale reads")
    info.add_argument("source", help=".npz, checkpoint folder or save_pretrained folder (a path, or s3:// / gs://)")
    info.add_argument("--image-size", type=int)
    out = sub.add_parser("export", help="any weights vitscale reads → a transformers folder (hf) or the official .npz")
    out.add_argument(
        "source",
        metavar="SOURCE",
        help="a checkpoint folder, a run folder (its newest "
        "COMPLETE checkpoint), a save_pretrained / convert / HF folder, or an official .npz; a path, or s3:// / gs://",
    )
    out.add_argument(
        "out",
        metavar="OUT",
        help="hf: the folder to write config.json, model.safetensors "
        "and preprocessor_config.json into; npz: the file (a folder, or a path ending in /, gets model.npz)",
    )
    out.add_argument(
        "--format",
        choices=FORMATS,
        default="hf",
        help="hf: transformers ViTForImageClassification "
        "(ViTModel without a head); npz: the official big_vision / vision_transformer layout "
        "(default: hf)",
    )
    out.add_argument("--image-size", type=int, help="resize position embeddings to this input side")
    out.add_argument(
        "--mlflow-run",
        metavar="ID",
        help="also log the HF folder as an MLflow model of this run, at "
        "the checkpoint's step, tagged with the run's eval means there (hf; SOURCE: a checkpoint or "
        "run folder)",
    )
    out.add_argument(
        "--tracking-uri",
        help="MLflow store of --mlflow-run (default: MLFLOW_TRACKING_URI, else the project's mlflow.db)",
    )
    return parser


def _export(args: argparse.Namespace) -> VisionTransformer:
    source = weights_source.resolve(args.source)
    if args.format == "hf":
        check_folder_out(args.out, HF_FILES, source)
    else:
        check_npz_out(args.out, source)
    step = checkpoint_step(source)
    if args.mlflow_run:  # before anything is written
        loggable_run(args.mlflow_run, args.tracking_uri, step=step, source=source)
    model = load_model(source, image_size=args.image_size)
    if args.format == "hf" and source.is_file():  # an .npz: the advice to export one does not fit
        check_convertible(model.config, NPZ_ALREADY)
    written = export(model, args.out, args.format, labels=class_names(source, model.config.num_classes))
    print(f"wrote {written}")
    if args.mlflow_run:
        uri = log_hf_model(written, args.mlflow_run, args.tracking_uri, step=step, source=source)
        print(f"logged to MLflow run {args.mlflow_run} as {uri}")
    return model


def _check_arguments(args: argparse.Namespace) -> None:
    """ValueError for arguments that cannot work, before anything is read; outputs become filesystem paths (Path
    would make gs://b gs:/b)."""
    if args.image_size is not None and args.image_size < 1:
        raise ValueError(f"--image-size must be a positive number of pixels, got {args.image_size}")
    if args.command == "convert":
        args.out_dir = local_path(args.out_dir, "OUT_DIR")
        if args.out_dir.exists() and not args.out_dir.is_dir():
            raise ValueError(
                f"OUT_DIR {args.out_dir} is a file; pass a folder to write model.safetensors and model.json into"
            )
    elif args.command == "export":
        as_folder = str(args.out).endswith(("/", os.sep))  # which Path drops
        args.out = local_path(args.out, "OUT")
        if args.format == "npz" and as_folder and not args.out.is_dir():
            if args.out.exists():
                raise ValueError(f"OUT {args.out}/ names a folder, but {args.out} is a file; pass its path without /")
            args.out = args.out / NPZ_NAME  # a folder gets model.npz
        if args.format == "hf" and args.out.exists() and not args.out.is_dir():
            raise ValueError(f"OUT {args.out} is a file; --format hf writes a folder (config.json + model.safetensors)")
        if args.mlflow_run and args.format != "hf":
            raise ValueError("--mlflow-run logs the HF folder: use it with --format hf")


def _run(args: argparse.Namespace) -> VisionTransformer:
    _check_arguments(args)
    if args.command == "convert":
        check_folder_out(args.out_dir, (WEIGHTS_FILE, CONFIG_FILE))  # what save_pretrained writes
        model = load_npz(weights_source.locate(args.npz), image_size=args.image_size)
        with new_folder(args.out_dir):
            save_pretrained(model, args.out_dir)
        print(f"wrote {args.out_dir}")
        return model
    if args.command == "export":
        return _export(args)
    return load_model(args.source, image_size=args.image_size)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # argparse's own usage errors (flags, values) exit 2 as argparse prints them
    try:
        model = _run(args)
    except (ValueError, OSError, ImportError) as error:  # bad input (ImportError: s3/gs extra); bugs keep tracebacks
        return fail(parser.prog, error)
    except KeyboardInterrupt:
        out = getattr(args, "out_dir", getattr(args, "out", None))  # info writes nothing
        kept = "nothing was written" if out is None else f"{out} may be partly written: the same command writes it anew"
        return interrupted(parser.prog, kept)
    summary = {"config": model.config.to_dict(), **describe(model.config)}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
