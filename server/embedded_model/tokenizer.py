"""The embedded models' tokenizer: a byte-level BPE trained locally and deterministically (no
downloads) on the short corpus below, with a chat template over role tokens. Same arguments ->
byte-identical files."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
# Ids 0..6 in this order: tests and the engine may rely on bos=0, eos=1, pad=2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Each message is "<|role|>\n{content}<|end_of_text|>\n", so an assistant turn ends on EOS and the
# engine needs a single stop id. Unknown roles are an error rather than a silently odd prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Plain English written for this module; enough distinct words for ~1000 BPE merges.
CORPUS = """\
The morning fog rolled slowly over the harbour, and the fishing boats waited at their moorings
until the light grew strong enough to see the rocks beyond the breakwater. An old sailor sat on
the steps of the customs house, mending a net with quick, patient fingers. He had done the same
work every spring for forty-two years, and he could tell the weather from the colour of the gulls.

A small library stood at the corner of the market square. Its shelves held atlases, cookbooks,
histories of forgotten kingdoms and a few novels that nobody had borrowed since 1987. The
librarian, a tall woman with silver glasses, believed that every book waited for its reader, and
that the waiting was part of the story. Children came on Saturdays to hear her read aloud.

Computers follow instructions one step at a time. A program is a list of such steps, written in a
language that both people and machines can understand. When a program runs, the processor fetches
each instruction from memory, decodes it, and executes it. Modern chips do many of these things in
parallel, which is why a laptop can play music, download files and check the spelling of a letter
all at once. Still, the basic idea has not changed since the first machines filled whole rooms.

To bake simple bread, mix 500 grams of flour with 10 grams of salt, 7 grams of yeast and 350
millilitres of warm water. Knead the dough for ten minutes until it feels smooth and elastic. Let
it rise in a warm place for about an hour, then shape it into a loaf, cover it, and wait another
forty minutes. Bake at 220 degrees for thirty minutes, or until the crust is golden and the loaf
sounds hollow when you tap the bottom.

The river begins as a spring high in the mountains, where snow melts under the summer sun. It
gathers streams from the valleys, turns mills in the old villages, and grows wide and slow as it
crosses the plain. Herons stand in the shallows, frogs sing in the reeds, and in the evening the
water reflects the orange sky. At last the river meets the sea, and its fresh water mixes with
the salt tide in a broad, muddy estuary full of birds.

Questions are the beginning of science. Why does the moon change its shape? Why do leaves turn red
and yellow in autumn? How far away are the stars? People have asked these questions for thousands
of years. Careful observation, honest measurement and clear reasoning slowly turned guesses into
knowledge. A good experiment can be repeated by anyone, anywhere, and it should give the same
answer each time. That is what makes a result worth trusting.

"Could you help me plan a trip?" asked the traveller. "Of course," said the guide. "Where would you
like to go, and how many days do you have?" They talked about trains and ferries, cheap hotels and
quiet beaches, museums that open late and restaurants that serve fresh fish. By the end of the
afternoon they had a plan for nine days, three cities and one very long walk along the coast.

Good software is tested. Each function should do one thing, have a clear name, and return the
same output for the same input. Tests check that the answer is right today and stays right after
someone changes the code tomorrow. When a test fails, read the message, find the smallest example
that shows the problem, fix the cause rather than the symptom, and then run the tests again.

On the first warm evening of the year the whole street carried chairs outside. Neighbours who had
nodded at each other all winter now shared lemonade, gossip and advice about tomatoes. A boy
practised the violin by an open window, badly at first and then a little better, while two dogs
argued about a stick. Nobody wanted to go back indoors before the stars came out.

Mathematics is the study of patterns. Two plus two is four, the angles of a triangle add up to 180
degrees, and a prime number has exactly two divisors. Some patterns are easy to notice but hard to
prove; others hide for centuries until someone looks at them from a new direction. Numbers like 3,
5, 8, 13 and 21 appear in sunflowers, pine cones and shells, which surprises almost everyone.

The weather report for tomorrow: cloudy in the north with light rain after midday, bright and
breezy in the south, and temperatures between 12 and 19 degrees. Winds will be westerly, becoming
strong near the coast in the evening. Drivers should expect mist on high roads early on Thursday.

Dear Sam, thank you for your kind letter and the photographs from your holiday. The garden here is
full of roses, the cat has learned to open the kitchen door, and I finally finished painting the
fence. Please write again soon, and give my best wishes to your family. With love, Ellen.
"""


def _train_bpe(vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any UTF-8 text encodes and decodes exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prepend BOS on encode(add_special_tokens=True), like Llama 3; chat prompts get it from the
    # template and must be encoded with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def build_tokenizer(vocab_size: int = 1000, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The tiny tokenizer in memory (see ``make_tokenizer``)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Byte-level BPE never needs an unknown token, but without one AutoTokenizer loads a qwen2
        # checkpoint as Qwen2Tokenizer, which then appends "<|endoftext|>" past the model's vocab.
        unk_token=EOS_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # the clean-up rewrites " ." to "." and breaks round trips
        model_max_length=model_max_length,
    )


def make_tokenizer(
    path: str | Path, vocab_size: int = 1000, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer and save it into ``path``; returns the tokenizer."""
    tokenizer = build_tokenizer(vocab_size, model_max_length)
    tokenizer.save_pretrained(str(path))
    return tokenizer
