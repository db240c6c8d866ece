"""Microseconds per masked attention call of a decode step, replayed from a CUDA graph, by backend.

The engine's layout (engine/llama.py): grouped-query heads folded into the query rows, so
queries [1, kv_heads, groups * q, dim], keys/values [1, kv_heads, kv_len, dim] and an additive
bias [groups * q, kv_len]. Sizes default to SmolLM2-135M's (9 heads, 3 kv heads, dim 64):

    python benchmarks/attention_bench.py --q 1,8,32,64 --kv-len 256,512,1024 --json attention.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from topk_bench import replay_us, show, write_rows
from torch.nn.attention import SDPBackend, sdpa_kernel


def explicit(queries, keys, values, bias):
    scores = (queries @ keys.transpose(-1, -2)) * queries.shape[-1] ** -0.5 + bias
    return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values


def with_backend(backend):
    def attend(queries, keys, values, bias):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--q", default="1,8,32,64")
    parser.add_argument("--kv-len", default="256,512,1024")
    parser.add_argument("--replays", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    ways = {
        "cudnn": with_backend(SDPBackend.CUDNN_ATTENTION),
        "efficient": with_backend(SDPBackend.EFFICIENT_ATTENTION),
        "math": with_backend(SDPBackend.MATH),
        "explicit compiled": torch.compile(explicit, dynamic=False),
    }
    groups, rows_out = args.heads // args.kv_heads, []
    for q in (int(v) for v in args.q.split(",")):
        for kv_len in (int(v) for v in args.kv_len.split(",")):
            shape = (1, args.kv_heads, kv_len, args.dim)
            keys, values = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)
            )
            queries = torch.randn(
                1, args.kv_heads, groups * q, args.dim, device="cuda", dtype=torch.bfloat16
            )
            visible = (
                torch.arange(kv_len, device="cuda")[None]
                < kv_len // 2 + torch.arange(groups * q, device="cuda")[:, None] % q
            )
            bias = torch.zeros(visible.shape, dtype=torch.bfloat16, device="cuda").masked_fill(
                ~visible, -3e38
            )
            reference = explicit(queries.float(), keys.float(), values.float(), bias.float())
            row = {"q": q, "kv_len": kv_len}
            for name, fn in ways.items():
                try:
                    out = fn(queries, keys, values, bias)
                    assert torch.allclose(out.float(), reference, atol=3e-2), name
                    row[name] = replay_us(
                        lambda x, _, f=fn, k=keys, v=values, b=bias: f(x, k, v, b),
                        queries,
                        0,
                        args.replays,
                    )
                except RuntimeError as error:  # a backend that refuses these inputs
                    row[name] = str(error).splitlines()[0][:80]
            show(row)
            rows_out.append(row)
    write_rows(rows_out, args.json)


if __name__ == "__main__":
    main()
