"""Every shipped eval suite loads and its options parse; the registry accepts new evaluator types."""

import pytest

from evals.suites import (
    EVALUATORS,
    SUITES_DIR,
    EvalOutput,
    get_evaluator,
    load_suite,
    parse_options,
    register_evaluator,
)

SHIPPED = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


def test_required_suites_are_shipped():
    assert {"local_fewshot", "ci_vtab", "vtab1k", "digits_finetune"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_suite_options_parse(name):
    from evals.fewshot import FewshotOptions
    from evals.finetune import FinetuneOptions
    from evals.vtab import VtabOptions

    options_of = {"fewshot": FewshotOptions, "finetune": FinetuneOptions, "vtab": VtabOptions}
    suite = load_suite(name)
    assert suite.name == name and suite.evaluators
    for spec in suite.evaluators:
        if spec.type in options_of:
            opts = parse_options(options_of[spec.type], spec.options, f"{name}:{spec.type}")
            if spec.type == "vtab" and opts.protocol == "finetune":
                parse_options(FinetuneOptions, opts.finetune, f"{name}:vtab.finetune")


def test_bad_suites_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown eval suite 'nope'.*local_fewshot"):
        load_suite("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("evaluators:\n  - type: knn\n")
    with pytest.raises(ValueError, match="unknown type 'knn'"):
        load_suite(bad)
    bad.write_text("name: x\n")
    with pytest.raises(ValueError, match="non-empty 'evaluators'"):
        load_suite(bad)
    from evals.fewshot import FewshotOptions

    with pytest.raises(ValueError, match=r"unknown option\(s\) \['shot'\]"):
        parse_options(FewshotOptions, {"shot": [1]}, "fewshot")


def test_register_evaluator(monkeypatch):
    monkeypatch.setitem(EVALUATORS, "constant", None)

    @register_evaluator("constant")
    def constant(ctx, options):
        return EvalOutput(metrics={"constant/value": float(options["value"])})

    assert get_evaluator("constant") is constant
    assert get_evaluator("constant")(None, {"value": 3}).metrics == {"constant/value": 3.0}
    assert callable(get_evaluator("fewshot"))  # lazy "module:function" entries resolve on first use
    with pytest.raises(ValueError, match="unknown evaluator type 'zzz'"):
        get_evaluator("zzz")
