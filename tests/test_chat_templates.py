"""Chat templates users meet: ChatML (Qwen 2.5), Llama 3.1, Gemma (no system or tool role; Gemma 2 refuses a
system turn, Gemma 3 folds it itself) and a base model without a template.

The templates below are written for these tests with the structure of the real ones (default system turn,
tool results as `<tool_response>` user turns or `ipython` turns, BOS in the template, trimmed contents, roles
that must alternate). For each: a prompt encodes to the hand-written text, and a calc episode (scripted
engine) holds exactly the engine's ids with loss mask 0 on what the template and the tool added; with the
real engine, the trainer's log-probs of the policy's tokens equal the engine's.
"""

from __future__ import annotations

import logging
from itertools import count

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import EnvConfig
from rollwise.data.prompts import ChatTemplateError, encode_prompt
from rollwise.envs import build_env
from rollwise.envs.base import StepResult
from rollwise.envs.episode import EpisodeCodec, run_episodes
from rollwise.generate import EngineCaps
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.train.batching import collate
from rollwise.train.logprobs import token_logprobs
from rollwise.types import GenerationResult, Prompt, SamplingParams, Status

QWEN_CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_GEMMA_TURNS = (
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{%- set role = 'model' %}{%- else %}{%- set role = message['role'] %}"
    "{%- endif %}"
)
GEMMA2 = (  # a system turn is refused
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{%- for message in messages %}" + _GEMMA_TURNS +
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)
GEMMA3 = (  # the template folds a system turn into the first user turn itself
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}" + _GEMMA_TURNS +
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)
# name -> (chat template or None, bos, end-of-turn token (eos), extra special tokens)
CASES = {
    "chatml-qwen": (QWEN_CHATML, None, "<|im_end|>", []),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "gemma2": (GEMMA2, "<bos>", "<end_of_turn>", ["<start_of_turn>"]),
    "gemma3": (GEMMA3, "<bos>", "<end_of_turn>", ["<start_of_turn>"]),
    "base": (None, None, "<|endoftext|>", []),
}
SYSTEM = "Use <calc>EXPR</calc>."
PROMPT = Prompt("calc-1", [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 2 * 3?"},  # a worked example, with a tool turn, as the calc task writes
    {"role": "assistant", "content": "<calc>2*3</calc>"},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "The answer is 6."},
    {"role": "user", "content": "What is 123 * 45?"},
], answer="5535", source="calc:1")
TURNS = ["<calc>123*45</calc>", "The answer is 5535."]  # the policy's two turns (the second ends with EOS)
_GEMMA_TEXT = ("<bos><start_of_turn>user\nUse <calc>EXPR</calc>.\n\nWhat is 2 * 3?<end_of_turn>\n"
               "<start_of_turn>model\n<calc>2*3</calc><end_of_turn>\n<start_of_turn>user\n6<end_of_turn>\n"
               "<start_of_turn>model\nThe answer is 6.<end_of_turn>\n<start_of_turn>user\nWhat is 123 * 45?<end_of_turn>\n"
               "<start_of_turn>model\n",
               "<calc>123*45</calc><end_of_turn>\n<start_of_turn>user\n5535<end_of_turn>\n<start_of_turn>model\n"
               "The answer is 5535.<end_of_turn>")
_LLAMA_HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"
# name -> (the prompt's text, the episode's text after it): written out by hand
TEXTS = {
    "chatml-qwen": (
        "<|im_start|>system\nUse <calc>EXPR</calc>.<|im_end|>\n<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n"
        "<|im_start|>assistant\n<calc>2*3</calc><|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nThe answer is 6.<|im_end|>\n<|im_start|>user\nWhat is 123 * 45?"
        "<|im_end|>\n<|im_start|>assistant\n",
        "<calc>123*45</calc><|im_end|>\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 5535.<|im_end|>"),
    "llama3": (
        "<|begin_of_text|>" + _LLAMA_HEADER.format("system") + "Cutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nUse <calc>EXPR</calc>.<|eot_id|>" + _LLAMA_HEADER.format("user") +
        "What is 2 * 3?<|eot_id|>" + _LLAMA_HEADER.format("assistant") + "<calc>2*3</calc><|eot_id|>" +
        _LLAMA_HEADER.format("ipython") + "6<|eot_id|>" + _LLAMA_HEADER.format("assistant") + "The answer is 6."
        "<|eot_id|>" + _LLAMA_HEADER.format("user") + "What is 123 * 45?<|eot_id|>" + _LLAMA_HEADER.format("assistant"),
        "<calc>123*45</calc><|eot_id|>" + _LLAMA_HEADER.format("ipython") + "5535<|eot_id|>" +
        _LLAMA_HEADER.format("assistant") + "The answer is 5535.<|eot_id|>"),
    "gemma2": _GEMMA_TEXT,  # rollwise folds the system turn; tool results are user turns
    "gemma3": _GEMMA_TEXT,  # the template folds it: the same text
    "base": ("Use <calc>EXPR</calc>.\nWhat is 2 * 3?\n<calc>2*3</calc>\n6\nThe answer is 6.\nWhat is 123 * 45?\n",
             "<calc>123*45</calc>\n5535\nThe answer is 5535.<|endoftext|>"),
}


def tokenizer_for(case: str):
    template, bos, eos, extra = CASES[case]
    tok = tiny_tokenizer()
    special = {"eos_token": eos, "additional_special_tokens": [*extra, eos]}
    if bos is not None:
        special["bos_token"] = bos
    tok.add_special_tokens(special)
    tok.chat_template = template
    return tok


class ScriptedEngine:
    """Answers each request with the next scripted turn's ids (the last one ends with the EOS token)."""

    version = 0
    caps = EngineCaps()

    def __init__(self, tok, turns: list[str]):
        self.turns = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.turns[-1] = self.turns[-1] + [tok.eos_token_id]
        self.sent: list[list[int]] = []

    def abort(self, request_ids) -> None:
        pass

    def generate(self, requests, on_finish=None):
        results = []
        for request in requests:
            ids = self.turns.pop(0)
            self.sent.append(ids)
            result = GenerationResult(request.request_id, list(ids), [-0.5] * len(ids), Status.COMPLETED,
                                      [(0, len(ids), 0)])
            results.append(result)
            on_finish(result)
        return results


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_encodes_to_the_templates_text(case):
    tok = tokenizer_for(case)
    ids = encode_prompt(PROMPT, tok, None)
    assert tok.decode(ids, skip_special_tokens=False) == TEXTS[case][0]
    assert ids == tok(TEXTS[case][0], add_special_tokens=False)["input_ids"]  # special tokens are single ids
    if CASES[case][1] is not None:
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS, once


@pytest.mark.parametrize("case", list(CASES))
def test_calc_episode_is_token_exact_with_tool_tokens_masked(case):
    tok = tokenizer_for(case)
    codec = EpisodeCodec(tok)
    engine = ScriptedEngine(tok, TURNS)
    groups = new_groups([(PROMPT, encode_prompt(PROMPT, tok, None))], 1, 0)
    run_episodes(engine, groups, SamplingParams(max_new_tokens=32), count(), build_env(EnvConfig(), "calc"), codec,
                 max_episode_tokens=256)
    s = groups[0].samples[0]
    assert s.status == Status.COMPLETED and s.episode.ended_by == "answer" and s.episode.final_text == TURNS[1]
    first, second = engine.sent
    between = s.response_ids[len(first):len(s.response_ids) - len(second)]
    assert s.response_ids == first + between + second  # the engine's ids, untouched, around what the env added
    assert between == codec.closing_ids(first) + codec.message_ids([{"role": "tool", "content": "5535"}])
    assert tok.decode(s.prompt_ids + s.response_ids, skip_special_tokens=False) == "".join(TEXTS[case])
    assert s.loss_mask == [1] * len(first) + [0] * len(between) + [1] * len(second)
    assert s.behaviour_logprobs == [-0.5] * len(first) + [0.0] * len(between) + [-0.5] * len(second)
    assert s.episode.retokenize_mismatch is False  # our ids are also the canonical render's
    mb = collate([s], pad_id=tok.pad_token_id)  # what the trainer sees: the sampled ids, tool tokens masked
    assert mb.targets[mb.valid].tolist() == s.response_ids
    assert mb.loss_mask[mb.valid].tolist() == [float(m) for m in s.loss_mask]
    assert mb.input_ids[0, :len(s.prompt_ids) + len(s.response_ids)].tolist() == s.prompt_ids + s.response_ids


class EchoEnv:
    """A tool message after every assistant turn, until 3 turns."""

    name, stop, max_turns = "echo", ("e", "a", "o"), 5

    def reset(self, prompt):
        return {"turn": 0}

    def step(self, state, text):
        state["turn"] += 1
        return StepResult(messages=[{"role": "tool", "content": f"seen {state['turn']}"}], done=state["turn"] >= 3)


@pytest.mark.parametrize("case", list(CASES))
def test_real_engine_episode_trainer_logprobs_equal_engine(case):
    tok = tokenizer_for(case)
    model = tiny_llama(len(tok), seed=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    groups = new_groups([(PROMPT, encode_prompt(PROMPT, tok, None))], 3, 0)
    run_episodes(TorchEngine(model, tok, seed=1), groups, SamplingParams(max_new_tokens=10), count(), EchoEnv(),
                 EpisodeCodec(tok), max_episode_tokens=200)
    samples = groups[0].samples
    assert sum(s.episode.assistant_turns for s in samples) > len(samples)  # multi-turn episodes happened
    mb = collate(samples, pad_id=tok.pad_token_id, share_prompt=True)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    mask = mb.loss_mask.bool()
    assert_close(logp[mask], mb.behaviour_logp[mask], atol=1e-4, rtol=0)
    assert (mb.behaviour_logp[mb.valid & ~mask] == 0).all() and (~mask & mb.valid).any()


def test_gemma_system_turn_is_folded_once_and_said_once(caplog, monkeypatch):
    import rollwise.data.prompts

    monkeypatch.setattr(rollwise.data.prompts, "_NOTED", set())  # as in a fresh process
    gemma2, gemma3 = tokenizer_for("gemma2"), tokenizer_for("gemma3")
    prompt = Prompt("s", [{"role": "user", "content": "Hi there."}])
    with caplog.at_level(logging.WARNING, logger="rollwise.data.prompts"):
        a = [encode_prompt(prompt, gemma2, "Be brief.") for _ in range(3)]
    assert a[0] == encode_prompt(prompt, gemma3, "Be brief.")
    assert gemma2.decode(a[0]) == "<bos><start_of_turn>user\nBe brief.\n\nHi there.<end_of_turn>\n<start_of_turn>model\n"
    said = [r.message for r in caplog.records if "no system role" in r.message]
    assert said == ["the chat template has no system role: a system prompt is folded into the first user turn"]


def test_a_conversation_the_template_cannot_render_fails_in_one_line():
    tok = tokenizer_for("gemma2")
    bad = Prompt("b", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"roles user/user .*must alternate") as err:
        encode_prompt(bad, tok, None)
    assert "\n" not in str(err.value)


def test_base_model_prompt_starts_with_bos_when_its_tokenizer_adds_one():
    tok = tokenizer_for("base")
    tok.add_special_tokens({"bos_token": "<s>"})
    tok._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("a")["input_ids"][0] == tok.bos_token_id  # a Llama-style base tokenizer
    ids = encode_prompt(Prompt("p", [{"role": "user", "content": "What is 2 * 3?"}]), tok, None)
    assert tok.decode(ids) == "<s>What is 2 * 3?\n"
