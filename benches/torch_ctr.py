"""torch_ctr.py -- the CTR job of examples/ctr_ps.toml in plain single-process PyTorch, as a peer.

`--model wide_deep` (default) is the same model as flotilla's wide&deep (one shared embedding table of width 9 over the 26 slots,
deep layers 256-128-64 with ReLU, a width-1 wide table plus a linear layer on the 13 dense
features, sigmoid cross-entropy); `--model deepfm` the same as flotilla's DeepFM (factors of width 9 for
the 26 slots from one table and for the 13 dense features, their FM interactions, a width-1
first-order table plus a linear layer on the dense features, deep layers 400-400-400 on the
39 factors). Adagrad lr 0.05, batch 512, on the same Criteo TSV file
(`flotilla data criteo-synthetic --samples N --out FILE`). Feature ids are mapped to table rows
before timing (rows created on first sight, as parameter servers do), so the timed loop is
embedding lookup, forward, backward and the optimizer step only: a lower bound for any
parameter-server framework, which adds pulls and pushes to the same work.

Run: $PY benches/torch_ctr.py --train FILE --steps 200 --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn as nn

SLOTS, DENSE = 26, 13


def mix64(z: int) -> int:
    """flotilla's feature id: SplitMix64's finaliser of ((slot+1) << 33) | (1 << 32) | value."""
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def load(path: str, rows: int):
    labels, dense, ids = [], [], []
    index: dict[int, int] = {}
    with open(path) as f:
        for n, line in enumerate(f):
            if n == rows:
                break
            cols = line.rstrip("\n").split("\t")
            labels.append(float(cols[0]))
            dense.append([math.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1 : 1 + DENSE]])
            row = []
            for slot, c in enumerate(cols[1 + DENSE :]):
                key = ((slot + 1) << 33) | ((1 << 32) | int(c, 16) if c else 0)
                row.append(index.setdefault(mix64(key), len(index)))
            ids.append(row)
    return torch.tensor(labels), torch.tensor(dense), torch.tensor(ids), len(index)


class WideDeep(nn.Module):
    def __init__(self, vocab: int, dim: int = 9, hidden=(256, 128, 64)):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=True)
        self.wide = nn.Embedding(vocab, 1, sparse=True)
        nn.init.uniform_(self.embedding.weight, -1 / math.sqrt(dim), 1 / math.sqrt(dim))
        nn.init.uniform_(self.wide.weight, -0.01, 0.01)
        layers, width = [], SLOTS * dim + DENSE
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)
        self.wide_dense = nn.Linear(DENSE, 1)

    def forward(self, dense, ids):
        emb = self.embedding(ids).flatten(1)
        deep = self.deep(torch.cat([emb, dense], 1))
        wide = self.wide(ids).sum(1) + self.wide_dense(dense)
        return (deep + wide).squeeze(1)


class DeepFM(nn.Module):
    def __init__(self, vocab: int, dim: int = 9, hidden=(400, 400, 400)):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=True)
        self.first_order = nn.Embedding(vocab, 1, sparse=True)
        nn.init.uniform_(self.embedding.weight, -1 / math.sqrt(dim), 1 / math.sqrt(dim))
        nn.init.uniform_(self.first_order.weight, -0.01, 0.01)
        self.dense_factors = nn.Parameter(torch.empty(DENSE, dim).uniform_(-1 / math.sqrt(dim), 1 / math.sqrt(dim)))
        self.first_order_dense = nn.Linear(DENSE, 1)
        layers, width = [], (SLOTS + DENSE) * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, dense, ids):
        factors = torch.cat([self.embedding(ids), dense.unsqueeze(2) * self.dense_factors], 1)
        fm = 0.5 * (factors.sum(1).pow(2) - factors.pow(2).sum(1)).sum(1, keepdim=True)
        first = self.first_order(ids).sum(1) + self.first_order_dense(dense)
        return (first + fm + self.deep(factors.flatten(1))).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", choices=["wide_deep", "deepfm"], default="wide_deep")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(42)
    labels, dense, ids, vocab = load(a.train, a.steps * a.batch)
    model = WideDeep(vocab) if a.model == "wide_deep" else DeepFM(vocab)
    sparse = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    sparse_ids = {id(p) for p in sparse}
    dense_params = [p for p in model.parameters() if id(p) not in sparse_ids]
    opts = [torch.optim.Adagrad(sparse, lr=0.05), torch.optim.Adagrad(dense_params, lr=0.05)]
    loss_fn = nn.BCEWithLogitsLoss()
    started = time.perf_counter()
    for step in range(a.steps):
        sl = slice(step * a.batch, (step + 1) * a.batch)
        loss = loss_fn(model(dense[sl], ids[sl]), labels[sl])
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    elapsed = time.perf_counter() - started
    out = {"peer": "pytorch-single-process", "model": a.model, "threads": a.threads, "steps": a.steps, "batch": a.batch,
           "samples_per_sec": a.steps * a.batch / elapsed, "final_loss": float(loss.detach())}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
