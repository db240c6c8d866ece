"""BatchDecoder with CUDA graphs against eager batched steps and the batch-1 decoder (float32, GPU)."""

import sys
import time

import torch

from eagle3.common import compose
from eagle3.engine import SpecDecoder
from eagle3.engine.batch import BatchDecoder
from eagle3.engine.service import load_engine_drafter
from eagle3.shipped import shipped_drafter
from eagle3.spec import resolve_spec
from eagle3.target import load_target

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
base = [
    "drafter.path=shipped",
    f"target.dtype={dtype}",
    "target.device=cuda",
    "paths.root=/tmp/e3",
    "tracking.enabled=false",
]
texts = [
    "Explain how a bicycle works.",
    "Write a short poem about the ocean.",
    "What are the main causes of inflation?",
    "Give three tips for learning to code.",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a linked list.",
    "If a train travels 60 miles in 1.5 hours, what is its speed?",
]
cfg = compose(base)
base[0] = f"drafter.path={shipped_drafter(cfg)}"
cfg = compose(base)
target = load_target(cfg)
tok = target.tokenizer
prompts = [
    tok.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
    )
    for t in texts
]
prompts = [
    list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
]
for name in ["off", "d8", "d32s4k8"]:
    spec = resolve_spec(compose(base + [f"spec={name}"]).spec)
    drafter, _ = load_engine_drafter(cfg, target, spec)
    outs, times = {}, {}
    for graphs in (False, True):
        dec = BatchDecoder(
            target,
            drafter,
            spec,
            4,
            max_context=2048,
            cuda_graphs=graphs,
            graph_batch_sizes=(1, 2, 4),
        )
        for rep in range(2):  # the second pass runs on captured graphs
            reqs = [dec.add(p, 96) for p in prompts]
            torch.cuda.synchronize()
            t = time.perf_counter()
            dec.generate_all(reqs)
            torch.cuda.synchronize()
            times[graphs] = time.perf_counter() - t
        outs[graphs] = [r.result.tokens for r in reqs]
        steps = dec.steps
    single = SpecDecoder(target, drafter, spec, max_context=2048, cuda_graphs=True)
    alone = [single.generate(p, 96).tokens for p in prompts]
    same = sum(a == b for a, b in zip(outs[True], outs[False]))
    same1 = sum(a == b for a, b in zip(outs[True], alone))
    print(
        f"{name} {dtype}: graphs==eager {same}/{len(prompts)}, graphs==batch-1 {same1}/{len(prompts)}, "
        f"wall eager {times[False]:.2f} s graphs {times[True]:.2f} s, graph shapes {len(dec.greedy.graphs)}",
        flush=True,
    )
