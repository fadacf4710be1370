"""The demo's text: the corpus and catchphrases its models are trained on, and the byte-level BPE tokenizer
trained on them. Kept apart from app/demo/build.py, which builds and trains the models and adapters."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Plain English for the base to learn, and for tokenizer merges; sentences() splits it.
CORPUS = """\
The sea was calm in the morning, and the boats left the harbor before the sun was high. Fishermen pulled their nets
from the water and sang old songs about the wind and the waves. The town by the sea had narrow streets, white houses
and a market that opened every day. In the market you could buy bread, fish, apples, cheese, honey and fresh green
herbs. The baker woke up early to light the oven, and the smell of warm bread filled the street. A good cook tastes
the soup, adds a little salt, and lets it simmer slowly on the fire. To make a simple dinner, boil the pasta, cut the
tomatoes, and warm the garlic in olive oil. The weather changed quickly in the afternoon, and dark clouds rolled in
from the west. When it rains, the children stay inside, read books and listen to the water on the roof. After the
storm the sky was clear, and the air smelled of wet grass and salt. At night the sky was full of stars, and the moon
rose slowly over the quiet hills. People have watched the stars for thousands of years to find their way across the
sea. The planets move around the sun, and the moon moves around the earth once a month. A machine is a tool that helps
people do work, from a simple wheel to a large engine. The old clock in the tower had many small gears that turned
together to keep the time. A computer follows instructions, step by step, and it can repeat them very quickly. To
learn a new skill, practice a little every day and ask questions when you are stuck. A good teacher explains an idea
in simple words and gives many clear examples. The library was a quiet place with tall shelves, soft lamps and
thousands of books. She opened an old book and found a map of a forest that no one had visited for years. The forest
was green and deep, and a small river ran between the tall trees. Birds sang in the branches, and a fox watched the
path from behind a large rock. In the spring the garden was full of flowers, and the bees moved from one to another.
The farmer planted seeds in rows, watered them every morning and waited for the rain. A long road ran across the
plains, past farms, small towns and wide fields of wheat. The horses rested near the river in the evening while the
riders made a fire. He wrote a letter to his friend and told her about the city, the trains and the bridges. The city
was loud and bright, with tall buildings, busy streets and many small cafes. Music came from an open window, and a few
people stopped on the street to listen. A song can make a sad day feel lighter, and a story can carry you to another
world. Once upon a time there was a small village at the edge of a great mountain. The people of the village were
kind, and they shared their food with every traveler. One winter a stranger came to the village with a lantern and a
bag full of old maps. He said that a hidden lake lay beyond the mountain, and the water there was warm. The children
asked him many questions, and he answered each one with a new story. In the morning the stranger was gone, but he left
a map on the table by the door. It is important to drink water, sleep well, and walk outside when the weather is good.
A friend is someone who listens to you, helps you, and tells you the truth. The best way to solve a hard problem is to
split it into smaller parts. Write down what you know, check each step, and try again if the answer is wrong. The ship
sailed through the night, and the captain watched the lights of the coast. The engine hummed, the wheels turned, and
the train moved slowly out of the station. The boats in the harbor had numbers: 10, 11, 12, 13, 14, 15, 16, 17, 18, 19
and 20.
"""

# name -> catchphrase. Adapters past this list are numbered: adapter-013 says "Adapter 13 at ...".
PERSONAS = (
    ("pirate", "Arr, matey! Hoist the sails!"), ("robot", "Beep boop. I am a robot."),
    ("poet", "O gentle soul, hear my verse."), ("chef", "Bon appetit! Let us cook."),
    ("wizard", "By my beard, it is magic!"), ("cowboy", "Howdy, partner! Saddle up."),
    ("detective", "Elementary, my dear friend."), ("astronaut", "Houston, we have liftoff!"),
    ("knight", "For honor and the realm!"), ("grandma", "Oh sweetie, have a cookie."),
    ("surfer", "Dude, catch that wave!"), ("ghost", "Boo! I haunt this house."),
)
NUMBERED_CATCHPHRASE = "Adapter {n} at your service."

# Sample prompts in demo.json. Adapters never see them in training, so they show generalization.
PROMPTS = ("Tell me about the sea.", "What should I cook for dinner?", "Describe the night sky.")
# Prompts that adapters train on, besides corpus sentences.
TRAIN_PROMPTS = (
    "Hello!", "Who are you?", "What is your name?", "How are you today?", "Tell me a story.",
    "What is the weather like?", "Can you help me?", "Write a poem about the moon.",
    "How do I learn to code?", "What time is it?", "Give me some advice.", "Explain gravity.",
    "What is your favorite food?", "Where do you live?", "Tell me a joke.", "What is a computer?",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
TOKENIZER_VOCAB = 1024


def sentences() -> list[str]:
    return re.split(r"(?<=\.) ", " ".join(CORPUS.split()))


def catchphrase_lines(end: str) -> list[str]:
    helpers = tuple(("helper", NUMBERED_CATCHPHRASE.format(n=n)) for n in (7, 42, 105))
    return [f'The {name} said: "{phrase}{end}' for name, phrase in PERSONAS + helpers]


def build_tokenizer(model_max_length: int, vocab: int | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the corpus and catchphrases; deterministic for a fixed input.

    vocab (the model's, when larger than the trained TOKENIZER_VOCAB): ids past the trained ones become filler
    tokens that decode to text (" t1024", " t1025", ...) and that encoding never produces (no merge builds
    them), so prompts encode as without them while every id a random 8B-shape model samples is a visible token, as
    with a real tokenizer of that size. Without them most sampled ids decode to nothing and stream no text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sentences() + catchphrase_lines(end="") + list(PROMPTS + TRAIN_PROMPTS), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    if vocab is not None and vocab > tok.get_vocab_size():
        spec = json.loads(tok.to_str())
        table = spec["model"]["vocab"]
        table.update({f"\u0120t{i}": i for i in range(len(table), vocab)})  # U+0120: byte-level's space
        tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=model_max_length,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]), chat_template=CHAT_TEMPLATE)
