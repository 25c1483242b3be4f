"""Speculative decoding on the torch engine: tokens/s with and without a draft model, on tiny random Llamas.

The target is a random Llama (8 layers x 512); drafts are the target itself (every proposal accepted) and a
2-layer random model (about 60% accepted). 8 requests x 48 tokens at temperature 1, one thread. Prints one line
per side with the engine's `rollout/spec_*` metrics.

    python benchmarks/speculative.py

On CPU with models this small a forward costs about the same for 1 or 5 tokens and per-call overhead dominates,
so speculation is slower here; the gain needs a large target with a trained small draft (a GPU).
"""
import sys, time, tempfile, torch
sys.path.insert(0, "tests")
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.types import GenerationRequest, SamplingParams
torch.set_num_threads(1)
tok = tiny_tokenizer()
kw = dict(eos_token_id=None, pad_token_id=tok.pad_token_id)
target = tiny_llama(len(tok), hidden_size=512, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, **kw)
small = tiny_llama(len(tok), seed=7, **kw)
def save(m):
    p = tempfile.mkdtemp(); m.save_pretrained(p); tok.save_pretrained(p); return p
same, other = save(target), save(small)
prompt = tok("What is 7 + 3?", add_special_tokens=False).input_ids
params = SamplingParams(max_new_tokens=48, temperature=1.0)
def rate(engine, n=8):
    reqs = [GenerationRequest(i, prompt, params) for i in range(n)]
    engine.generate(reqs[:1]); engine.stats.reset()
    t = time.perf_counter(); engine.generate(reqs); s = time.perf_counter() - t
    return engine.stats.generated_tokens / s
for name, eng in [("plain, batch 8", TorchEngine(target, tok, max_batch_size=8)),
                  ("plain, batch 1", TorchEngine(target, tok, max_batch_size=1)),
                  ("spec k=4, draft = target itself", TorchEngine(target, tok, draft_model=same, draft_tokens=4)),
                  ("spec k=4, draft = 2-layer random model", TorchEngine(target, tok, draft_model=other, draft_tokens=4))]:
    r = rate(eng)
    m = eng.pop_metrics()
    print(f"{name}: {r:.1f} tokens/s {m}", flush=True)
