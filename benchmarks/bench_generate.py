"""Generation throughput: `slipstream.generate` vs transformers' `generate` (CPU).

Run: `python benchmarks/bench_generate.py` (under 2 minutes on 2 cores) or `--quick`.
The same random SmolLM2-135M-shaped Llama (vocab 49152, hidden 576, MLP 1536, 9 / 3 heads,
tied head; by default 4 of its 30 layers so a run fits 2 minutes, `--layers 30` for the
real depth) in float32, loaded into both; greedy (or `--sampling`: temperature 0.7, top_p 0.9
on both sides), 128 new tokens, no stop token (every row runs to its length, the same work
for both). Batch 1 (one 64-token prompt) and batch 16 (prompts of 16..128 tokens).
- transformers: `generate` with its default cache (DynamicCache) and SDPA attention; the
  batch is left-padded with an attention mask;
- ours: packed prefill (no padding), batched decode over the KV cache, one host sync every
  8 tokens.
Outputs are compared token for token (greedy on the same weights: they must agree).
Timing: a short warm-up (4 tokens) each, then `--reps` runs alternating ours and theirs;
tokens/s from the best run, by wall clock and by the process's CPU time. On a shared machine
the wall clock mostly measures waiting for a core; CPU time (one torch thread) does not, so
the CPU-time ratio is the steadier one. The load average is printed with the table.

Prediction: at batch 1 the per-token cost is the model (~45 M multiply-adds a token at 6
layers, with the 28 M-entry head) plus per-step Python on both sides; transformers' per-step
work (logits processors, stopping criteria, cache objects, its mask building) is heavier, so
>= 1.0x. At batch 16 the matmuls are 16 rows wide and the fixed cost per step is shared;
transformers' padding adds (max - mean) / mean = ~45% more prefill tokens and attention over
padded keys at every step, so the goal is >= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import common
import torch

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)  # fmt: skip
COLUMNS = ["batch", "prompt tokens", "new tokens", "transformers tok/s", "ours tok/s",
           "speedup", "transformers tok/s (CPU time)", "ours tok/s (CPU time)",
           "speedup (CPU time)", "goal", "same tokens"]  # fmt: skip
SAMPLING = dict(temperature=0.7, top_p=0.9)  # --sampling: a typical setting, top_k off


# --tiny: the same prompts and loop on a model whose matmuls cost next to nothing, so the
# per-step overhead of the two loops is what is timed.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)  # fmt: skip


def prompts_for(batch: int, vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if batch == 1:
        return [torch.randint(0, vocab, (64,), generator=g).tolist()]
    lengths = torch.linspace(16, 128, batch).round().long().tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_generate(hf, prompts: list[list[int]], new: int, sampling: bool = False) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    how = dict(do_sample=True, top_k=0, **SAMPLING) if sampling else dict(do_sample=False)
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                      min_new_tokens=new, pad_token_id=0, **how)  # fmt: skip
    return out[:, width:].tolist()


def ours_generate(model, prompts: list[list[int]], new: int, sampling: bool = False):
    import slipstream

    how = dict(SAMPLING, seed=0) if sampling else {}
    return [c.token_ids for c in slipstream.generate(model, prompts, max_new_tokens=new, **how)]


def measure(hf, ours, batch: int, new: int, reps: int, sampling: bool = False) -> dict:
    prompts = prompts_for(batch, hf.config.vocab_size)
    runs = {"transformers": lambda n: hf_generate(hf, prompts, n, sampling),
            "ours": lambda n: ours_generate(ours, prompts, n, sampling)}  # fmt: skip
    for fn in runs.values():
        fn(4)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(reps):  # alternating, so load drift hits both alike
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = fn(new)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    tok_s = {name: batch * new / min(t) for name, t in wall.items()}
    cpu_tok_s = {name: batch * new / min(t) for name, t in cpu.items()}
    same = sum(a == b for a, b in zip(outputs["transformers"], outputs["ours"], strict=True))
    return {
        "batch": batch,
        "prompt tokens": sum(map(len, prompts)),
        "new tokens": new,
        "transformers tok/s": tok_s["transformers"],
        "ours tok/s": tok_s["ours"],
        "speedup": tok_s["ours"] / tok_s["transformers"],
        "transformers tok/s (CPU time)": cpu_tok_s["transformers"],
        "ours tok/s (CPU time)": cpu_tok_s["ours"],
        "speedup (CPU time)": cpu_tok_s["ours"] / cpu_tok_s["transformers"],
        "goal": 1.0 if batch == 1 else 1.5,
        # sampling: each side draws with its own generator, so tokens are not compared
        "same tokens": "-" if sampling else f"{same}/{batch}",
    }


def build(layers: int, tiny: bool = False):
    import transformers

    import slipstream

    shape = {**SMOLLM2_135M, **(TINY if tiny else {}), "num_hidden_layers": layers}
    cfg = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    ours = common.build_random_model({**cfg.to_dict(), "model_type": "llama"})
    missing = ours.load_state_dict(hf.state_dict(), strict=False).missing_keys
    assert not missing, missing
    assert isinstance(ours, torch.nn.Module) and slipstream.generate
    return hf, ours.eval()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 layers, 16 new tokens, 1 rep")
    ap.add_argument("--tiny", action="store_true", help="hidden 64, vocab 256: overhead only")
    ap.add_argument("--sampling", action="store_true", help="temperature 0.7, top_p 0.9")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.new, args.reps = 2, 16, 1
    torch.set_num_threads(1)  # the machine's cores are shared: one thread is stable
    hf, ours = build(args.layers, args.tiny)
    with torch.no_grad():
        rows = [measure(hf, ours, b, args.new, args.reps, args.sampling) for b in (1, 16)]
    command = "python benchmarks/bench_generate.py " + " ".join(argv or sys.argv[1:])
    if args.json:
        print(json.dumps(rows))
    else:
        shape = "tiny (hidden 64, vocab 256)" if args.tiny else "SmolLM2-135M"
        how = "sampling (temperature 0.7, top_p 0.9)" if args.sampling else "greedy"
        print(f"{how} generation, {shape} shape at {args.layers} layers, float32")
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        print(common.header(common.run_info(), command.strip()), f"· load average {load}")
        print(common.markdown_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
