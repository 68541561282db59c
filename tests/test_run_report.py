"""The run's report.md: what each stage recorded, in tables a person reads."""
from specforge.run_layout import RunLayout
from specforge.run_report import write_run_report
from specforge.utils.io import write_json


def test_the_report_accounts_for_every_input_row_and_shows_each_stages_summary(tmp_path):
    layout = RunLayout(tmp_path)
    split = {"input_rows": 10, "kept": 6, "fixed": 2, "quarantined": 2, "truncated": 1, "tokens": 900,
             "loss_tokens": 400, "by_reason": {"empty_answer": 1, "bad_role": 1},
             "regenerate": {"asked": 8, "regenerated": 7, "failed": 1, "tokens_per_s": 50.0}}
    write_json(layout.marker("data"), {"fingerprint": "x", "summary": {
        "train": split, "eval": {**split, "by_reason": {}, "regenerate": None},
        "vocab": {"draft_vocab_size": 64, "vocab_size": 512, "coverage": {"train": 0.981, "eval": 0.9}},
        "seconds": 3.5}})
    write_json(layout.marker("train"), {"fingerprint": "y", "summary": {
        "epochs": [{"epoch": 1}], "steps": 12, "train_tokens_per_s": 1234.5, "seconds": 9.0}})
    report = write_run_report(tmp_path).read_text()
    assert "| train | 10 | 6 | 2 | 2 | 1 | 900 | 400 | 7 of 8 (1 failed, 50.0 tok/s) |" in report
    assert "| eval | 10 | 6 | 2 | 2 | 1 | 900 | 400 | - |" in report
    assert "Quarantined, by reason: train: bad_role 1; train: empty_answer 1" in report
    assert "Draft vocab: 64 of the target's 512 tokens; it covers the loss tokens of eval 90.0%, train 98.1%." in report
    assert "| seconds | 3.500 |" in report
    assert "## train" in report and "| steps | 12 |" in report and "| train_tokens_per_s | 1234.500 |" in report
    assert "epochs" not in report  # lists stay in the markers
