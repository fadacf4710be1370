"""vLLM's logits processors, batched on the device, against transformers' own processors and OpenAI's formula."""

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from app.errors import InvalidRequest
from app.sampling.penalties import apply_penalties
from app.sampling.sampler import RowParams, sample_batch, sample_rows
from app.sampling.params import SamplingParams
from engine_helpers import run_all

EOS = [2]


@dataclass
class Row:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    seed: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula over the generated tokens only, written out directly:
    mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty."""

    def __init__(self, prompt_length: int, frequency: float, presence: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        for b, row in enumerate(input_ids[:, self.prompt_length:].tolist()):
            for token in row:
                counts[b, token] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def reference_processors(params: SamplingParams, prompt_length: int) -> LogitsProcessorList:
    """transformers' processors in vLLM's order: min_tokens, logit_bias, repetition, frequency/presence."""
    processors = LogitsProcessorList()
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens,
                                                            EOS + list(params.stop_token_ids)))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(OpenAIPenalties(prompt_length, params.frequency_penalty, params.presence_penalty))
    return processors


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=20, min_tokens=rng.choice([0, 0, 3, 20]),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(vocab), rng.choice([0, 1, 5]))),
        repetition_penalty=rng.choice([1.0, 1.0, 0.7, 1.3, 2.0]), frequency_penalty=rng.choice([0.0, -1.5, 0.8]),
        presence_penalty=rng.choice([0.0, 2.0, -0.4]), stop_token_ids=tuple(rng.sample(range(vocab), 2)))


def test_batched_processors_equal_transformers_per_row():
    rng, gen, vocab = random.Random(0), torch.Generator().manual_seed(0), 50
    for _ in range(30):
        rows = [Row(random_params(rng, vocab), [rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
                    [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]) for _ in range(8)]
        logits = 4 * torch.randn(8, vocab, generator=gen)
        got = apply_penalties(logits, rows, EOS)
        for b, row in enumerate(rows):
            input_ids = torch.tensor([row.prompt_ids + row.output_ids])
            expected = reference_processors(row.params, len(row.prompt_ids))(input_ids, logits[b:b + 1].clone())[0]
            torch.testing.assert_close(got[b], expected, rtol=1e-6, atol=1e-5, msg=str(row.params))


def test_rows_without_processors_are_untouched_and_skip_the_work():
    logits = torch.randn(3, 20)
    rows = [Row(SamplingParams(), [1, 2]), Row(SamplingParams(presence_penalty=1.0), [3], [4, 4]),
            Row(SamplingParams(), [5])]
    got = apply_penalties(logits, rows, EOS)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 4] == logits[1, 4] - 1.0 and got[1, 3] == logits[1, 3]  # presence counts output tokens only
    plain = [Row(SamplingParams(), [1])] * 3
    assert apply_penalties(logits, plain, EOS) is logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 2] = logits[:, 7] = 10.0  # EOS and a stop token are the likeliest
    params = SamplingParams(min_tokens=3, stop_token_ids=(7,), temperature=0.0)
    rows = [Row(params, [1], [4, 4]), Row(params, [1], [4, 4, 4])]
    choices, _ = sample_batch(logits, rows, EOS)
    assert choices[0][0] not in (2, 7) and choices[1][0] in (2, 7)


def test_seeded_sampling_with_penalties_is_reproducible_across_batches():
    gen = torch.Generator().manual_seed(5)
    mine = Row(SamplingParams(temperature=1.0, seed=11, frequency_penalty=0.5, repetition_penalty=1.2,
                              logit_bias=((3, 5.0),)), [1, 2, 3], [3, 4], seed=11)
    row = torch.randn(100, generator=gen)
    drawn = set()
    for position, batch_size in [(0, 1), (2, 4)]:
        others = [Row(SamplingParams(temperature=0.7, presence_penalty=1.0), [5, 6], [7], seed=i)
                  for i in range(batch_size)]
        others[position] = mine
        logits = torch.randn(batch_size, 100, generator=gen)
        logits[position] = row
        drawn.add(sample_batch(logits, others, EOS)[0][position][0])
    assert len(drawn) == 1


def test_processed_logits_drive_greedy_and_sampled_rows():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    biased = SamplingParams(temperature=0.0, logit_bias=((0, 100.0),))
    rows = [Row(biased, [1]), Row(SamplingParams(temperature=0.0), [1])]
    assert [t for t, _ in sample_batch(logits, rows, EOS)[0]] == [0, 1]
    sampled = SamplingParams(temperature=1.0, top_k=1, logit_bias=((2, 100.0),))
    processed = apply_penalties(logits, [Row(sampled, [1])] * 2, EOS)
    assert sample_rows(processed, RowParams.from_params([sampled] * 2, [1, 2], [0, 0], "cpu")).tolist() == [2, 2]


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("min_tokens", 17),
                                         ("logit_bias", ((1, 101.0),)), ("stop_token_ids", (-1,))])
def test_out_of_range_processor_parameters_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(max_tokens=16, **{field: value})


# --- end to end: the engine's greedy tokens equal PEFT's generate with the same processors --------------

CASES = [
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.8),
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=0.6),
    SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.7),
    SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=-2.0),
    SamplingParams(max_tokens=16, temperature=0.0, logit_bias=((40, 8.0), (41, -100.0), (300, 6.5))),
    SamplingParams(max_tokens=16, temperature=0.0, min_tokens=14, stop_token_ids=(97, 98)),
    SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4, repetition_penalty=1.3, frequency_penalty=0.4,
                   logit_bias=((12, 3.0),)),
]


@pytest.fixture(scope="module")
def peft_models(demo_dir, manifest):
    models = {}
    for adapter in [None, manifest["adapters"][0]]:
        model = AutoModelForCausalLM.from_pretrained(Path(demo_dir) / "base", dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, Path(demo_dir) / adapter["path"])
        models[None if adapter is None else adapter["name"]] = model.eval()
    return models


def reference_tokens(model, tokenizer, prompt: str, params: SamplingParams) -> list[int]:
    inputs = tokenizer(prompt, return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=params.max_tokens,
                             logits_processor=reference_processors(params, prompt_length),
                             eos_token_id=EOS + list(params.stop_token_ids), pad_token_id=0)
    return out[0, prompt_length:].tolist()


def test_engine_greedy_tokens_equal_peft_with_the_same_processors(make_engine, peft_models, manifest):
    engine = make_engine(num_slots=2)
    expected, ids = {}, {}
    for i, params in enumerate(CASES):
        for adapter, model in peft_models.items():
            prompt = manifest["prompts"][i % len(manifest["prompts"])]
            request = engine.add_request(prompt, adapter, params)
            ids[request.request_id] = (i, adapter)
            expected[i, adapter] = reference_tokens(model, engine.tokenizer, prompt, params)
    tokens = run_all(engine, check=True)
    for request_id, key in ids.items():
        assert tokens[request_id] == expected[key], (CASES[key[0]], key[1])
    changed = [expected[i, None] != expected[0, None] for i in range(1, len(CASES))]
    assert sum(changed) >= 3, "the cases should steer generation apart"


def test_ids_outside_the_vocabulary_are_refused(make_engine):
    engine = make_engine(register=False)
    for field in ("logit_bias", "stop_token_ids"):
        value = ((5000, 1.0),) if field == "logit_bias" else (5000,)
        with pytest.raises(InvalidRequest, match=f"{field} has token id 5000"):
            engine.add_request("hi", None, SamplingParams(**{field: value}))
