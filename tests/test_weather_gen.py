"""The synthetic weather dataset: deterministic, disjoint splits, valid TOON answers."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import toon_format
from PIL import Image

import data_prep.weather as weather
from data_prep.weather import (
    EVAL_CITIES,
    SYSTEM_PROMPT,
    generate,
    generate_samples,
    is_eval_pair,
    main,
    widget_png,
)
from specforge.data.formats import to_conversation


def pairs(samples):
    return {(a["city"], a["date"]) for s in samples for a in s.answers}


def test_deterministic_for_a_seed():
    assert generate(30, seed=3) == generate(30, seed=3)
    assert generate(30, seed=3) != generate(30, seed=4)
    assert generate(10, seed=3) == generate(30, seed=3)[:10]  # a prefix: n does not reshuffle


def test_train_and_eval_are_disjoint():
    train, eval_ = generate_samples(300, seed=0, split="train"), generate_samples(100, seed=0, split="eval")
    assert not pairs(train) & pairs(eval_)
    assert not {s.id for s in train} & {s.id for s in eval_}
    assert all(not is_eval_pair(c, dt.date.fromisoformat(d)) for c, d in pairs(train))
    assert all(is_eval_pair(c, dt.date.fromisoformat(d)) for c, d in pairs(eval_))
    eval_cities = {c for c, _ in pairs(eval_)}
    assert eval_cities & EVAL_CITIES and eval_cities - EVAL_CITIES  # unseen cities and unseen dates
    assert not {c for c, _ in pairs(train)} & EVAL_CITIES


def test_every_answer_decodes_to_its_object():
    for split in ("train", "eval"):
        for s in generate_samples(60, seed=1, split=split):
            answers = [m["content"] for m in s.messages if m["role"] == "assistant"]
            assert len(answers) == len(s.answers) >= 1
            for text, obj in zip(answers, s.answers):
                assert toon_format.decode(text) == obj
                assert text.splitlines()[0] == f"city: {obj['city']}"
                assert f"hourly[{len(obj['hourly'])}]{{time,temp_c,sky,wind_kmh,precip_mm}}:" in text


def test_conversation_shape():
    samples = generate_samples(200, seed=2)
    for s in samples:
        roles = [m["role"] for m in s.messages]
        assert roles[0] == "system" and s.messages[0]["content"] == SYSTEM_PROMPT
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2)
    assert any(len(s.answers) == 2 for s in samples)  # follow-ups exist
    assert len({json.dumps(s.messages) for s in samples}) == len(samples)  # no duplicates


def test_follow_ups_are_consistent_with_the_first_answer():
    for s in generate_samples(200, seed=5):
        if len(s.answers) == 2 and s.messages[3]["content"] in ("And the next day?", "What about the day after?",
                                                               "How about the following day?"):
            first, second = s.answers
            assert second["city"] == first["city"]
            assert dt.date.fromisoformat(second["date"]) - dt.date.fromisoformat(first["date"]) == dt.timedelta(days=1)


def test_sharegpt_rows_parse_to_the_same_conversation():
    for m, sg in zip(generate(20, seed=0), generate(20, seed=0, fmt="sharegpt")):
        assert "conversations" in sg and sg["conversations"][1]["from"] == "human"
        assert to_conversation(sg) == to_conversation(m)


def test_cli_writes_both_splits(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "w"), "--train", "12", "--eval", "5", "--seed", "7"]) == 0
    train = [json.loads(line) for line in (tmp_path / "w" / "train.jsonl").read_text().splitlines()]
    eval_ = [json.loads(line) for line in (tmp_path / "w" / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 12 and len(eval_) == 5
    assert train == generate(12, seed=7, split="train")
    assert "wrote 12 train" in capsys.readouterr().out
    assert not (tmp_path / "w" / "images").exists()  # no --images: text rows only, as before


# --------------------------------------------------------------------------------------------
# --images: weather widgets
# --------------------------------------------------------------------------------------------


def image_parts(row: dict) -> list[str]:
    return [p["image"] for m in row["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image"]


def first_answer(row: dict) -> dict:
    return toon_format.decode(next(m["content"] for m in row["messages"] if m["role"] == "assistant"))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "w"
    assert main(["--out", str(out), "--train", "60", "--eval", "20", "--seed", "2", "--images", "0.5",
                 "--image-size", "128"]) == 0
    return out


def test_images_are_real_pngs_at_the_paths_the_rows_name(vl_dir):
    for split in ("train", "eval"):
        rows = read_rows(vl_dir / f"{split}.jsonl")
        named = [p for row in rows for p in image_parts(row)]
        assert 0 < sum(1 for row in rows if image_parts(row)) < len(rows)  # a fraction of them
        assert all(p.startswith(f"images/{split}/") for p in named)
        assert {f"images/{split}/{p.name}" for p in (vl_dir / "images" / split).iterdir()} == set(named)
        for p in named:
            with Image.open(vl_dir / p) as img:
                assert (img.format, img.size, img.mode) == ("PNG", (128, 128), "RGB")
                img.load()
                assert len(img.getcolors(4096)) >= 3  # background, text and icon: drawn, not blank


def test_user_turn_shape_with_images(vl_dir):
    rows = read_rows(vl_dir / "train.jsonl")
    with_images = [row for row in rows if image_parts(row)]
    for row in with_images:
        user = row["messages"][1]
        assert user["role"] == "user"
        *images, text = user["content"]
        assert images and all(set(p) == {"type", "image"} and p["type"] == "image" for p in images)
        assert text["type"] == "text" and text["text"].strip()
        assert all(isinstance(m["content"], str) for m in row["messages"] if m is not user)
        assert to_conversation(row)["messages"] == row["messages"]
    assert any(len(image_parts(row)) == 2 for row in with_images)  # multi-image samples
    counts = [len(image_parts(row)) for row in with_images]
    assert counts.count(1) > counts.count(2)


def test_same_seed_gives_byte_identical_files(vl_dir, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    for out, seed in ((again, "2"), (other, "3")):
        main(["--out", str(out), "--train", "60", "--eval", "20", "--seed", seed, "--images", "0.5",
              "--image-size", "128"])
    first = all_files(vl_dir)
    assert len(first) > 20 and all_files(again) == first
    differs = all_files(other)
    assert differs.keys() != first.keys() or differs != first


def test_widget_png_has_no_metadata_and_is_stable():
    answer = generate_samples(1, seed=0)[0].answers[0]
    png = widget_png(answer, 96)
    assert png == widget_png(answer, 96) and png != widget_png(answer, 128)
    assert b"tIME" not in png and b"tEXt" not in png and b"iTXt" not in png  # no time stamp, no text chunks


def test_the_image_shows_the_answers_forecast(vl_dir):
    """The PNG on disk is exactly the widget of the forecast the TOON answer states."""
    for split in ("train", "eval"):
        for row in read_rows(vl_dir / f"{split}.jsonl"):
            paths = image_parts(row)
            if not paths:
                continue
            answer = first_answer(row)
            matches = [p for p in paths if (vl_dir / p).read_bytes() == widget_png(answer, 128)]
            assert len(matches) == 1, (row["id"], paths)


def test_drawn_numbers_are_the_answers_numbers(monkeypatch):
    drawn: list[str] = []
    monkeypatch.setattr(weather, "_draw_text", lambda img, xy, text, scale, ink: drawn.append(text))
    samples = [s for s in generate_samples(80, seed=4, images=1.0)]
    assert all(s.images for s in samples)
    for s in samples:
        answer = toon_format.decode(s.messages[2]["content"])  # what the assistant says, decoded
        [im] = [im for im in s.images if im["forecast"]["date"] == answer["date"]]
        drawn.clear()
        weather.render_widget(im["forecast"], 224)
        wind = max(h["wind_kmh"] for h in answer["hourly"])
        assert drawn == [answer["city"], answer["date"], f"{answer['temp_c']['min']}..{answer['temp_c']['max']} °C",
                         f"wind {wind} km/h"]


def test_second_widget_is_an_adjacent_day_of_the_same_split():
    for split in ("train", "eval"):
        samples = generate_samples(200, seed=1, split=split, images=1.0)
        two = [s for s in samples if len(s.images) == 2]
        assert 10 < len(two) < 100  # about one in five
        for s in two:
            a, b = (im["forecast"] for im in s.images)
            assert a["city"] == b["city"] == s.answers[0]["city"]
            assert dt.date.fromisoformat(b["date"]) - dt.date.fromisoformat(a["date"]) == dt.timedelta(days=1)
            assert s.answers[0]["date"] in (a["date"], b["date"])
            assert all(is_eval_pair(im["forecast"]["city"], dt.date.fromisoformat(im["forecast"]["date"]))
                       == (split == "eval") for im in s.images)
            assert [p["image"] for p in s.messages[1]["content"][:2]] == [
                f"images/{split}/{s.id}.png", f"images/{split}/{s.id}-2.png"]


def test_images_do_not_change_the_text_of_the_conversations():
    plain, with_images = generate(80, seed=6), generate(80, seed=6, images=0.5)
    for p, w in zip(plain, with_images):
        assert p["id"] == w["id"]
        texts = [m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"] for m in w["messages"]]
        assert texts == [m["content"] for m in p["messages"]]
    assert generate(10, seed=6, images=0.5) == with_images[:10]


def test_sharegpt_image_rows_are_llava_style_and_parse_the_same():
    for m, sg in zip(generate(60, seed=0, images=0.5), generate(60, seed=0, fmt="sharegpt", images=0.5)):
        paths = image_parts(m)
        assert sg.get("images", []) == paths
        assert sg["conversations"][1]["value"].count("<image>") == len(paths)
        assert to_conversation(sg) == to_conversation(m)


@pytest.mark.parametrize("args, message", [(["--images", "1.5"], "--images"), (["--image-size", "32"], "--image-size")])
def test_bad_image_options_are_rejected(tmp_path, args, message, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--train", "1", "--eval", "1", *args])
    assert message in capsys.readouterr().err
