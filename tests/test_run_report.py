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
    assert "Took 3.5 s." in report
    assert "## train" in report and "| steps | 12 |" in report and "| train_tokens_per_s | 1234.500 |" in report
    assert "epochs" not in report  # lists stay in the markers
    assert "Held-out metrics" not in report  # no held-out rows: nothing to say of them


def test_held_out_metrics_say_what_they_count(tmp_path):
    """The simulated accept length counts the positions whose token is in the draft vocab
    (docs/contract.md §4): the report says how many of the held-out loss tokens that is."""
    from specforge.utils.metrics_log import write_metrics

    layout = RunLayout(tmp_path)
    write_json(layout.marker("data"), {"fingerprint": "x", "summary": {
        "vocab": {"draft_vocab_size": 64, "vocab_size": 512, "coverage": {"train": 0.981, "eval": 0.9}}}})
    write_metrics(layout.metrics, [{"split": "eval", "epoch": 1, "sim_accept_length": 2.5, "acc_0": 0.7, "acc_1": 0.5}])
    report = write_run_report(tmp_path).read_text()
    assert "| 1 | 2.500 | 0.700 | 0.500 |" in report
    assert ("These count only the positions whose next token is in the draft vocab (90.0% of the held-out loss "
            "tokens)") in report


def test_serve_it_says_when_the_evaluations_fastest_was_no_faster_than_the_base(tmp_path):
    """eval/ship.json records the chosen configuration's speed-up: under 1 the command stays (the
    serving hardware may differ) but the report says the evaluation measured no gain."""
    layout = RunLayout(tmp_path)
    layout.config.write_text("target:\n  path: /models/target\n")
    write_json(layout.eval_choice, {"epoch": 2, "tree": "12_8_64", "speedup": 0.89, "chain": None})
    serve = write_run_report(tmp_path).read_text().split("## Serve it")[1]
    assert ("`epoch_2` with tree `12_8_64`, the evaluation's fastest, though it was no faster than the base "
            "model there (0.89x): measure it on the serving hardware before turning it on") in serve
    assert f"--speculative-draft-model-path {tmp_path / 'epoch_2'}" in serve
    write_json(layout.eval_choice, {"epoch": 2, "tree": "5_1_6", "speedup": 1.8, "chain": None})
    assert "`epoch_2` with tree `5_1_6`, the evaluation's choice" in write_run_report(tmp_path).read_text()


def test_extract_and_train_are_said_in_sentences_with_their_units(tmp_path):
    """What went through the target and what the store takes; steps, time, batch, what was skipped,
    why training stopped, and the memory probe's line. Fields no sentence covers stay in a table."""
    layout = RunLayout(tmp_path)
    write_json(layout.marker("extract"), {"fingerprint": "x", "summary": {
        "splits": {}, "backend": "embedded", "aux_layer_ids": [1, 14, 26], "tokens": 130288,
        "extracted_tokens": 100288, "forward_seconds": 55.17, "tokens_per_s": 1817.9, "bytes_per_token": 4613.2,
        "shards": 4, "seconds": 57.68}})
    write_json(layout.marker("train"), {"fingerprint": "y", "summary": {
        "epochs": [{"epoch": 1}, {"epoch": 2}], "steps": 1450, "skipped_steps": 2, "seconds": 162.4,
        "train_tokens_per_s": 4592.9, "world_size": 2, "global_batch": 16, "strategy": "ddp",
        "stopped_early": "held-out sim accept length has not beaten 3.1000 by more than 0.0 for 1 epoch(s)",
        "memory_probe": "8 samples of up to 2048 tokens (16384 padded): peak 31.2 GiB of 139.8 GiB on cuda:0",
        "something_new": 7}})
    report = write_run_report(tmp_path).read_text()
    assert ("130,288 tokens (30,000 of them from an earlier run) through the target (backend embedded, aux layers "
            "[1, 14, 26]): 55.2 s of forwards, 1,818 tok/s, 57.7 s in all. The store takes 0.60 GB in 4 shards "
            "(4,613 bytes per token).") in report
    assert ("1,450 optimizer steps over 2 epochs in 162.4 s, 4,593 tokens/s, 2 skipped (an inf/nan gradient norm); "
            "global batch 16 (2 processes, strategy ddp). Stopped early: held-out sim accept length has not beaten "
            "3.1000 by more than 0.0 for 1 epoch(s). Memory probe, the heaviest micro-batch before the first step: "
            "8 samples of up to 2048 tokens (16384 padded): peak 31.2 GiB of 139.8 GiB on cuda:0.") in report
    assert "| something_new | 7 |" in report and "| steps |" not in report and "| bytes_per_token |" not in report
    write_json(layout.marker("extract"), {"fingerprint": "x", "summary": {
        "backend": "online", "aux_layer_ids": [1, 14, 26], "splits": {}, "tokens": 130288, "stored_bytes": 0,
        "seconds": 1.2}})
    assert ("`extract=online`: nothing stored; 130,288 tokens checked against the target's vocab, their hidden "
            "states computed by the train stage.") in write_run_report(tmp_path).read_text()


def test_the_serve_commands_give_the_servers_the_runs_image_pixel_bounds(tmp_path):
    """data.image_min/max_pixels resize every image the draft trained on; SGLang and vLLM started without them
    resize with the target's own bounds (Qwen3-VL-2B: a 224 x 224 weather widget, 196 image tokens in
    training, 64 served), so other image tokens, features and positions reach the draft."""
    from omegaconf import OmegaConf

    from specforge.eval.server_eval import sglang_command_builder

    layout = RunLayout(tmp_path)
    cfg = {"target": {"path": "/models/vl", "dtype": "bfloat16", "trust_remote_code": False},
           "data": {"image_min_pixels": 200704, "image_max_pixels": 1003520}}
    layout.config.write_text(OmegaConf.to_yaml(cfg))
    write_json(layout.eval_choice, {"epoch": 1, "tree": "3_1_4", "speedup": 1.5,
                                    "chain": {"tree": "3_1_4", "accept_length": 2.5, "speedup": 1.5}})
    serve = write_run_report(tmp_path).read_text().split("## Serve it")[1]
    bounds = '{"min_pixels": 200704, "max_pixels": 1003520}'
    assert f"--mm-process-config '{{\"image\": {bounds}}}'" in serve  # SGLang hands it to the image processor
    assert f"--mm-processor-kwargs '{bounds}'" in serve  # vLLM's
    run_cfg = OmegaConf.create(cfg)
    launch = sglang_command_builder(run_cfg, OmegaConf.create({"sglang_version": "0.5.23"}))("/models/vl", None, None, 1)
    assert launch[launch.index("--mm-process-config") + 1] == f'{{"image": {bounds}}}'
    run_cfg.data = {"image_min_pixels": None, "image_max_pixels": None}  # the target's own: nothing to pass
    assert "--mm-process-config" not in sglang_command_builder(run_cfg, OmegaConf.create({"sglang_version": "0.5.23"}))(
        "/m", None, None, 1)
