"""torch_gpt.py -- the GPT of examples/gpt_pipeline.toml in plain single-process PyTorch, as a peer.

Same model as flotilla's `gpt` (token + position embedding; pre-LN layers of causal
self-attention with separate q, k, v projections and a 4x GELU MLP; final LayerNorm and a
bias-free head of its own), same shape (n_layer 4, n_head 4, n_embd 64, block 64, the shipped
text's 78 characters), AdamW lr 3e-3, global batch 32 windows. Tokens are random ids: only
the speed is measured (tokens/s of forward, backward and the optimizer step), so this is the
one-stage baseline the pipeline runs of `benches/gpt_pipeline.sh` compare with.

With --bf16 the forward and the loss run under CPU autocast to bfloat16 (PyTorch's mixed
precision: linear layers and matmuls in bfloat16, f32 parameters and optimizer), the peer of
flotilla's `strategy.amp` with `amp_configs.use_bf16`.

Run: $PY benches/torch_gpt.py --steps 30 --threads 2 [--n-embd 64] [--bf16] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, c: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.q, self.k, self.v, self.proj = (nn.Linear(c, c) for _ in range(4))
        self.fc, self.out = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, c: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, c), nn.Embedding(block, c)
        self.layers = nn.Sequential(*(Layer(c, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(c), nn.Linear(c, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.ln(self.layers(x)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 78
    model = Gpt(vocab, args.block, args.n_layer, 4, args.n_embd)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(vocab, (args.batch, args.block + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def precision():
        if args.bf16:
            return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        with precision():
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - started
    figures = {
        "peer": "pytorch single process",
        "torch": torch.__version__,
        "threads": args.threads,
        "n_embd": args.n_embd,
        "precision": "bf16 autocast" if args.bf16 else "f32",
        "tokens_per_sec": args.steps * args.batch * args.block / elapsed,
    }
    print(json.dumps(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f)


if __name__ == "__main__":
    main()
