"""Loads a flotilla model file — `params.safetensors`, or a checkpoint's `replica.safetensors`,
whose optimizer slots are set aside — into the equivalent PyTorch module by name and checks that
its outputs equal those `flotilla predict` wrote for the same rows.

    python load_into_torch.py --params run/params.safetensors --data rows.csv \
        --predictions predictions.csv

Prints the largest difference as JSON; exits 1 when it exceeds --tolerance.
"""

import argparse
import csv
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


class Mlp(torch.nn.Module):
    """flotilla's `mlp`: Linear layers fc0, fc1, ... with ReLU between them."""

    def __init__(self, inputs, hidden, outputs):
        super().__init__()
        widths = [inputs, *hidden, outputs]
        self.depth = len(widths) - 1
        for i in range(self.depth):
            setattr(self, f"fc{i}", torch.nn.Linear(widths[i], widths[i + 1]))

    def forward(self, x):
        for i in range(self.depth):
            x = getattr(self, f"fc{i}")(x)
            if i + 1 < self.depth:
                x = torch.relu(x)
        return x


def read_table(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [name.strip() for name in rows[0]], rows[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--predictions", required=True)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()

    with safe_open(args.params, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "flotilla-model", metadata
    spec = json.loads(metadata["model"])
    assert spec["kind"] == "mlp", spec
    model = Mlp(spec["inputs"], spec["hidden"], spec["outputs"])
    state = load_file(args.params)
    if "optimizer" in metadata:
        # A checkpoint: the training state's slots are no parameters of the module.
        slots = [name for name in state if name.startswith("optimizer.")]
        assert slots, "a checkpoint without optimizer slots"
        state = {name: value for name, value in state.items() if name not in slots}
    # strict: every tensor of the module is in the file under its name, in its shape, and
    # nothing else is.
    model.load_state_dict(state, strict=True)

    header, rows = read_table(args.data)
    columns = json.loads(metadata.get("feature_columns", "null")) or header
    index = [header.index(name) for name in columns]
    x = torch.tensor([[float(row[i]) for i in index] for row in rows], dtype=torch.float32)
    with torch.no_grad():
        ours = model(x)

    header, rows = read_table(args.predictions)
    wanted = [i for i, name in enumerate(header) if name.startswith(("logit_", "prediction"))]
    theirs = torch.tensor([[float(row[i]) for i in wanted] for row in rows], dtype=torch.float32)
    assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
    if "class" in header:
        classes = torch.tensor([int(row[header.index("class")]) for row in rows])
        assert torch.equal(classes, ours.argmax(dim=1)), "the predicted classes differ"
    diff = (theirs - ours).abs().max().item()
    print(json.dumps({"rows": len(rows), "outputs": ours.shape[1], "max_abs_diff": diff}))
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
