"""Weight memory each tensor-parallel rank holds, for a config (default: the released one).

    python benchmarks/parallel_memory.py [--config configs/deepseek_v41_flash.json] [--ranks 1 2 4 8]

Builds the model on the meta device (no memory), shards it as rank 0 and rank N-1 of N would
(`parallel_deepseek_v41_vl.shard_model`, the same code a `tp_plan="auto"` load runs) and adds up
the bytes of every parameter and buffer, by part. Runs on any machine in seconds; the caches and
activations come on top (README, "Tensor and expert parallelism").
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model, model_class_for
from deepseek_v41_vl.modeling.parallel_deepseek_v41_vl import DeepseekV41Shard, shard_model

RELEASED = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v41_flash.json"
GIB = 2**30
PARTS = (  # (label, pattern of the tensor names it counts)
    ("Engram tables", r"\.engram\.embed\."),
    ("routed experts", r"\.ffn\.experts\."),
    ("attention", r"\.attn\."),
    ("head + embedding", r"^model\.(head|embed)\."),
)


def rank_bytes(config: DeepseekV41Config, size: int, rank: int = 0) -> Counter:
    """Bytes rank `rank` of `size` holds, by part of :data:`PARTS` (the rest as "other")."""
    model = empty_model(config, model_class_for(config))
    if size > 1:
        shard_model(model.model, DeepseekV41Shard(rank=rank, size=size))
    held = Counter()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        part = next((label for label, pattern in PARTS if re.search(pattern, name)), "other")
        held[part] += tensor.numel() * tensor.element_size()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=RELEASED)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    config = DeepseekV41Config(**json.loads(args.config.read_text()))
    labels = [label for label, _ in PARTS] + ["other"]
    print("| ranks | GiB per rank (rank 0) | " + " | ".join(labels) + " | GiB on rank N-1 |")
    print("|---" * (len(labels) + 3) + "|")
    for size in args.ranks:
        first, last = rank_bytes(config, size), rank_bytes(config, size, size - 1)
        cells = " | ".join(f"{first[label] / GIB:.1f}" for label in labels)
        print(f"| {size} | {sum(first.values()) / GIB:.1f} | {cells} | {sum(last.values()) / GIB:.1f} |")


if __name__ == "__main__":
    main()
