"""Synthetic weather assistant: users ask for a city's weather on a date, the assistant answers
with a TOON document (schema fixed by the system prompt).

Structured, repetitive answers are what a draft head can learn quickly, so this is the demo and
test dataset. Everything is derived from the seed: the same (seed, split, n) gives the same
rows. The forecast of a (city, date) depends only on the seed, so follow-ups and repeated
questions stay consistent. Train and eval never share a (city, date) pair: eval uses held-out
cities and held-out dates.

    python data_prep/weather.py --out data/weather --train 2000 --eval 200 --seed 0

With `--images F` a fraction F of the conversations (chosen from the seed, per conversation)
also shows the user's weather widget: a small PNG drawn with Pillow (city, date, an icon for the
day's main sky, min..max temperature and the strongest wind) from the same forecast the TOON
answer states, so the image really carries the answer. About one in five of those shows two
widgets, the asked day and an adjacent day of the same split (multi-image samples). The text of
the conversations is the same with or without images; only the first user turn changes, into
OpenAI-style parts with paths relative to the data file's folder:

    {"role": "user", "content": [{"type": "image", "image": "images/train/<id>.png"},
                                 {"type": "text", "text": "What's the weather in Oslo on ...?"}]}

(`--format sharegpt` writes LLaVA-style rows instead: a top-level "images" list and `<image>`
placeholders.) PNGs go to <out>/images/<split>/ and are byte-identical for a seed: no
timestamps, Pillow's built-in bitmap font, no system fonts.

    python data_prep/weather.py --out data/weather_vl --train 2000 --eval 200 --seed 0 --images 0.5

Corruption (`--corrupt`, data_prep/corrupt.py) is applied to rows after `to_row`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

import toon_format
from PIL import Image, ImageDraw, ImageFont

from specforge.utils.io import write_jsonl

# name, country, mean annual temperature (C), seasonal amplitude (C), southern hemisphere, wetness 0..1
CITIES = [
    ("Paris", "France", 12.5, 8.0, False, 0.45),
    ("Oslo", "Norway", 6.0, 10.5, False, 0.5),
    ("Lima", "Peru", 19.5, 3.5, True, 0.05),
    ("Tokyo", "Japan", 16.0, 10.0, False, 0.5),
    ("Cairo", "Egypt", 22.5, 7.0, False, 0.03),
    ("Quito", "Ecuador", 14.0, 0.8, True, 0.55),
    ("Perth", "Australia", 18.5, 5.5, True, 0.3),
    ("Bern", "Switzerland", 9.0, 9.0, False, 0.5),
    ("Madrid", "Spain", 15.0, 9.5, False, 0.25),
    ("Dublin", "Ireland", 10.0, 5.0, False, 0.65),
    ("Berlin", "Germany", 10.0, 9.5, False, 0.45),
    ("Rome", "Italy", 15.5, 8.5, False, 0.35),
    ("Athens", "Greece", 18.5, 8.5, False, 0.2),
    ("Moscow", "Russia", 5.8, 13.0, False, 0.45),
    ("Nairobi", "Kenya", 18.0, 1.5, True, 0.35),
    ("Mumbai", "India", 27.0, 2.5, False, 0.4),
    ("Bangkok", "Thailand", 28.5, 1.8, False, 0.45),
    ("Seoul", "South Korea", 12.5, 14.0, False, 0.4),
    ("Sydney", "Australia", 18.0, 4.5, True, 0.4),
    ("Toronto", "Canada", 8.5, 13.0, False, 0.45),
    ("Chicago", "United States", 10.0, 13.5, False, 0.4),
    ("Denver", "United States", 10.5, 11.0, False, 0.25),
    ("Mexico City", "Mexico", 16.5, 3.0, False, 0.35),
    ("Bogota", "Colombia", 14.0, 0.7, False, 0.6),
    ("Santiago", "Chile", 14.5, 6.5, True, 0.15),
    ("Cape Town", "South Africa", 17.0, 4.5, True, 0.3),
    # held out: only ever in eval
    ("Lisbon", "Portugal", 17.5, 5.5, False, 0.3),
    ("Vienna", "Austria", 11.0, 10.0, False, 0.4),
    ("Hanoi", "Vietnam", 24.0, 6.0, False, 0.5),
    ("Auckland", "New Zealand", 15.5, 4.0, True, 0.5),
]
CITY_INFO = {c[0]: c for c in CITIES}
EVAL_CITIES = frozenset({"Lisbon", "Vienna", "Hanoi", "Auckland"})
FIRST_DATE = dt.date(2025, 1, 1)
LAST_DATE = dt.date(2026, 12, 31)
HOURS = (0, 6, 12, 18)

SYSTEM_PROMPT = (
    "You are a weather assistant. Reply with only a TOON document:\n"
    "city: <name>\ncountry: <name>\ndate: <YYYY-MM-DD>\nsummary: <sentence>\n"
    "temp_c: {min,max}\n"
    f"hourly[{len(HOURS)}]{{time,temp_c,sky,wind_kmh,precip_mm}}: every {24 // len(HOURS)} hours"
)

QUESTIONS = [
    "What's the weather in {city} on {date}?",
    "What will the weather be like in {city} on {date}?",
    "Can you give me the forecast for {city}, {date}?",
    "weather {city} {date}",
    "I'm travelling to {city} on {date}. What weather should I expect?",
    "How hot will it be in {city} on {date}?",
    "Forecast for {city} ({country}) on {date}, please.",
    "Do I need an umbrella in {city} on {date}?",
    "Tell me the weather for {date} in {city}.",
    "Is it going to be windy in {city} on {date}?",
]
NEXT_DAY = ["And the next day?", "What about the day after?", "How about the following day?"]
OTHER_CITY = ["And in {city}?", "How about {city} on the same day?", "What about {city}?"]
OTHER_DATE = ["What about {date}?", "And on {date}?", "Same city, {date}?"]
DATE_STYLES = ("iso", "long", "day_month", "weekday")
SKY_WORDS = {"sunny": "Sunny", "clear": "Clear skies", "partly cloudy": "Partly cloudy", "cloudy": "Overcast",
             "fog": "Foggy", "rain": "Rainy", "snow": "Snowy", "thunderstorm": "Stormy"}


@dataclass
class Sample:
    """One generated conversation and the objects its assistant turns encode."""

    id: str
    messages: list[dict]
    answers: list[dict] = field(default_factory=list)  # one weather object per assistant turn
    # the widgets its messages show, in order: {"path": relative to the data file, "forecast": object drawn}
    images: list[dict] = field(default_factory=list)


def is_eval_pair(city: str, date: dt.date) -> bool:
    """Held-out (city, date) pairs: eval-only cities, and every 7th day for the other cities."""
    return city in EVAL_CITIES or date.toordinal() % 7 == 3


def format_date(date: dt.date, style: str) -> str:
    if style == "iso":
        return date.isoformat()
    if style == "long":
        return f"{date:%B} {date.day}, {date.year}"
    if style == "day_month":
        return f"{date.day} {date:%B} {date.year}"
    return f"{date:%A}, {date:%B} {date.day}, {date.year}"


def _sky(rng: random.Random, wet: float, temp: float) -> tuple[str, float]:
    """(sky, precipitation mm) for one time slot."""
    r = rng.random()
    if r < wet * 0.35:
        heavy = rng.random() < 0.25
        mm = round(rng.uniform(2.0, 8.0) if heavy else rng.uniform(0.2, 2.0), 1)
        if temp <= 0.5:
            return "snow", mm
        return ("thunderstorm" if heavy and temp > 18 else "rain"), mm
    if r < wet * 0.55:
        return "fog" if temp < 12 and rng.random() < 0.4 else "cloudy", 0.0
    if r < 0.35 + wet * 0.4:
        return "partly cloudy", 0.0
    return ("clear" if rng.random() < 0.5 else "sunny"), 0.0


def forecast(city: str, date: dt.date, seed: int = 0) -> dict:
    """The weather object of (city, date); depends only on the seed, not on who asks."""
    name, country, mean, amp, south, wet = CITY_INFO[city]
    rng = random.Random(f"forecast:{seed}:{city}:{date.isoformat()}")
    season = math.cos(2 * math.pi * (date.timetuple().tm_yday - 200) / 365.25)
    day_mean = mean + (-amp if south else amp) * season + rng.gauss(0, 2.0)
    swing = rng.uniform(3.0, 7.0) * (1.0 - 0.5 * wet)
    wind_base = rng.uniform(4, 22)
    wet_today = min(0.95, max(0.0, wet + rng.uniform(-0.3, 0.3)))
    hourly = []
    for hour in HOURS:
        temp = day_mean + swing * math.cos(2 * math.pi * (hour - 15) / 24)
        sky, mm = _sky(rng, wet_today, temp)
        wind = max(0, round(wind_base + rng.gauss(0, 4) + (8 if sky == "thunderstorm" else 0)))
        hourly.append({"time": f"{hour:02d}:00", "temp_c": round(temp), "sky": sky,
                       "wind_kmh": wind, "precip_mm": mm})
    return {
        "city": name,
        "country": country,
        "date": date.isoformat(),
        "summary": _summary(hourly),
        "temp_c": {"min": min(h["temp_c"] for h in hourly), "max": max(h["temp_c"] for h in hourly)},
        "hourly": hourly,
    }


def _main_sky(hourly: list[dict]) -> str:
    skies = [h["sky"] for h in hourly]
    return max(sorted(set(skies)), key=skies.count)


def _summary(hourly: list[dict]) -> str:
    main = _main_sky(hourly)
    total = round(sum(h["precip_mm"] for h in hourly), 1)
    wind = max(h["wind_kmh"] for h in hourly)
    parts = [SKY_WORDS[main]]
    parts.append(f"{total} mm of precipitation" if total > 0 else "dry")
    if wind >= 30:
        parts.append(f"gusts up to {wind} km/h")
    return "; ".join(parts) + "."


def _random_date(rng: random.Random) -> dt.date:
    return FIRST_DATE + dt.timedelta(days=rng.randrange((LAST_DATE - FIRST_DATE).days + 1))


def _conversation(rng: random.Random, split: str, seed: int, multi_turn: float) -> tuple[list[dict], list[dict]] | None:
    """Messages and answers of one conversation, or None when a (city, date) falls outside the split."""
    cities = [c[0] for c in CITIES]
    city, date = rng.choice(cities), _random_date(rng)
    style = rng.choice(DATE_STYLES)
    question = rng.choice(QUESTIONS).format(city=city, country=CITY_INFO[city][1], date=format_date(date, style))
    asks = [(question, city, date)]
    if rng.random() < multi_turn:
        kind = rng.randrange(3)
        if kind == 0:
            asks.append((rng.choice(NEXT_DAY), city, date + dt.timedelta(days=1)))
        elif kind == 1:
            other = rng.choice([c for c in cities if c != city])
            asks.append((rng.choice(OTHER_CITY).format(city=other), other, date))
        else:
            other_date = _random_date(rng)
            asks.append((rng.choice(OTHER_DATE).format(date=format_date(other_date, style)), city, other_date))
    if any(is_eval_pair(c, d) != (split == "eval") or not FIRST_DATE <= d <= LAST_DATE for _, c, d in asks):
        return None
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    answers = []
    for text, c, d in asks:
        answer = forecast(c, d, seed)
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": toon_format.encode(answer)})
        answers.append(answer)
    return messages, answers


# --------------------------------------------------------------------------------------------
# Images: a weather widget drawn from a forecast object
# --------------------------------------------------------------------------------------------

TWO_IMAGES = 0.2  # share of the image conversations that show two widgets
MIN_IMAGE_SIZE = 96  # the widest line ("wind 100 km/h") still fits
SKY_COLOURS = {"sunny": (122, 190, 240), "clear": (110, 170, 235), "partly cloudy": (150, 190, 225),
               "cloudy": (165, 172, 182), "fog": (196, 198, 200), "rain": (100, 118, 140),
               "snow": (214, 226, 240), "thunderstorm": (70, 74, 96)}
SUN, CLOUD, DARK_CLOUD = (255, 205, 40), (245, 246, 248), (120, 124, 134)
INK, LIGHT_INK = (20, 24, 32), (250, 250, 250)  # text on light / dark skies


def widget_facts(answer: dict) -> dict:
    """What a widget shows, all taken from the forecast object the TOON answer encodes."""
    return {
        "city": answer["city"],
        "date": answer["date"],
        "sky": _main_sky(answer["hourly"]),
        "temp_min": answer["temp_c"]["min"],
        "temp_max": answer["temp_c"]["max"],
        "wind_kmh": max(h["wind_kmh"] for h in answer["hourly"]),
    }


def widget_lines(answer: dict) -> list[str]:
    """The text lines drawn on the widget, top to bottom."""
    f = widget_facts(answer)
    return [f["city"], f["date"], f"{f['temp_min']}..{f['temp_max']} °C", f"wind {f['wind_kmh']} km/h"]


def _font() -> ImageFont.ImageFont:
    # Pillow's built-in bitmap font: the same glyphs everywhere (no FreeType, no system fonts).
    return getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)()


def _draw_text(img: Image.Image, xy: tuple[int, int], text: str, scale: int, ink: tuple) -> None:
    """Bitmap text enlarged `scale` times (nearest neighbour, so it stays crisp), clipped at the edge."""
    font = _font()
    _, _, w, h = font.getbbox(text)
    mask = Image.new("L", (max(1, w), max(1, h)), 0)
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=font)
    if scale > 1:
        mask = mask.resize((mask.width * scale, mask.height * scale), Image.NEAREST)
    img.paste(ink, (xy[0], xy[1], xy[0] + mask.width, xy[1] + mask.height), mask)


def _cloud(d: ImageDraw.ImageDraw, cx: int, cy: int, r: int, fill: tuple) -> None:
    d.ellipse((cx - r, cy - r // 2, cx, cy + r // 2), fill=fill)
    d.ellipse((cx - r // 2, cy - r, cx + r // 2, cy + r // 3), fill=fill)
    d.ellipse((cx, cy - r // 2, cx + r, cy + r // 2), fill=fill)
    d.rectangle((cx - r // 2, cy - r // 6, cx + r // 2, cy + r // 2), fill=fill)


def _sun(d: ImageDraw.ImageDraw, cx: int, cy: int, r: int) -> None:
    for k in range(8):
        a = 2 * math.pi * k / 8
        d.line((round(cx + 1.2 * r * math.cos(a)), round(cy + 1.2 * r * math.sin(a)),
                round(cx + 1.6 * r * math.cos(a)), round(cy + 1.6 * r * math.sin(a))),
               fill=SUN, width=max(1, r // 6))
    d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=SUN)


def _icon(d: ImageDraw.ImageDraw, sky: str, cx: int, cy: int, r: int) -> None:
    """The day's main sky drawn with shapes."""
    if sky in ("sunny", "clear"):
        _sun(d, cx, cy, r * 2 // 3)
    elif sky == "partly cloudy":
        _sun(d, cx + r // 3, cy - r // 3, r // 2)
        _cloud(d, cx - r // 6, cy + r // 4, r * 3 // 4, CLOUD)
    elif sky == "fog":
        for k in range(-2, 3):
            y = cy + k * r // 3
            d.line((cx - r + abs(k) * r // 5, y, cx + r - abs(k) * r // 5, y), fill=CLOUD, width=max(2, r // 7))
    else:
        dark = sky in ("rain", "thunderstorm")
        _cloud(d, cx, cy - r // 4, r * 3 // 4, DARK_CLOUD if dark else CLOUD)
        if sky == "rain":
            for k in (-1, 0, 1):
                x = cx + k * r // 2
                d.line((x, cy + r // 3, x - r // 6, cy + r * 5 // 6), fill=(60, 120, 230), width=max(2, r // 10))
        elif sky == "snow":
            for k in (-1, 0, 1):
                x, y, s = cx + k * r // 2, cy + r * 2 // 3, max(2, r // 8)
                d.ellipse((x - s, y - s, x + s, y + s), fill=(255, 255, 255), outline=(150, 170, 200))
        elif sky == "thunderstorm":
            x, y = cx, cy + r // 4
            d.polygon([(x, y), (x - r // 4, y + r // 2), (x, y + r // 2), (x - r // 6, y + r),
                       (x + r // 4, y + r * 2 // 5), (x, y + r * 2 // 5), (x + r // 6, y)], fill=SUN)


def render_widget(answer: dict, size: int = 224) -> Image.Image:
    """A `size` x `size` weather widget of one forecast object (see `widget_lines`)."""
    if size < MIN_IMAGE_SIZE:
        raise ValueError(f"image size: must be >= {MIN_IMAGE_SIZE}, got {size}")
    facts = widget_facts(answer)
    background = SKY_COLOURS[facts["sky"]]
    ink = LIGHT_INK if sum(background) < 3 * 128 else INK
    img = Image.new("RGB", (size, size), background)
    d = ImageDraw.Draw(img)
    scale = max(1, size // 100)
    line_h, pad = 12 * scale, max(3, size // 28)
    city, date, temp, wind = widget_lines(answer)
    _draw_text(img, (pad, pad), city, scale, ink)
    _draw_text(img, (pad, pad + line_h + scale), date, scale, ink)
    top, bottom = pad + 2 * line_h + 2 * scale, size - pad - 2 * line_h - 2 * scale
    r = max(6, min(size // 2 - pad, (bottom - top) // 2) * 4 // 5)
    _icon(d, facts["sky"], size // 2, (top + bottom) // 2, r)
    _draw_text(img, (pad, bottom + scale), temp, scale, ink)
    _draw_text(img, (pad, bottom + line_h + 2 * scale), wind, scale, ink)
    return img


def widget_png(answer: dict, size: int = 224) -> bytes:
    """The widget as PNG bytes: no metadata chunks (no time stamp), so equal inputs give equal bytes."""
    buf = io.BytesIO()
    render_widget(answer, size).save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _widget_dates(rng: random.Random, city: str, date: dt.date, split: str) -> list[dt.date]:
    """The asked day, and for some conversations an adjacent day of the same split too, in date
    order (never a day of the other split: an eval forecast must not show up in train)."""
    days = [date]
    if rng.random() < TWO_IMAGES:
        for other in (date + dt.timedelta(days=1), date - dt.timedelta(days=1)):
            if FIRST_DATE <= other <= LAST_DATE and is_eval_pair(city, other) == (split == "eval"):
                days = sorted([date, other])
                break
    return days


def _add_images(sample: Sample, seed: int, split: str, fraction: float) -> None:
    """Maybe give the sample's first user turn its widget(s); an own RNG per sample, so the
    conversations (and which ones get images) do not depend on n or on the fraction's neighbours."""
    rng = random.Random(f"images:{seed}:{sample.id}")
    if not rng.random() < fraction:
        return
    first = sample.answers[0]
    city, date = first["city"], dt.date.fromisoformat(first["date"])
    days = _widget_dates(rng, city, date, split)
    for k, day in enumerate(days):
        name = f"{sample.id}.png" if k == 0 else f"{sample.id}-{k + 1}.png"
        sample.images.append({"path": f"images/{split}/{name}", "forecast": forecast(city, day, seed)})
    user = sample.messages[1]
    user["content"] = [{"type": "image", "image": im["path"]} for im in sample.images] + [
        {"type": "text", "text": user["content"]}]


def write_images(samples: list[Sample], out: str | Path, size: int = 224) -> int:
    """Draw every sample's widgets under `out` (the data file's folder); returns how many."""
    n = 0
    for s in samples:
        for im in s.images:
            path = Path(out) / im["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(widget_png(im["forecast"], size))
            n += 1
    return n


# --------------------------------------------------------------------------------------------
# Conversations and rows
# --------------------------------------------------------------------------------------------


def generate_samples(n: int, seed: int = 0, split: str = "train", multi_turn: float = 0.2,
                     images: float = 0.0) -> list[Sample]:
    """`n` distinct conversations of `split` ("train" or "eval"); deterministic in (n, seed, split).
    `images`: the fraction whose first user turn shows weather widget(s) (see `write_images`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split: {split!r} must be 'train' or 'eval'")
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not 0.0 <= images <= 1.0:
        raise ValueError(f"images: a fraction in [0, 1], got {images}")
    rng = random.Random(f"questions:{seed}:{split}")
    samples: list[Sample] = []
    seen: set[str] = set()
    attempts = 0
    while len(samples) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct {split} conversations; ask for fewer")
        conv = _conversation(rng, split, seed, multi_turn)
        if conv is None:
            continue
        messages, answers = conv
        key = json.dumps(messages[1:], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        sample = Sample(f"weather-{split}-{seed}-{len(samples):06d}", messages, answers)
        if images > 0:
            _add_images(sample, seed, split, images)
        samples.append(sample)
    return samples


def to_row(sample: Sample, fmt: str = "messages") -> dict:
    """An OpenAI `messages` row or a ShareGPT `conversations` row (images LLaVA-style: a
    top-level "images" list and an `<image>` line per image where the image part was)."""
    if fmt == "messages":
        return {"id": sample.id, "messages": sample.messages}
    if fmt == "sharegpt":
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        row = {"id": sample.id,
               "conversations": [{"from": names[m["role"]], "value": _sharegpt_value(m["content"])}
                                 for m in sample.messages]}
        if sample.images:
            row["images"] = [im["path"] for im in sample.images]
        return row
    raise ValueError(f"format: {fmt!r} must be 'messages' or 'sharegpt'")


def _sharegpt_value(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join("<image>" if p["type"] == "image" else p["text"] for p in content)


def generate(n: int, seed: int = 0, split: str = "train", fmt: str = "messages", multi_turn: float = 0.2,
             images: float = 0.0) -> list[dict]:
    """Rows ready to write as JSONL (the widgets they name are drawn by `write_images`)."""
    return [to_row(s, fmt) for s in generate_samples(n, seed, split, multi_turn, images)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/weather", help="output directory (train.jsonl, eval.jsonl)")
    p.add_argument("--train", type=int, default=2000, help="number of training conversations")
    p.add_argument("--eval", type=int, default=200, help="number of held-out conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=["messages", "sharegpt"], default="messages")
    p.add_argument("--multi-turn", type=float, default=0.2, help="fraction with a follow-up question")
    p.add_argument("--corrupt", type=float, default=0.0,
                   help="break this fraction of train rows per kind of breakage (data_prep/corrupt.py); "
                        "the exact expected fix report goes to train.jsonl.expected.json")
    p.add_argument("--images", type=float, default=0.0,
                   help="fraction of conversations whose user turn shows a weather widget PNG "
                        "(written under <out>/images/<split>/)")
    p.add_argument("--image-size", type=int, default=224, help=f"widget width = height in pixels (>= {MIN_IMAGE_SIZE})")
    args = p.parse_args(argv)
    for flag, n in (("--train", args.train), ("--eval", args.eval)):
        if n < 0:
            p.error(f"{flag}: a number of conversations, >= 0, got {n}")
    if not 0.0 <= args.multi_turn <= 1.0:
        p.error(f"--multi-turn: a fraction in [0, 1], got {args.multi_turn}")
    if args.corrupt and args.format != "messages":
        p.error("--corrupt works on --format messages rows")
    if not 0.0 <= args.images <= 1.0:
        p.error(f"--images: a fraction in [0, 1], got {args.images}")
    if args.image_size < MIN_IMAGE_SIZE:
        p.error(f"--image-size: must be >= {MIN_IMAGE_SIZE}, got {args.image_size}")
    out = Path(args.out)
    for split, n in (("train", args.train), ("eval", args.eval)):
        if n == 0:  # no file (an earlier one removed) rather than an empty one, which the data stage refuses
            (out / f"{split}.jsonl").unlink(missing_ok=True)
            print(f"no {split} conversations asked for: no {out / f'{split}.jsonl'} (data.{split}_files=[])")
            continue
        samples = generate_samples(n, args.seed, split, args.multi_turn, args.images)
        rows = [to_row(s, args.format) for s in samples]
        path = out / f"{split}.jsonl"
        if args.images > 0:
            print(f"drew {write_images(samples, out, args.image_size)} {split} widgets under {out / 'images' / split}")
        if split == "train" and args.corrupt > 0:
            sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script
            from corrupt import OUTCOMES, corrupt, write_jsonl_lines

            from specforge.utils.io import write_json

            rows, expected = corrupt(rows, {name: args.corrupt for name in OUTCOMES}, args.seed)
            write_jsonl_lines(path, rows)
            write_json(f"{path}.expected.json", expected)
            print(f"corrupted train: {expected['fixed']} rows to fix, {expected['quarantined']} to quarantine")
        else:
            write_jsonl(path, rows)
        print(f"wrote {len(rows)} {split} conversations to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
