"""Write a tiny image+text dataset for vision-language SFT: coloured shapes on small PNGs (Pillow) and questions
about them, in three record forms fsdp2kit reads, with some text-only records among them.

    python examples/make_vl_dataset.py data/vl
    # -> data/vl/train.jsonl (transformers' chat form), llava.jsonl (LLaVA/ShareGPT), llamafactory.json (LLaMA-Factory's
    #    multimodal form: `<image>` in the turns' text and an `images` list, a JSON array as its files are), images/
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle")
FACTS = [
    ("What is the capital of France?", "Paris."),
    ("How many legs does a spider have?", "Eight."),
    ("What is two plus three?", "Five."),
    ("Name a primary colour.", "Blue."),
]


def draw(path: Path, colour: str, shape: str, size: tuple[int, int]) -> None:
    image = Image.new("RGB", size, (245, 245, 245))
    box = (size[0] // 5, size[1] // 5, size[0] * 4 // 5, size[1] * 4 // 5)
    pen = ImageDraw.Draw(image)
    (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    image.save(path)


def main(out: Path, records: int, seed: int) -> None:
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    chat, llava, llamafactory = [], [], []
    for i in range(records):
        if i % 3 == 2:  # a text-only record
            question, answer = FACTS[i % len(FACTS)]
            chat.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
            llava.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
            llamafactory.append(chat[-1])
            continue
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"images/{i:03d}.png"
        draw(out / name, colour, shape, (rng.choice((28, 56, 84)), rng.choice((28, 56))))
        question, answer = "What is in the picture?", f"A {colour} {shape}."
        chat.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            }
        )
        llava.append(
            {
                "image": name,
                "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}],
            }
        )
        turns = [{"role": "user", "content": f"<image>{question}"}, {"role": "assistant", "content": answer}]
        llamafactory.append({"messages": turns, "images": [name]})
    for file, rows in (("train.jsonl", chat), ("llava.jsonl", llava)):
        (out / file).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "llamafactory.json").write_text(json.dumps(llamafactory, indent=1))
    print(f"wrote {records} records to {out / 'train.jsonl'}, {out / 'llava.jsonl'} and {out / 'llamafactory.json'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.out, args.records, args.seed)
