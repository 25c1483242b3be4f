"""A researcher's own post-training loops, written only against the official `tinker` SDK (nothing from rollwise),
as docs/tinker.md shows them: SFT with `cross_entropy`, RL (sample, score, `importance_sampling` or `ppo`), and a
save/load round trip. Point it at any Tinker API server, e.g. `rollwise serve --api tinker`:

    TINKER_BASE_URL=http://127.0.0.1:8765 TINKER_API_KEY=tml-... python tests/tinker_loops.py smollm2-135m-instruct

It prints one JSON object (the SFT losses, the RL rewards per step, whether the weights came back identical).
tests/test_tinker.py runs these functions against a real `rollwise serve --api tinker` subprocess.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

import numpy as np
import tinker
from tinker import types

SFT_TEXTS = ["the cat sat on the mat.", "a dog ran in the park.", "one two three four five."]


def sft_datum(ids: list[int]) -> types.Datum:
    """Next-token prediction over the whole text: inputs ids[:-1], targets ids[1:], every token weighted 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def sft(service: tinker.ServiceClient, base_model: str, steps: int = 6, lr: float = 1e-2, rank: int = 0,
        texts: list[str] = SFT_TEXTS) -> tuple[tinker.TrainingClient, list[float]]:
    """Supervised fine-tuning; returns the client and the mean per-token loss at every step."""
    client = service.create_lora_training_client(base_model=base_model, rank=rank).result()
    tokenizer = client.get_tokenizer()
    data = [sft_datum(tokenizer.encode(t)) for t in texts]
    tokens = sum(d.model_input.length for d in data)
    losses = []
    for _ in range(steps):
        fwd_bwd = client.forward_backward(data, "cross_entropy")
        optim = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fwd_bwd.result().metrics["loss:sum"] / tokens)
        optim.result()
    return client, losses


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    """prompt + sampled tokens; the loss acts on the sampled tokens only (advantage 0 on the prompt)."""
    full = prompt + seq.tokens
    pad = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:],
                                       "logprobs": [0.0] * pad + list(seq.logprobs),
                                       "advantages": [0.0] * pad + [advantage] * len(seq.tokens)})


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """A prompt's token ids: the text itself, or (chat) one user turn in the model's chat template."""
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer.encode(text)


def rl(service: tinker.ServiceClient, base_model: str, prompts: list[str] | Callable[[int], list[str]],
       reward: Callable[[str, list[int], str], float], steps: int = 8, group: int = 16, lr: float = 3e-2,
       rank: int = 8, max_tokens: int = 6, loss_fn: str = "importance_sampling", loss_fn_config: dict | None = None,
       chat: bool = False, temperature: float = 1.0,
       client: tinker.TrainingClient | None = None) -> tuple[tinker.TrainingClient, list[float]]:
    """GRPO-style RL: every step, `group` samples of each prompt (`prompts` itself, or `prompts(step)`: fresh
    ones every step), scored by `reward(prompt text, tokens, text)`, advantage = reward - the mean of its group,
    one forward_backward + optim_step. Trains `client`, or a new LoRA client of `rank`. Returns the client and
    the mean reward of every step."""
    if client is None:
        client = service.create_lora_training_client(base_model=base_model, rank=rank, seed=0).result()
    tokenizer = client.get_tokenizer()
    rewards = []
    for step in range(steps):
        texts = prompts(step) if callable(prompts) else prompts
        encoded = [encode_prompt(tokenizer, t, chat) for t in texts]
        sampler = client.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(types.ModelInput.from_ints(p), group,  # sent together: one batch on the server
                                  types.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                       seed=1000 * step + i))
                   for i, p in enumerate(encoded)]
        data, step_rewards = [], []
        for text, prompt, future in zip(texts, encoded, futures):
            seqs = future.result().sequences
            scores = [reward(text, s.tokens, tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in seqs]
            mean = float(np.mean(scores))
            step_rewards.extend(scores)
            data += [rl_datum(prompt, s, r - mean) for s, r in zip(seqs, scores) if s.tokens and r != mean]
        rewards.append(float(np.mean(step_rewards)))
        if data:  # a step whose groups all tie teaches nothing
            fwd_bwd = client.forward_backward(data, loss_fn, loss_fn_config)
            optim = client.optim_step(types.AdamParams(learning_rate=lr))
            fwd_bwd.result()
            optim.result()
    return client, rewards


def greedy_accuracy(client: tinker.TrainingClient, prompts: list[str], reward: Callable[[str, list[int], str], float],
                    max_tokens: int, chat: bool = False) -> tuple[float, list[str]]:
    """The mean reward of the model's greedy (temperature 0) answer to each prompt, with the answers."""
    tokenizer = client.get_tokenizer()
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(encode_prompt(tokenizer, p, chat)), 1, params)
               for p in prompts]  # sent together: one batch on the server
    tokens = [f.result().sequences[0].tokens for f in futures]
    answers = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return float(np.mean([reward(p, t, a) for p, t, a in zip(prompts, tokens, answers)])), answers


def forward_logprobs(client: tinker.TrainingClient, data: list[types.Datum]) -> list[list[float]]:
    """The per-token log-probs the model gives `data` now (no gradient)."""
    out = client.forward(data, "cross_entropy").result()
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def even_share(prompt: str, tokens: list[int], text: str) -> float:
    """A deterministic toy reward: the share of sampled token ids that are even."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def main(base_model: str) -> dict:
    service = tinker.ServiceClient()
    client, losses = sft(service, base_model)
    probe = [sft_datum(client.get_tokenizer().encode(t)) for t in SFT_TEXTS]
    path = client.save_state("sft-final").result().path
    before = forward_logprobs(client, probe)
    restored = service.create_training_client_from_state(path).result()
    identical = forward_logprobs(restored, probe) == before
    _, rewards = rl(service, base_model, ["Count:"], even_share)
    service.close("success").result()
    return {"sft_losses": losses, "rl_rewards": rewards, "state": path, "identical_after_load": identical}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct")))
