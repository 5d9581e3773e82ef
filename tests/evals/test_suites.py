"""Every shipped eval suite loads with typed options; bad options fail at load; rows → MLflow metrics; plug-ins."""

import math

import pytest

from data_pipeline.paths import SUITES_DIR
from evals.evaluator import EvalOutput, ResultRow, mlflow_metrics
from evals.finetune import FinetuneOptions
from evals.suites import EVALUATORS, load_suite, register_evaluator

SHIPPED = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


def test_required_suites_are_shipped():
    assert {"local_fewshot", "ci_vtab", "vtab1k", "digits_finetune", "inspect"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_suites_load_with_parsed_options(name):
    suite = load_suite(name)
    assert suite.name == name and suite.evaluators
    for spec in suite.evaluators:
        assert isinstance(spec.options, EVALUATORS[spec.type].options)
    if name == "vtab1k":  # nested options are typed too: the paper's fine-tuning schedule
        (spec,) = suite.evaluators
        assert spec.options.finetune == FinetuneOptions(
            steps=2500, batch_size=512, micro_batch_size=32, warmup_steps=200
        )
    if name == "digits_finetune":  # VTAB-1k's budget, and a learning curve ending at the reported number
        (spec,) = suite.evaluators
        opts = spec.options
        assert (opts.train_examples, opts.val_examples) == (800, 200) and opts.eval_steps[-1] == opts.steps


FEWSHOT = "  - type: fewshot\n    datasets: [digits]\n"


@pytest.mark.parametrize(
    "body, message",
    [
        ("  - type: knn\n", r"unknown type 'knn'"),
        (FEWSHOT + "    shot: [1]\n", r"\(fewshot\): unknown key\(s\) \['evaluators\[0\]\.shot'\].*valid keys"),
        (FEWSHOT + "    shots: [1, five]\n", r"evaluators\[0\]\.shots\[1\] must be an integer, got 'five'"),
        (FEWSHOT + "    shots: [0, 5]\n", r"shots must be a non-empty list of positive integers; got \[0, 5\]"),
        (FEWSHOT + "    seeds: []\n", r"'seeds' is empty"),
        # a repeated seed was counted as another independent subset: ± 0.0000 over n=2 for [0, 0]
        (FEWSHOT + "    seeds: [0, 1, 0]\n", r"seeds \[0, 1, 0\] repeats 0; list each once"),
        (FEWSHOT + "    shots: [5, 5]\n", r"shots \[5, 5\] repeats 5; list each once"),
        (FEWSHOT + "    batch_size: 0\n", r"batch_size must be >= 1"),
        ("  - type: vtab\n    tasks: [imagenet]\n", r"tasks \['imagenet'\] are not in benchmark 'vtab1k'"),
        ("  - type: vtab\n    benchmark: vtab2\n", r"unknown benchmark 'vtab2'"),
        ("  - type: vtab\n    protocol: knn\n", r"evaluators\[0\]\.protocol='knn' is unknown; use one of linear_probe"),
        ("  - type: vtab\n    finetune: {stpes: 5}\n", r"unknown key\(s\) \['evaluators\[0\]\.finetune\.stpes'\]"),
        ("  - type: vtab\n    finetune: {lr_grid: [0]}\n", r"lr_grid must be non-empty positive"),
        ("  - type: finetune\n    holdout_fraction: 1.5\n", r"holdout_fraction must be in \(0, 1\)"),
        ("  - type: finetune\n    train_examples: 800\n", r"set train_examples and val_examples together"),
        (
            "  - type: finetune\n    train_examples: 8\n    val_examples: 2\n    holdout_fraction: 0.2\n",
            r"holdout_fraction is unused when train_examples",
        ),
        ("  - type: finetune\n    train_examples: 0\n    val_examples: 2\n", r"train_examples must be >= 1"),
        (
            "  - type: finetune\n    steps: 10\n    eval_steps: [5, 20]\n",
            r"eval_steps must be distinct steps in 1\.\.steps=10; got \[5, 20\]",
        ),
        ("  - type: finetune\n    eval_steps: [5, 5]\n", r"eval_steps must be distinct steps"),
        ("  - type: vtab\n    finetune: {eval_steps: [5]}\n", r"not used by type: vtab"),
        # The fine-tuning block's sizes and data were silently ignored: the run went at the checkpoint's resolution.
        (
            "  - type: vtab\n    protocol: finetune\n    finetune: {image_size: 384}\n",
            r"finetune\.image_size is not used by type: vtab .*entry's own image_size",
        ),
        ("  - type: vtab\n    finetune: {datasets: [dtd]}\n", r"finetune\.datasets is not used by type: vtab"),
        ("  - type: inspect\n    num_images: 2\n    num_rollout_images: 3\n", r"num_rollout_images \(3\) must be ≤"),
    ],
)
def test_bad_options_fail_when_the_suite_loads(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"name: bad\nevaluators:\n{body}")
    with pytest.raises(ValueError, match=message) as raised:
        load_suite(path)
    assert str(path) in str(raised.value)


def test_bad_suite_files_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown eval suite 'nope'.*local_fewshot"):
        load_suite("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(ValueError, match="non-empty 'evaluators'"):
        load_suite(bad)
    bad.write_text("name: x\nevaluators: [{type: fewshot}]\nextra: 1\n")
    with pytest.raises(ValueError, match=r"unknown top-level keys \['extra'\]"):
        load_suite(bad)
    bad.write_text("name: [x]\nevaluators: [{type: fewshot}]\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: name must be a string, got \['x'\]"):
        load_suite(bad)
    bad.write_text("name: x\nevaluators: [{shots: [1]}]\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: evaluators\[0\] needs a 'type' \(one of \[.*'fewshot'"):
        load_suite(bad)
    with pytest.raises(ValueError, match=r"eval suite file .*missing\.yaml does not exist.*local_fewshot"):
        load_suite(tmp_path / "missing.yaml")


def test_mlflow_metrics_are_the_ok_rows_with_a_finite_value():
    rows = [
        ResultRow("vtab", "svhn", "vtab/svhn", 0.5),
        ResultRow("vtab", "dtd", "vtab/dtd", math.nan, count=0, status="missing", detail="no shard folder"),
        ResultRow("vtab", "vtab1k", "vtab/num_tasks", 1.0),  # a count is logged even when it is 0
        ResultRow("finetune", "digits", "finetune/digits/holdout_accuracy", 0.9, status="sweep", detail="lr=0.1"),
        ResultRow("inspect", "digits", "inspect/pos_embed_similarity/neighbour", math.nan),  # ok but not finite
        ResultRow("vtab", "svhn", "vtab/svhn", 0.75),  # a repeated key: the later value, as MLflow keeps it
    ]
    assert mlflow_metrics(rows) == {"vtab/svhn": 0.75, "vtab/num_tasks": 1.0}
    records = [vars(r) for r in rows]  # the parquet's records give the same metrics
    assert mlflow_metrics(records) == mlflow_metrics(rows)


def test_register_evaluator_is_a_plug_in(monkeypatch, tmp_path):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ConstantOptions:
        value: float = 1.0

    monkeypatch.setitem(EVALUATORS, "constant", None)

    @register_evaluator("constant", ConstantOptions)
    def constant(ctx, options: ConstantOptions):
        return EvalOutput(rows=[ResultRow("constant", "-", "constant/value", options.value)])

    path = tmp_path / "plugin.yaml"
    path.write_text("evaluators:\n  - type: constant\n    name: three\n    value: 3\n")
    (spec,) = load_suite(path).evaluators
    assert (spec.type, spec.name, spec.options) == ("constant", "three", ConstantOptions(value=3.0))
    assert mlflow_metrics(EVALUATORS["constant"].evaluate(None, spec.options).rows) == {"constant/value": 3.0}
    path.write_text("evaluators:\n  - type: constant\n    value: three\n")
    with pytest.raises(ValueError, match=r"evaluators\[0\]\.value must be a number, got .three."):
        load_suite(path)


def test_a_suite_name_that_is_no_file_name_is_refused_before_any_work(tmp_path, capsys):
    """The table is <out>/<suite name>.parquet, written once every entry has run: `name: lab/inspect` failed then,
    after all the work (hours for vtab1k)."""
    from evals.run import main

    bad = tmp_path / "bad.yaml"
    for name in ("lab/inspect", "..", '""'):
        bad.write_text(f"name: {name}\nevaluators: [{{type: inspect}}]\n")
        with pytest.raises(ValueError, match=r"bad\.yaml: name .* must be a non-empty name without '/'"):
            load_suite(bad)
    assert main(["--checkpoint", str(tmp_path), "--suite", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "name '' must be a non-empty name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
