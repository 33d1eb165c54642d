"""labkit.launch under torchrun: `torchrun --standalone --nproc-per-node 4 docs/torchrun_hello.py`.

Each process torchrun starts is one rank; launch runs `hello` there and every rank gets all
results (rank 0 prints them). The same file runs without torchrun: launch then starts 4 ranks.
"""
import os
import torch
import labkit


def hello(ctx):
    t = torch.ones(4) * (ctx.rank + 1)
    ctx.comm.all_reduce(t)
    return ctx.rank, t[0].item()


if __name__ == "__main__":
    results = labkit.launch(hello, 4)
    if os.environ.get("RANK", "0") == "0":
        print("results by rank:", results, flush=True)
